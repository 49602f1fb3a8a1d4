"""Diagnostic callbacks: the numerics of a mixed-precision run in TensorBoard, under the ``mpt/`` tags.

The tags and the numbers' definitions: docs/concepts.md#tensorboard-tags and docs/concepts.md#definitions.

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

from typing import TYPE_CHECKING

from lightning_mpt._lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_mpt.callbacks.fp8 import Float8Monitor
    from lightning_mpt.callbacks.histograms import GradientHistogramMonitor
    from lightning_mpt.callbacks.loss_scale import LossScaleMonitor
    from lightning_mpt.callbacks.tensor_cores import TensorCoreCheck
    from lightning_mpt.callbacks.underflow import UnderflowMonitor
    from lightning_mpt.diagnostics.dashboard import CATEGORY, mixed_precision_layout
    from lightning_mpt.diagnostics.reference import FlushStatistics, ReferenceStats
    from lightning_mpt.diagnostics.statistic import DiagnosticsWarning
    from lightning_mpt.diagnostics.tensor_cores import TensorCoreFinding, tensor_core_report

_EXPORTS = {
    "CATEGORY": "lightning_mpt.diagnostics.dashboard",
    "DiagnosticsWarning": "lightning_mpt.diagnostics.statistic",
    "Float8Monitor": "lightning_mpt.callbacks.fp8",
    "FlushStatistics": "lightning_mpt.diagnostics.reference",
    "GradientHistogramMonitor": "lightning_mpt.callbacks.histograms",
    "LossScaleMonitor": "lightning_mpt.callbacks.loss_scale",
    "ReferenceStats": "lightning_mpt.diagnostics.reference",
    "TensorCoreCheck": "lightning_mpt.callbacks.tensor_cores",
    "TensorCoreFinding": "lightning_mpt.diagnostics.tensor_cores",
    "UnderflowMonitor": "lightning_mpt.callbacks.underflow",
    "mixed_precision_layout": "lightning_mpt.diagnostics.dashboard",
    "tensor_core_report": "lightning_mpt.diagnostics.tensor_cores",
}
__all__ = [
    "CATEGORY",
    "DiagnosticsWarning",
    "Float8Monitor",
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
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
