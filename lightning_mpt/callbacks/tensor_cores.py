"""``TensorCoreCheck``: layer and batch sizes that keep fp16/bf16 matmuls off Tensor Cores."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl

from lightning_mpt.callbacks._monitor import Monitor
from lightning_mpt.diagnostics.cadence import check_every
from lightning_mpt.diagnostics.plugin import half_format
from lightning_mpt.diagnostics.tensor_cores import (
    TensorCoreFinding,
    tensor_core_report,
    tensor_core_warning,
    write_tensor_cores,
)


class TensorCoreCheck(Monitor):
    """At the start of training under fp16/bf16, warn about Linear/Conv/attention layers and a batch size whose
    dimensions are not multiples of ``multiple`` (8 for Tensor Cores), and write the list as the TensorBoard text
    ``mpt/tensor_cores``.

    Args:
        multiple: the multiple the dimensions should have.
        strict: re-raise internal errors instead of a warning (``None``: the environment variable
            ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Example:
        ```python
        import lightning as L
        from lightning_mpt import MPTPrecision
        from lightning_mpt.callbacks import TensorCoreCheck

        trainer = L.Trainer(plugins=[MPTPrecision("bf16")], callbacks=[TensorCoreCheck()])
        ```
    """

    def __init__(self, multiple: int = 8, strict: Optional[bool] = None) -> None:
        super().__init__(strict)
        self.multiple = check_every("TensorCoreCheck", "multiple", multiple)
        self.findings: list[TensorCoreFinding] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.on:
            return
        with self.setup_stat.guarded():
            fmt = half_format(trainer.precision_plugin)
            if fmt is None:
                return
            self.findings = tensor_core_report(pl_module, _batch_size(trainer), self.multiple)
            if self.findings:
                self.session.warn_once(tensor_core_warning("TensorCoreCheck", self.findings, fmt, self.multiple))
                write_tensor_cores(self.sink, self.findings, fmt, self.multiple, trainer.global_step)


def _batch_size(trainer: pl.Trainer) -> Optional[int]:
    loader: Any = trainer.train_dataloader
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None
