"""The loss scale, skipped steps and their causes: :class:`ScaleTracker` follows a precision plugin's loss scale, one
optimizer step at a time, into a :class:`LossScaleLog`, which writes it.

``MPTPrecision`` reports every step in its ``history`` (no host sync). A ``torch.amp.GradScaler`` reports nothing,
but it backs off at every overflow and only then: a step overflowed when the scale after it is lower than before.
Which parameters held inf/NaN, and whether the loss did, is read at overflow steps only.

Example:
    ```python
    import tempfile

    from torch.utils.tensorboard import SummaryWriter
    from lightning_mpt.diagnostics.loss_scale import LossScaleLog
    from lightning_mpt.diagnostics.sink import Sink

    log = LossScaleLog()
    with SummaryWriter(tempfile.mkdtemp()) as writer:
        sink = Sink(writer)
        log.step(sink, 0, scale=1024.0, after=1024.0, skipped=False, names=list, loss_finite=True)
        log.step(sink, 1, scale=1024.0, after=512.0, skipped=True, names=lambda: ["net.0.weight"], loss_finite=True)
        log.summary(sink, 2)
    assert log.overflows == 1 and log.overflow_counts == {"net.0.weight": 1}
    ```
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor, nn

from lightning_mpt.core.numerics import max_abs
from lightning_mpt.core.steps import NonFiniteGradientError
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.plugin import grad_scaler, has_masters, steps_taken
from lightning_mpt.diagnostics.shards import local_tensor
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistic import Statistic


class LossScaleLog(Statistic):
    """The loss scale, skipped steps and their causes, from what each optimizer step reports (no tensors, no sync).

    Per optimizer step :meth:`step` writes ``mpt/loss_scale``, ``mpt/skipped_steps`` and ``mpt/overflow`` (every
    ``every_n_steps`` steps, and at every skipped step and scale change), ``mpt/loss_scale_log2`` (at those steps
    and the step after a change, so that its line is a step function), ``mpt/scale_change``; at a skipped step
    also ``mpt/nonfinite_param_count``, ``mpt/loss_nonfinite``, the text ``mpt/nonfinite_params`` and the record
    ``mpt/data/skipped_step`` (every name). :meth:`stopped` writes the record ``mpt/data/stopped``; :meth:`summary`
    the text ``mpt/overflow_summary`` and the record ``mpt/data/overflow_summary``.

    Args:
        every_n_steps: write the scale every this many steps.
        max_names: parameter names listed per skipped step in the texts (the records hold all).
    """

    def __init__(
        self, every_n_steps: int = 1, max_names: int = 10, owner: str = "diagnostics", strict: Optional[bool] = None
    ) -> None:
        super().__init__(owner, f"the loss-scale log ({tags.LOSS_SCALE}, {tags.SKIPPED_STEPS}, ...)", strict)
        self.every_n_steps = every_n_steps
        self.max_names = max_names
        self.overflow_counts: Counter[str] = Counter()
        self.overflows = 0  # skipped steps, cumulative (also across a resume)
        self.last_logged_step = -1  # the last step of a plugin's history logged by :meth:`history`
        self._changed_at = -2  # the last step after which the scale changed: the next step logs the new scale's log2

    def history(self, sink: Sink, records: Sequence[Any], scale_now: float) -> None:
        """Log the steps of a plugin's ``history`` (``MPTPrecision.history``: records with ``step``, ``scale``,
        ``skipped``, ``nonfinite_params``, ``loss_finite``) newer than :attr:`last_logged_step`; ``scale_now`` is the
        plugin's ``loss_scale``, the scale after the last record."""
        new = []
        for record in reversed(records):
            if record.step <= self.last_logged_step:
                break
            new.append(record)
        new.reverse()
        for i, r in enumerate(new):
            after = new[i + 1].scale if i + 1 < len(new) else scale_now
            self.step(sink, r.step, r.scale, after, r.skipped, _names_of(r), r.loss_finite)
            self.last_logged_step = r.step

    def step(
        self,
        sink: Sink,
        step: int,
        scale: float,
        after: float,
        skipped: bool,
        names: Callable[[], list[str]],
        loss_finite: Optional[bool],
    ) -> None:
        """One optimizer step: the scale its gradients were computed with, the scale after it, whether it was
        skipped, the names of the parameters with inf/NaN gradients (called at skipped steps only: it may read the
        device) and whether the loss was finite (``None``: unknown)."""
        if skipped:
            self.overflows += 1
        if not (self.enabled and sink.active):
            return
        with self.guarded():
            changed = after != scale
            values: dict[str, Optional[float]] = {}
            logged = step % self.every_n_steps == 0 or skipped or changed
            if logged:
                values.update({
                    tags.LOSS_SCALE: scale,
                    tags.SKIPPED_STEPS: self.overflows,
                    tags.OVERFLOW: float(skipped),
                })
            # TensorBoard joins points with straight lines: a point on each side of a change draws a vertical step
            if (logged or self._changed_at == step - 1) and 0 < scale < math.inf:
                values[tags.LOSS_SCALE_LOG2] = math.log2(scale)
            if changed:
                self._changed_at = step
            if changed and scale > 0 and after > 0:
                values[tags.SCALE_CHANGE] = math.log2(after / scale)
            if skipped:
                bad = names()
                self.overflow_counts.update(bad)
                values[tags.NONFINITE_PARAMS] = len(bad)
                if loss_finite is not None:
                    values[tags.LOSS_NONFINITE] = float(not loss_finite)
                listed = ", ".join(f"`{n}`" for n in bad[: self.max_names])
                more = f" and {len(bad) - self.max_names} more" if len(bad) > self.max_names else ""
                loss = "unknown" if loss_finite is None else ("finite" if loss_finite else "**non-finite**")
                sink.text(
                    tags.NONFINITE_TEXT,
                    f"step {step} skipped: {len(bad)} parameter(s) with inf/NaN gradients: "
                    f"{listed or '(none found)'}{more}; loss {loss}; scale {scale:g} -> {after:g}",
                    step,
                )
                sink.record(
                    tags.SKIP_RECORD,
                    {
                        "step": step,
                        "scale": _json_float(scale),
                        "scale_after": _json_float(after),
                        "params": bad,
                        "loss_finite": loss_finite,
                    },
                    step,
                )
            sink.scalars(values, step)

    def stopped(self, sink: Sink, step: int, error: BaseException) -> None:
        """Training stopped at ``step`` with ``error`` (the guard's ``NonFiniteGradientError``)."""
        if not (self.enabled and sink.active):
            return
        with self.guarded():
            sink.record(tags.STOP_RECORD, {"step": step, "error": type(error).__name__, "message": str(error)}, step)

    def state_dict(self) -> dict[str, Any]:
        """The counts that continue across a resume: skipped steps and, per parameter, those with inf/NaN in it."""
        return {"overflows": self.overflows, "overflow_counts": dict(self.overflow_counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.overflows = int(state.get("overflows", 0))
        self.overflow_counts = Counter(state.get("overflow_counts", {}))

    def summary(self, sink: Sink, step: int) -> None:
        """At the end of training: the parameters most often non-finite (a text, when there were skips) and the
        counts of every parameter (a record, always)."""
        if not (self.enabled and sink.active):
            return
        with self.guarded():
            counts = self.overflow_counts.most_common()
            sink.record(
                tags.SUMMARY_RECORD, {"step": step, "skipped_steps": self.overflows, "params": dict(counts)}, step
            )
            if self.overflows:
                top = "\n".join(f"| `{n}` | {c} |" for n, c in counts[: self.max_names])
                sink.text(
                    tags.OVERFLOW_SUMMARY,
                    f"{self.overflows} skipped step(s). Parameters with inf/NaN gradients, most frequent first:\n\n"
                    f"| parameter | skipped steps |\n|---|---|\n{top}",
                    step,
                )


def _names_of(record: Any) -> Callable[[], list[str]]:
    return lambda: list(record.nonfinite_params)


def _json_float(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


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
        from lightning_mpt.diagnostics.loss_scale import ScaleTracker
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
        """At the end of training: the parameters most often non-finite, when a loss scale was followed. Without one
        (Lightning's ``"bf16-mixed"``) the record still holds the steps trained, the report's step count (the scalars
        of the last steps may not have been logged), with no skip counts (``skipped_steps`` null)."""
        if self.source is not None:
            self.log.summary(sink, step)
        elif self.log.enabled and sink.active:
            with self.log.guarded():
                sink.record(tags.SUMMARY_RECORD, {"step": step, "skipped_steps": None, "params": {}}, step)

    def discard(self) -> None:
        """Drop the pending GradScaler step (the fit is over)."""
        self._pending = None
