"""lightning-mpt: mixed-precision training for PyTorch Lightning with fp32 master weights, a tunable dynamic
loss scaler, and diagnostics of the numerics.

Example:
    ```python
    import lightning as L
    from lightning_mpt import MPTPrecision

    trainer = L.Trainer(plugins=[MPTPrecision("fp16")])
    ```
"""

from lightning_mpt.precision import MPTPrecision, NonFiniteGradientError, StepRecord
from lightning_mpt.scaler import DynamicLossScaler

__all__ = ["DynamicLossScaler", "MPTPrecision", "NonFiniteGradientError", "StepRecord"]
__version__ = "0.1.0"
