"""lightning-mpt: mixed-precision training for PyTorch Lightning with fp32 master weights, a tunable dynamic loss
scaler, and diagnostics of the numerics.

Example:
    ```python
    import lightning as L
    from lightning_mpt import MPTPrecision

    trainer = L.Trainer(plugins=[MPTPrecision("fp16")])
    ```

The public names are imported on first use, so that tools that only read logs (``lightning-mpt report``) start
without importing Lightning.
"""

from typing import TYPE_CHECKING

from lightning_mpt._lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_mpt.core.config import Fp8Options, MasterOptions, SkipPolicy
    from lightning_mpt.core.masters import DEFAULT_KEEP_FP32
    from lightning_mpt.core.scaler import DynamicLossScaler
    from lightning_mpt.precision import MPTPrecision, NonFiniteGradientError, StepRecord

_EXPORTS = {
    "DEFAULT_KEEP_FP32": "lightning_mpt.core.masters",
    "DynamicLossScaler": "lightning_mpt.core.scaler",
    "Fp8Options": "lightning_mpt.core.config",
    "MasterOptions": "lightning_mpt.core.config",
    "SkipPolicy": "lightning_mpt.core.config",
    "MPTPrecision": "lightning_mpt.precision",
    "NonFiniteGradientError": "lightning_mpt.precision",
    "StepRecord": "lightning_mpt.precision",
}
__all__ = [
    "DEFAULT_KEEP_FP32",
    "DynamicLossScaler",
    "Fp8Options",
    "MPTPrecision",
    "MasterOptions",
    "SkipPolicy",
    "NonFiniteGradientError",
    "StepRecord",
]
__version__ = "0.1.0"
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
