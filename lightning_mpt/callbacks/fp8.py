"""``Float8Monitor``: what torchao's fp8 casts do to each converted layer (the statistics of
:class:`~lightning_mpt.diagnostics.fp8.Float8Statistics`; this module holds when to measure)."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl

from lightning_mpt.callbacks._monitor import Monitor, accumulating
from lightning_mpt.diagnostics.cadence import check_every
from lightning_mpt.diagnostics.dashboard import FP8_CHARTS
from lightning_mpt.diagnostics.fp8 import Float8Statistics


class Float8Monitor(Monitor):
    """Log, per fp8 layer and role (``input``, ``weight``, ``grad_output``), the amax, torchao's scale, and the
    fractions of values its fp8 cast saturates, flushes to zero or makes subnormal (docs/fp8.md).

    Tags, every ``every_n_steps``: ``mpt/fp8/saturated_fraction``, ``mpt/fp8/flush_fraction``,
    ``mpt/fp8/subnormal_fraction`` over all layers and, with ``per_layer``, each of them and ``mpt/fp8/amax``,
    ``mpt/fp8/scale`` under ``/<layer>/<role>``. Hooks exist on measuring steps only; the values are read with the
    other monitors' one host sync.

    Args:
        every_n_steps: optimizer steps between measurements; ``None`` takes the Trainer's ``log_every_n_steps``.
        per_layer: also log each layer's and role's values.
        strict: re-raise internal errors instead of a warning that turns the statistic off (``None``: the environment
            variable ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Example:
        ```python
        import lightning as L
        from lightning_mpt import MPTPrecision
        from lightning_mpt.callbacks import Float8Monitor

        trainer = L.Trainer(plugins=[MPTPrecision("bf16", fp8="tensorwise")], callbacks=[Float8Monitor()])
        ```
    """

    charts = FP8_CHARTS

    def __init__(self, every_n_steps: Optional[int] = None, per_layer: bool = True, strict: Optional[bool] = None):
        super().__init__(strict)
        self.every_n_steps = check_every("Float8Monitor", "every_n_steps", every_n_steps, allow_none=True)
        self.statistics = Float8Statistics(1, per_layer, "Float8Monitor", strict)

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_every: int = getattr(trainer, "log_every_n_steps", 0)
        self.statistics.every_n_steps = self.every_n_steps or log_every or 1
        self.statistics.set_up(self.session, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.on:
            self.statistics.arm(self.recorder, trainer.global_step)

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        if not accumulating(trainer, pl_module):
            self.statistics.after_backward(self.recorder)  # logged at the step the hooks were armed at

    def release(self, trainer: pl.Trainer) -> None:
        self.statistics.release()
