"""``UpdateUnderflow``: the share of master-weight updates that a half-precision weight would lose."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from lightning_mpt.core.numerics import update_underflow_counts
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.recorder import Parts, Recorder, Tensors, resolve
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistic import PerParameter, ratio


class UpdateUnderflow(PerParameter):
    """``mpt/update_underflow_fraction``: of the master weights an optimizer step changed, the share whose change a
    half-precision weight would not see (docs/concepts.md#definitions). :meth:`snapshot` copies the masters before
    the step (4 bytes per parameter, transient), :meth:`measure` compares after it. A skipped step changes nothing:
    nothing is written.

    Args (:class:`~lightning_mpt.diagnostics.statistic.PerParameter`): ``names``, one per master passed to
    :meth:`snapshot`; ``fmt``, the half format.
    """

    what = f"the update underflow ({tags.UPDATE_UNDERFLOW})"
    _due: Optional[tuple[int, list[int]]] = None  # the step and the parameters with a master
    _snapshot: Optional[tuple[list[Tensor], list[Tensor]]] = None  # the masters and their copies

    def snapshot(self, masters: Tensors, step: int) -> None:
        """Copy the fp32 masters before the optimizer step (``None`` for a parameter stepped in half precision; under
        FSDP2 this process's shards, all present)."""
        if self._due is not None:
            return
        index = list(range(len(self.names)))  # where gathering the masters fails: every parameter, as under FSDP2
        if self.enabled:
            with self.guarded():
                found = resolve(masters)
                index = [i for i, m in enumerate(found) if m is not None]
                current = [m.detach() for m in found if m is not None]
                self._snapshot = (current, [m.clone() for m in current])
        if index:
            self._due = (step, index)

    def measure(self, recorder: Recorder) -> None:
        """After the step: queue the counts of the changes since :meth:`snapshot` (summed across processes under
        FSDP2)."""
        due, snapshot = self._due, self._snapshot
        self._due = self._snapshot = None
        if due is None:
            return
        step, index = due

        def compute() -> Parts:
            if snapshot is None:
                raise RuntimeError("no copy of the masters")  # the copy failed (already reported): a placeholder
            current, old = snapshot
            return [(update_underflow_counts(old, current, self.fmt), "sum")]  # the masters hold the stepped values

        recorder.submit(
            self, compute, lambda v: self._write(recorder.sink, v, step, index), lambda: [(2 * len(index), "sum")]
        )

    def discard(self) -> None:
        """Drop the snapshot (the step did not complete)."""
        self._due = self._snapshot = None

    def _write(self, sink: Sink, v: list[float], step: int, index: list[int]) -> None:
        changed, lost = v[0::2], v[1::2]
        values = {tags.UPDATE_UNDERFLOW: ratio(sum(lost), sum(changed))}
        if self.per_parameter:
            for i, c, lo in zip(index, changed, lost):
                values[tags.per_parameter(tags.UPDATE_UNDERFLOW, self.names[i])] = ratio(lo, c)
        sink.scalars(values, step)
