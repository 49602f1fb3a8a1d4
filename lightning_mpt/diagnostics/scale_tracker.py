"""``ScaleTracker``: follows a precision plugin's loss scale, one optimizer step at a time, into a ``LossScaleLog``.

``MPTPrecision`` reports every step in its ``history`` (no host sync). A ``torch.amp.GradScaler`` reports nothing,
but it backs off at every overflow and only then: a step overflowed when the scale after it is lower than before.
Which parameters held inf/NaN, and whether the loss did, is read at overflow steps only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor, nn

from lightning_mpt.core.numerics import max_abs
from lightning_mpt.core.steps import NonFiniteGradientError
from lightning_mpt.diagnostics.plugin import grad_scaler, has_masters, steps_taken
from lightning_mpt.diagnostics.scale_log import LossScaleLog
from lightning_mpt.diagnostics.shards import local_tensor
from lightning_mpt.diagnostics.sink import Sink

#: where the steps are read: ``MPTPrecision``'s step history, or a ``GradScaler``'s scale
Source = Literal["history", "grad_scaler"]


@dataclass
class Suspects:
    """The parameters whose gradients may hold inf/NaN at an overflow step, with their flags on the device."""

    names: list[str]
    flags: Tensor  # True where the gradient holds inf/NaN

    @classmethod
    def of(cls, named: Sequence[tuple[str, Tensor]]) -> Optional[Suspects]:
        """The flags of ``(name, gradient)`` pairs (no host sync); ``None`` without a gradient."""
        if not named:
            return None
        return cls([n for n, _ in named], ~torch.isfinite(max_abs([g for _, g in named])))

    @classmethod
    def in_module(cls, module: nn.Module) -> Optional[Suspects]:
        """The flags of every gradient of ``module`` (this process's part under FSDP2)."""
        return cls.of([(n, local_tensor(p.grad)) for n, p in module.named_parameters() if p.grad is not None])


def read_causes(suspects: Optional[Suspects], loss: Any = None) -> tuple[list[str], Optional[bool]]:
    """The names of the parameters whose gradients hold inf/NaN and whether ``loss`` was finite (``None``: no loss
    tensor given), in one host read."""
    parts = [] if suspects is None else [suspects.flags.float().reshape(-1)]
    if isinstance(loss, Tensor):
        flag = torch.isfinite(loss.detach()).all().float().reshape(1)
        parts.append(flag.to(parts[0].device) if parts else flag)
    if not parts:
        return [], None
    values = torch.cat(parts).tolist()  # one host read, at overflow steps only
    names = [] if suspects is None else [n for n, bad in zip(suspects.names, values) if bad]
    return names, (values[-1] > 0 if isinstance(loss, Tensor) else None)


@dataclass
class _GradScalerStep:
    """A GradScaler step whose outcome is read once the scaler has updated."""

    step: int
    scale: float
    suspects: Optional[Suspects] = None  # taken before the user can clear the gradients (manual optimization)


class ScaleTracker:
    """Follows a precision plugin's loss scale into :attr:`log`: :meth:`start` once, :meth:`before_step` and
    :meth:`after_steps` around the optimizer steps, :meth:`summary` (or :meth:`stopped`) at the end.

    Args:
        every_n_steps: write the scale every this many steps (skipped steps and scale changes always).
        max_names: parameter names listed per skipped step in the texts (the records hold all).
        owner: who logs, for messages.
        strict: raise rather than warn when the log fails (``None``: ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Example:
        ```python
        from lightning_mpt.diagnostics.scale_tracker import ScaleTracker
        from lightning_mpt.diagnostics.sink import Sink
        from lightning_mpt.fabric import MPTPrecision

        tracker = ScaleTracker()
        assert tracker.start(MPTPrecision("fp16")) and tracker.source == "history"
        tracker.after_steps(Sink(), MPTPrecision("fp16"))   # logs the steps the plugin took since the last call
        ```
    """

    def __init__(
        self, every_n_steps: int = 1, max_names: int = 10, owner: str = "diagnostics", strict: Optional[bool] = None
    ) -> None:
        self.log = LossScaleLog(every_n_steps, max_names, owner, strict)
        self.source: Optional[Source] = None
        self._scale = 1.0  # GradScaler: the scale in force
        self._pending: Optional[_GradScalerStep] = None

    @staticmethod
    def source_of(plugin: Any) -> Optional[Source]:
        """Where the steps of ``plugin`` are read; ``None`` when it has no loss scale (nothing to log)."""
        if has_masters(plugin) and hasattr(plugin, "history"):
            return "history"
        return "grad_scaler" if grad_scaler(plugin) is not None else None

    def without_scale(self, plugin: Any) -> str:
        """The warning for a plugin without a loss scale."""
        return (
            f"{self.log.owner}: the precision plugin {type(plugin).__name__} ({getattr(plugin, 'precision', '?')}) "
            "has no loss scaler; the loss scale is not logged. It is logged under MPTPrecision and Lightning's "
            "'16-mixed' (torch.amp.GradScaler)."
        )

    def start(self, plugin: Any) -> bool:
        """Take up where ``plugin`` stands (``MPTPrecision``'s step count and skipped steps, also after a resume; a
        GradScaler's scale); ``False`` when it has no loss scale to follow."""
        self.source, self._pending = self.source_of(plugin), None
        scaler = grad_scaler(plugin)
        if self.source == "history":
            self.log.last_logged_step = steps_taken(plugin) - 1
            self.log.overflows = int(plugin.skipped_steps)
        elif scaler is not None:
            self._scale = scaler.get_scale()
        return self.source is not None

    def before_step(self, sink: Sink, plugin: Any, step: int, suspects: Optional[Suspects] = None) -> None:
        """GradScaler: optimizer step ``step`` begins with the scale in force (an earlier step not yet logged is
        logged first). ``suspects``: taken now where the gradients may be gone once the step is logged."""
        if self.source != "grad_scaler":
            return
        self.after_steps(sink, plugin)
        self._pending = _GradScalerStep(step, self._scale, suspects)

    def after_steps(
        self,
        sink: Sink,
        plugin: Any,
        suspects: Callable[[], Optional[Suspects]] = lambda: None,
        loss: Any = None,
    ) -> None:
        """Log the optimizer steps taken since the last call: ``MPTPrecision``'s new history records, or the pending
        GradScaler step. At a GradScaler overflow, ``suspects()`` (unless taken before the step) and the step's
        ``loss`` tell its causes."""
        if self.source == "history":
            self.log.history(sink, plugin.history, plugin.loss_scale)
            return
        pending, self._pending = self._pending, None
        if pending is None:
            return
        scaler = grad_scaler(plugin)
        after = scaler.get_scale() if scaler is not None else 1.0
        self._scale = after
        overflow = after < pending.scale
        names: list[str] = []
        finite: Optional[bool] = None
        if overflow and sink.active:
            names, finite = read_causes(pending.suspects or suspects(), loss)
        self.log.step(sink, pending.step, pending.scale, after, overflow, lambda: names, finite)

    def stopped(self, sink: Sink, plugin: Any, error: BaseException, step: int) -> None:
        """Training stopped with ``error`` at ``step``: log the steps taken since the last call (the one that tripped
        ``MPTPrecision``'s guard among them), the stop, and the :meth:`summary`."""
        self._pending = None
        if self.source == "history":
            self.log.history(sink, plugin.history, plugin.loss_scale)
            if isinstance(error, NonFiniteGradientError):
                last = plugin.last_step
                self.log.stopped(sink, last.step if last is not None else step, error)
        self.summary(sink, step)

    def summary(self, sink: Sink, step: int) -> None:
        """At the end of training: the parameters most often non-finite, when a loss scale was followed."""
        if self.source is not None:
            self.log.summary(sink, step)

    def discard(self) -> None:
        """Drop the pending GradScaler step (the fit is over)."""
        self._pending = None
