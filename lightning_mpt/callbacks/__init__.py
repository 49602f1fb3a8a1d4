"""Diagnostic callbacks: the numerics of a mixed-precision run in TensorBoard (tags of DESIGN.md §5, under ``mpt/``).

Example:
    ```python
    import lightning as L
    from lightning_mpt import MPTPrecision
    from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor

    trainer = L.Trainer(
        plugins=[MPTPrecision("fp16")],
        callbacks=[LossScaleMonitor(), GradientHistogramMonitor(), UnderflowMonitor()],
        logger=L.pytorch.loggers.TensorBoardLogger("runs"),
    )
    ```
"""

from lightning_mpt.callbacks.dashboard import CATEGORY, mixed_precision_layout
from lightning_mpt.callbacks.histograms import GradientHistogramMonitor
from lightning_mpt.callbacks.loss_scale import LossScaleMonitor
from lightning_mpt.callbacks.tensor_cores import TensorCoreCheck, TensorCoreFinding, tensor_core_report
from lightning_mpt.callbacks.underflow import FlushStatistics, ReferenceStats, UnderflowMonitor

__all__ = [
    "CATEGORY",
    "FlushStatistics",
    "GradientHistogramMonitor",
    "LossScaleMonitor",
    "ReferenceStats",
    "TensorCoreCheck",
    "TensorCoreFinding",
    "UnderflowMonitor",
    "mixed_precision_layout",
    "tensor_core_report",
]
