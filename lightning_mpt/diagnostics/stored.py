"""The statistics of the stored half gradients (scaled, as the backward left them): fractions and exponents."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from lightning_mpt.core.numerics import FloatFormat, exponent_bins, max_abs, stored_counts
from lightning_mpt.diagnostics import exponent_axis, tags
from lightning_mpt.diagnostics.recorder import Parts, Recorder, Tensors, resolve
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistic import PerParameter, Statistic, ratio


class StoredFractions(PerParameter):
    """Zero, subnormal and overflow fractions of the stored (scaled) half gradients, and the headroom of the largest
    stored value: ``mpt/grad_zero_fraction``, ``mpt/grad_subnormal_fraction``, ``mpt/grad_overflow_fraction``
    (global, and per parameter with ``per_parameter``), ``mpt/stored_headroom``.

    Args (:class:`~lightning_mpt.diagnostics.statistic.PerParameter`): ``names``, one per gradient passed to
    :meth:`measure`; ``fmt``, the half format the gradients are stored in.
    """

    what = f"the stored-gradient fractions ({tags.GRAD_ZERO}, {tags.GRAD_SUBNORMAL}, ...)"

    def measure(self, recorder: Recorder, grads: Tensors, step: int) -> None:
        """Queue the counts of ``grads`` (the gradients as the backward left them; ``None`` for none). Under FSDP2,
        this process's shards: the counts are summed and the largest value maxed across processes."""

        def compute() -> Parts:
            found = resolve(grads)
            counts = stored_counts(recorder.stored_histograms(found, self.fmt), self.fmt)
            present = [g for g in found if g is not None and g.numel()]
            top = max_abs(present).amax() if present else torch.zeros((), device=counts.device)
            return [(counts.double(), "sum"), (top.reshape(1).to(counts.device, torch.float64), "max")]

        n = len(self.names)
        recorder.submit(
            self, compute, lambda v: self._write(recorder.sink, v, step), lambda: [(5 * n, "sum"), (1, "max")]
        )

    def _write(self, sink: Sink, v: list[float], step: int) -> None:
        n = len(self.names)
        rows = [v[5 * i : 5 * i + 5] for i in range(n)]
        values: dict[str, Optional[float]] = {}

        def fractions(
            name: Optional[str], numel: float, zero: float, sub: float, nonzero_finite: float, over: float
        ) -> None:
            for tag, value in (
                (tags.GRAD_ZERO, ratio(zero, numel)),
                (tags.GRAD_SUBNORMAL, ratio(sub, nonzero_finite)),
                (tags.GRAD_OVERFLOW, ratio(over, numel)),
            ):
                values[tag if name is None else tags.per_parameter(tag, name)] = value

        fractions(None, *([sum(col) for col in zip(*rows)] if rows else [0.0] * 5))
        if self.per_parameter:
            for name, row in zip(self.names, rows):
                fractions(name, *row)
        top = v[5 * n]
        if 0 < top < math.inf:
            values[tags.STORED_HEADROOM] = math.log2(self.fmt.max / top)
        sink.scalars(values, step)


class ExponentHistograms(Statistic):
    """Exponent histograms ``floor(log2|g|)`` of the stored, scaled half gradients, one per parameter or group:
    ``mpt/grad_exponent/<group>`` (their axis: :mod:`~lightning_mpt.diagnostics.exponent_axis`), and once the
    format's marks (``mpt/format/*``, ``mpt/legend/grad_exponent``).

    Args:
        groups: for each gradient passed to :meth:`measure`, the name of its histogram (its parameter's name, or
            its module's to draw a module's parameters together).
        fmt: the half format the gradients are stored in.
    """

    def __init__(
        self, groups: Sequence[str], fmt: FloatFormat, owner: str = "diagnostics", strict: Optional[bool] = None
    ) -> None:
        super().__init__(owner, f"the exponent histograms ({tags.per_parameter(tags.GRAD_EXPONENT, '*')})", strict)
        self.fmt = fmt
        self.groups = list(dict.fromkeys(groups))
        position = {g: i for i, g in enumerate(self.groups)}
        self._index = torch.tensor([position[g] for g in groups], dtype=torch.long)

    def write_legend(self, sink: Sink) -> None:
        """The format's marks as scalars at step 0 and the legend text (once per run)."""
        if not self.enabled:
            return
        with self.guarded():
            fmt = self.fmt
            lo, hi, normal = fmt.min_exponent, fmt.max_exponent, fmt.normal_exponent
            sink.scalars({tags.MIN_SUBNORMAL_EXPONENT: lo, tags.MIN_NORMAL_EXPONENT: normal, tags.MAX_EXPONENT: hi}, 0)
            sink.text(
                tags.EXPONENT_LEGEND,
                f"`{tags.per_parameter(tags.GRAD_EXPONENT, '*')}`: stored {fmt.name} gradients (scaled),"
                f" x = floor(log2|g|).\n\n"
                f"| x | meaning |\n|---|---|\n"
                f"| {lo - 3} to {lo - 2} | exact zeros |\n"
                f"| {lo} | min subnormal 2^{lo} = {fmt.min_subnormal:.3g} (smaller values flush to 0) |\n"
                f"| {lo} to {normal - 1} | subnormal: fewer significant bits |\n"
                f"| {normal} | min normal 2^{normal} = {fmt.min_normal:.3g} |\n"
                f"| {hi} | max exponent: max = {fmt.max:.6g} (larger values overflow to inf) |\n"
                f"| {hi + 3} to {hi + 4} | inf and NaN |",
                0,
            )

    def measure(self, recorder: Recorder, grads: Tensors, step: int) -> None:
        """Queue the histograms of ``grads`` (stored, scaled; under FSDP2 this process's shards: the counts are summed
        across processes)."""

        def compute() -> Parts:
            hist = recorder.stored_histograms(resolve(grads), self.fmt)
            if self._index.device != hist.device:
                self._index = self._index.to(hist.device)  # once: a host-to-device copy waits for the device
            grouped = torch.zeros(len(self.groups), hist.shape[1], dtype=hist.dtype, device=hist.device)
            grouped.index_add_(0, self._index, hist)
            return [(grouped, "sum")]

        size = len(self.groups) * len(exponent_bins(self.fmt))
        recorder.submit(self, compute, lambda v: self._write(recorder.sink, v, step), lambda: [(size, "sum")])

    def _write(self, sink: Sink, v: list[float], step: int) -> None:
        width = len(exponent_bins(self.fmt))
        for i, name in enumerate(self.groups):
            encoded = exponent_axis.encode(v[i * width : (i + 1) * width], self.fmt)
            if encoded is not None:
                (low, high), sums, buckets = encoded
                sink.histogram(tags.per_parameter(tags.GRAD_EXPONENT, name), step, low, high, sums, buckets)
