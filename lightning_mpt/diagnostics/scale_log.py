"""``LossScaleLog``: the loss scale, skipped steps and their causes, written from what a step reports.

Example:
    ```python
    import tempfile

    from torch.utils.tensorboard import SummaryWriter
    from lightning_mpt.diagnostics.scale_log import LossScaleLog
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
from typing import Any, Optional

from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistic import Statistic


class LossScaleLog(Statistic):
    """The loss scale, skipped steps and their causes, from what a step policy reports (no tensors, no sync).

    Per optimizer step :meth:`step` writes ``mpt/loss_scale``, ``mpt/skipped_steps`` and ``mpt/overflow`` (every
    ``every_n_steps`` steps, and at every skipped step and scale change), ``mpt/scale_change``; at a skipped step
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
            if step % self.every_n_steps == 0 or skipped or changed:
                values.update({
                    tags.LOSS_SCALE: scale,
                    tags.SKIPPED_STEPS: self.overflows,
                    tags.OVERFLOW: float(skipped),
                })
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
