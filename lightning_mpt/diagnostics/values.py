"""``ValueHistograms``: histograms of the true (unscaled) gradient values."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

from torch import Tensor

from lightning_mpt.core.numerics import value_histograms, value_ranges
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.recorder import Parts, Recorder
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistic import Statistic


class ValueHistograms(Statistic):
    """Histograms of the true (unscaled) gradient values, one per parameter or group: ``mpt/grad/<name>``.
    Non-finite values are left out (the exponent histograms and the fractions count them).

    Under FSDP2 each process holds shards of the gradients: one collective first takes the global minimum and
    maximum of each group, every process bins its shards between them, and the counts, sums and sums of squares are
    summed at the flush, so each histogram is that of the whole gradients.

    Args:
        names: the histograms' names (parameters or modules), one per group of gradients passed to :meth:`measure`.
        bins: buckets per histogram.
    """

    def __init__(
        self, names: Sequence[str], bins: int = 32, owner: str = "diagnostics", strict: Optional[bool] = None
    ) -> None:
        super().__init__(owner, f"the gradient value histograms ({tags.per_parameter(tags.GRAD_HIST, '*')})", strict)
        self.names = list(names)
        self.bins = bins

    def measure(
        self, recorder: Recorder, groups: Callable[[], Sequence[Sequence[Tensor]]], step: int, scale: float = 1.0
    ) -> None:
        """Queue the histograms of the gradients that ``groups`` returns, one group per name (an empty group is left
        out of the event file). ``scale``: the gradients are still scaled by it (drawn unscaled)."""
        if not self.names or not recorder.live(self):
            return
        n, width = len(self.names), 5 + self.bins
        found: Optional[Sequence[Sequence[Tensor]]] = None
        ranges: Optional[Tensor] = None
        if self.enabled:
            with self.guarded():
                found = groups()
                if len(found) != n:
                    raise RuntimeError(f"{len(found)} groups of gradients for {n} histograms")
                ranges = value_ranges(found, scale)
        if recorder.shards is not None:  # every process, also where this failed: the range is a collective
            mine = ranges if ranges is not None else value_ranges([[] for _ in range(n)])
            ranges = recorder.shards.reduce_ranges(mine)

        def compute() -> Parts:
            if found is None:
                raise RuntimeError("no gradients")  # failed above (already reported): a placeholder
            stats = value_histograms(found, self.bins, ranges, scale)
            return [(stats[:, :2], "first"), (stats[:, 2:], "sum")]

        recorder.submit(
            self,
            compute,
            lambda v: self._write(recorder.sink, v, step),
            lambda: [(2 * n, "first"), (n * (width - 2), "sum")],
        )

    def _write(self, sink: Sink, v: list[float], step: int) -> None:
        n, rest = len(self.names), 3 + self.bins
        for i, name in enumerate(self.names):
            lo, hi = v[2 * i : 2 * i + 2]
            num, total, squares, *counts = v[2 * n + i * rest : 2 * n + (i + 1) * rest]
            if num <= 0:
                continue  # no finite value to draw
            if hi > lo:
                width = (hi - lo) / self.bins
                limits = [lo + (k + 1) * width for k in range(self.bins)]
                limits[-1] = hi
            else:
                limits, counts = [hi], [num]
            sink.histogram(
                tags.per_parameter(tags.GRAD_HIST, name), step, lo, hi, (num, total, squares), (limits, counts)
            )
