"""``LossScaleMonitor``: the loss scale, skipped steps, overflows and their causes, at every optimizer step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, Optional

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_mpt.callbacks._monitor import Monitor
from lightning_mpt.diagnostics.cadence import check_every
from lightning_mpt.diagnostics.loss_scale import LossScaleLog, ScaleTracker, Suspects


class LossScaleMonitor(Monitor):
    """Log the loss scale, cumulative skipped steps, a 0/1 overflow per optimizer step, scale growths and back-offs,
    and, at each skipped step, which parameters had inf/NaN gradients and whether the loss itself was non-finite.

    Works with :class:`~lightning_mpt.MPTPrecision` (read from the plugin's step history, no extra host sync) and
    with Lightning's ``"16-mixed"`` and its ``torch.amp.GradScaler`` (an overflow shows as the scale backing off).

    Tags: ``mpt/loss_scale`` (the scale the step's gradients were computed with), ``mpt/loss_scale_log2`` (its
    log2, which the dashboard draws as a step chart), ``mpt/skipped_steps``,
    ``mpt/overflow``, ``mpt/scale_change`` (``log2(new / old)`` at steps after which the scale changed),
    ``mpt/nonfinite_param_count`` and ``mpt/loss_nonfinite`` (skipped steps), the text ``mpt/nonfinite_params``
    (names) and, at the end of training, the text ``mpt/overflow_summary``. For programs, the records
    ``mpt/data/skipped_step``, ``mpt/data/stopped`` (when ``MPTPrecision``'s guard stopped training) and
    ``mpt/data/overflow_summary`` (see :mod:`lightning_mpt.diagnostics.tags`). The x axis is the optimizer step
    (0-based, skipped steps included), the step at which Lightning logs that step's ``self.log`` values.

    Args:
        every_n_steps: log the scale every this many optimizer steps; skipped steps and scale changes are always
            logged.
        max_names: parameter names listed per skipped step in the text (all are counted, and all are in the
            records).
        strict: re-raise internal errors instead of a warning that turns the monitor's statistic off (``None``:
            the environment variable ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Attributes:
        overflow_counts: per parameter name, the skipped steps at which its gradient was non-finite (rank 0).
        scale_log: the :class:`~lightning_mpt.diagnostics.loss_scale.LossScaleLog` that writes.

    Example:
        ```python
        import lightning as L
        from lightning_mpt import MPTPrecision
        from lightning_mpt.callbacks import LossScaleMonitor

        trainer = L.Trainer(plugins=[MPTPrecision("fp16")], callbacks=[LossScaleMonitor()])
        ```
    """

    charts = ("scale", "skips", "nonfinite")

    def __init__(self, every_n_steps: int = 1, max_names: int = 10, strict: Optional[bool] = None) -> None:
        super().__init__(strict)
        self.every_n_steps = check_every("LossScaleMonitor", "every_n_steps", every_n_steps)
        self.max_names = check_every("LossScaleMonitor", "max_names", max_names)
        self.tracker = ScaleTracker(self.every_n_steps, self.max_names, "LossScaleMonitor", strict)

    @property
    def scale_log(self) -> LossScaleLog:
        return self.tracker.log

    @property
    def overflow_counts(self) -> Counter[str]:
        return self.tracker.log.overflow_counts

    @overflow_counts.setter
    def overflow_counts(self, counts: Counter[str]) -> None:
        self.tracker.log.overflow_counts = Counter(counts)

    @property
    def overflows(self) -> int:
        """Skipped steps seen, cumulative (also across a resume)."""
        return self.tracker.log.overflows

    @overflows.setter
    def overflows(self, n: int) -> None:
        self.tracker.log.overflows = int(n)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.on:
            return
        with self.setup_stat.guarded():
            if not self.tracker.start(trainer.precision_plugin):
                self.session.warn_once(self.tracker.without_scale(trainer.precision_plugin))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self.tracker.source != "grad_scaler" or not self.on:
            return
        with self.setup_stat.guarded():
            suspects = None
            if not pl_module.automatic_optimization and self.sink.active:
                # the user may clear the gradients right after the step: flag them now, read the flags at an overflow
                names = {id(p): n for n, p in pl_module.named_parameters()}
                params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                suspects = Suspects.of([(names.get(id(p), "?"), p.grad) for p in params])
            self.tracker.before_step(self.sink, trainer.precision_plugin, trainer.global_step, suspects)

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
        self.tracker.after_steps(self.sink, trainer.precision_plugin, lambda: Suspects.in_module(pl_module), loss)

    def train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.tracker.after_steps(self.sink, trainer.precision_plugin, lambda: Suspects.in_module(pl_module))
        self.tracker.summary(self.sink, trainer.global_step)

    def exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.tracker.stopped(self.sink, trainer.precision_plugin, exception, trainer.global_step)

    def release(self, trainer: pl.Trainer) -> None:
        self.tracker.discard()

    def state_dict(self) -> dict[str, Any]:
        return self.tracker.log.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.log.load_state_dict(state_dict)
