"""``LossScaleMonitor``: the loss scale, skipped steps, overflows and their causes, at every optimizer step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpt.callbacks._common import Monitor, check_every
from lightning_mpt.core.numerics import max_abs
from lightning_mpt.diagnostics.statistics import LossScaleLog, grad_scaler
from lightning_mpt.precision import MPTPrecision, NonFiniteGradientError


@dataclass
class _Pending:
    """A GradScaler step whose outcome is read once the scaler has updated."""

    step: int
    scale: float
    names: Optional[list[str]] = None  # manual optimization: the stepped parameters and their
    flags: Optional[Tensor] = None  # non-finite flags, taken before the user can clear the gradients


class LossScaleMonitor(Monitor):
    """Log the loss scale, cumulative skipped steps, a 0/1 overflow per optimizer step, scale growths and back-offs,
    and, at each skipped step, which parameters had inf/NaN gradients and whether the loss itself was non-finite.

    Works with :class:`~lightning_mpt.MPTPrecision` (read from the plugin's step history, no extra host sync) and
    with Lightning's ``"16-mixed"`` and its ``torch.amp.GradScaler`` (an overflow shows as the scale backing off).

    Tags: ``mpt/loss_scale`` (the scale the step's gradients were computed with), ``mpt/skipped_steps``,
    ``mpt/overflow``, ``mpt/scale_change`` (``log2(new / old)`` at steps after which the scale changed),
    ``mpt/nonfinite_param_count`` and ``mpt/loss_nonfinite`` (skipped steps), the text ``mpt/nonfinite_params``
    (names) and, at the end of training, the text ``mpt/overflow_summary``. For programs, the records
    ``mpt/data/skipped_step`` (every skipped step: all names, the loss flag, the scales), ``mpt/data/stopped``
    (when ``MPTPrecision``'s guard stopped training) and ``mpt/data/overflow_summary`` (see
    :mod:`lightning_mpt.diagnostics.tags`). The x axis is the optimizer step (0-based, skipped steps included), the
    step at which Lightning logs that step's ``self.log`` values.

    Args:
        every_n_steps: log the scale every this many optimizer steps; skipped steps and scale changes are always
            logged.
        max_names: parameter names listed per skipped step in the text (all are counted, and all are in the
            records).
        strict: re-raise internal errors instead of a warning that turns the monitor's statistic off (``None``:
            the environment variable ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Attributes:
        overflow_counts: per parameter name, the skipped steps at which its gradient was non-finite (rank 0).

    Example:
        ```python
        import lightning as L
        from lightning_mpt import MPTPrecision
        from lightning_mpt.callbacks import LossScaleMonitor

        trainer = L.Trainer(plugins=[MPTPrecision("fp16")], callbacks=[LossScaleMonitor()])
        ```
    """

    charts = ("scale", "skips", "scale_change", "nonfinite")

    def __init__(self, every_n_steps: int = 1, max_names: int = 10, strict: Optional[bool] = None) -> None:
        super().__init__(strict)
        self.every_n_steps = check_every("LossScaleMonitor", "every_n_steps", every_n_steps)
        self.max_names = check_every("LossScaleMonitor", "max_names", max_names)
        self.scale_log = LossScaleLog(self.every_n_steps, self.max_names, owner="LossScaleMonitor", strict=strict)
        self._mode: Optional[str] = None  # "mpt" or "grad_scaler"
        self._scale = 1.0  # GradScaler: the scale in force now
        self._pending: Optional[_Pending] = None

    @property
    def overflow_counts(self) -> Counter[str]:
        return self.scale_log.overflow_counts

    @overflow_counts.setter
    def overflow_counts(self, counts: Counter[str]) -> None:
        self.scale_log.overflow_counts = Counter(counts)

    @property
    def overflows(self) -> int:
        """Skipped steps seen, cumulative (also across a resume)."""
        return self.scale_log.overflows

    @overflows.setter
    def overflows(self, n: int) -> None:
        self.scale_log.overflows = int(n)

    # ------------------------------------------------------------------------------------------------ set-up
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.on:
            return
        with self.setup_stat.guarded():
            plugin = trainer.precision_plugin
            scaler = grad_scaler(plugin)
            if isinstance(plugin, MPTPrecision):
                self._mode = "mpt"
                last = plugin.last_step
                self.scale_log.seen = last.step if last is not None else -1
                self.scale_log.overflows = plugin.skipped_steps
            elif scaler is not None:
                self._mode = "grad_scaler"
                self._scale = scaler.get_scale()
            else:
                self._mode = None
                self.warn_once(
                    "plugin",
                    f"LossScaleMonitor: the precision plugin {type(plugin).__name__}"
                    f" ({getattr(plugin, 'precision', '?')}) has no loss scaler; nothing is logged. It works with"
                    " MPTPrecision and with Lightning's '16-mixed' (torch.amp.GradScaler).",
                )

    # ------------------------------------------------------------------------------------------------ steps
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._mode != "grad_scaler" or not self.on:
            return
        with self.setup_stat.guarded():
            self._resolve(trainer, None)  # an earlier step of this batch (manual optimization)
            pending = _Pending(step=trainer.global_step, scale=self._scale)
            if not pl_module.automatic_optimization and self.sink.active:
                # the user may clear the gradients right after the step: keep device-side flags, read them on overflow
                names = {id(p): n for n, p in pl_module.named_parameters()}
                params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                pending.names = [names.get(id(p), "?") for p in params]
                pending.flags = ~torch.isfinite(max_abs([p.grad for p in params])) if params else None
            self._pending = pending

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        plugin = trainer.precision_plugin
        if self._mode == "mpt" and isinstance(plugin, MPTPrecision):
            self.scale_log.history(self.sink, plugin.history, plugin.loss_scale)
        elif self._mode == "grad_scaler":
            self._resolve(trainer, outputs, pl_module)

    def _resolve(self, trainer: pl.Trainer, outputs: Any, pl_module: Optional[pl.LightningModule] = None) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        scaler = grad_scaler(trainer.precision_plugin)
        after = scaler.get_scale() if scaler is not None else 1.0  # a pending step exists only with a GradScaler
        self._scale = after
        overflow = after < pending.scale  # GradScaler backs off at every overflow, and only then
        names: list[str] = []
        loss_finite: Optional[bool] = None
        if overflow and self.sink.active:
            names, loss_finite = _overflow_causes(pending, outputs, pl_module)
        self.scale_log.step(self.sink, pending.step, pending.scale, after, overflow, lambda: names, loss_finite)

    def train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._mode == "grad_scaler":
            self._resolve(trainer, None, pl_module)
        if self._mode is not None:
            self.scale_log.summary(self.sink, trainer.global_step)

    def exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Training stopped: log the steps taken since the last batch end (the step that tripped
        ``MPTPrecision``'s guard among them), the stop, and the summary."""
        plugin = trainer.precision_plugin
        if self._mode == "mpt" and isinstance(plugin, MPTPrecision):
            self.scale_log.history(self.sink, plugin.history, plugin.loss_scale)
            if isinstance(exception, NonFiniteGradientError):
                last = plugin.last_step
                self.scale_log.stopped(self.sink, last.step if last is not None else trainer.global_step, exception)
        if self._mode is not None:
            self.scale_log.summary(self.sink, trainer.global_step)

    def release(self, trainer: pl.Trainer) -> None:
        self._pending = None

    # ------------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"overflows": self.scale_log.overflows, "overflow_counts": dict(self.scale_log.overflow_counts)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scale_log.overflows = int(state_dict.get("overflows", 0))
        self.scale_log.overflow_counts = Counter(state_dict.get("overflow_counts", {}))


def _overflow_causes(
    pending: _Pending, outputs: Any, pl_module: Optional[pl.LightningModule]
) -> tuple[list[str], Optional[bool]]:
    """At a GradScaler overflow step: the parameters with non-finite gradients and whether the loss was finite
    (``None``: unknown), with one host read for both."""
    candidates: list[str] = []
    flags: Optional[Tensor] = None
    if pending.flags is not None and pending.names is not None:
        candidates, flags = pending.names, pending.flags
    elif pl_module is not None:
        named = [(n, p.grad) for n, p in pl_module.named_parameters() if p.grad is not None]
        if named:
            candidates = [n for n, _ in named]
            flags = ~torch.isfinite(max_abs([g for _, g in named]))
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
    parts = [] if flags is None else [flags.float().reshape(-1)]
    if isinstance(loss, Tensor):
        parts.append(torch.isfinite(loss.detach()).all().float().reshape(1))
    if not parts:
        return [], None
    values = torch.cat([p.to(parts[0].device) for p in parts]).tolist()  # one host read, overflow steps only
    names = [n for n, bad in zip(candidates, values) if bad]
    return names, (values[-1] > 0 if isinstance(loss, Tensor) else None)
