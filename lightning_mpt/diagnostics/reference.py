"""The true flush (underflow) fraction and the scale headroom, from fp32 reference gradients of a batch.

The stored half gradients have already lost the values that flushed to zero: only an fp32 reference of the same
batch shows them (docs/concepts.md#definitions). :func:`~lightning_mpt.diagnostics.replay.reference_gradients`
computes it; :class:`FlushReference` counts it, reduces the counts across processes (:class:`FlushStatistics`, a
torchmetrics ``Metric``) and writes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_mpt.core.numerics import flush_counts, max_abs
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.recorder import Parts, Recorder
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistic import PerParameter, ratio


class FlushStatistics(Metric):
    """Per-parameter flush counts of fp32 reference gradients, reduced across processes: ``nonzero`` and
    ``flushed`` are summed, ``max_scaled`` (the largest scaled gradient) is maxed.

    Example:
        ```python
        import torch
        from lightning_mpt.callbacks import FlushStatistics

        m = FlushStatistics(num_params=2)
        m.update(torch.tensor([[4, 1], [10, 0]]), torch.tensor([3.0, 70000.0]))
        nonzero, flushed, max_scaled = m.compute()
        assert flushed.tolist() == [1, 0] and max_scaled.max().item() == 70000.0
        ```
    """

    full_state_update = False
    # the states add_state registers (as attributes torchmetrics sets at run time)
    nonzero: Tensor
    flushed: Tensor
    max_scaled: Tensor

    def __init__(self, num_params: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("nonzero", torch.zeros(num_params, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("flushed", torch.zeros(num_params, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("max_scaled", torch.zeros(num_params), dist_reduce_fx="max")

    def update(self, counts: Tensor, max_scaled: Tensor) -> None:
        """``counts``: ``(P, 2)`` rows of ``(nonzero, flushed)`` (:func:`~lightning_mpt.core.numerics.flush_counts`);
        ``max_scaled``: ``(P,)`` largest ``|gradient * scale|`` per parameter."""
        self.nonzero += counts[:, 0].to(self.nonzero)
        self.flushed += counts[:, 1].to(self.flushed)
        self.max_scaled = torch.maximum(self.max_scaled, max_scaled.to(self.max_scaled))

    def compute(self) -> tuple[Tensor, Tensor, Tensor]:
        # torchmetrics squeezes a one-element result to 0-dim: callers reshape to (P,)
        return self.nonzero, self.flushed, self.max_scaled


@dataclass
class ReferenceStats:
    """The latest fp32 reference measurement (device tensors of shape ``(P,)``; every rank holds its own
    ``local_*`` values)."""

    step: int
    scale: float
    names: list[str]
    local_nonzero: Tensor
    local_flushed: Tensor
    nonzero: Tensor  # summed over ranks
    flushed: Tensor
    max_scaled: Tensor  # maxed over ranks

    @property
    def flush_fraction(self) -> float:
        """Flushed over nonzero values, all parameters and ranks (NaN without nonzero values; one host sync)."""
        nonzero = float(self.nonzero.sum())
        return float(self.flushed.sum()) / nonzero if nonzero else math.nan


class FlushReference(PerParameter):
    """The true flush (underflow) fraction and the scale headroom, from fp32 reference gradients of the batch:
    ``mpt/grad_underflow_fraction`` (global and per parameter) and ``mpt/scale_headroom``.

    :meth:`count` is local to the process; :meth:`reduce` sums the counts across processes (a collective under
    ``torch.distributed``: every rank must call it, or none); :meth:`measure` does both and queues the result.

    Args (:class:`~lightning_mpt.diagnostics.statistic.PerParameter`): ``names``, one per reference gradient; ``fmt``,
    the half format the gradients are stored in.
    """

    what = f"the fp32 reference ({tags.GRAD_UNDERFLOW}, {tags.SCALE_HEADROOM})"
    metric: Optional[FlushStatistics] = None  # the cross-process reduction, made on the counts' device at first use

    def count(self, grads: Sequence[Optional[Tensor]], scale: float) -> tuple[Tensor, Tensor]:
        """This process's ``(P, 2)`` ``(nonzero, flushed)`` counts of the fp32 ``grads`` at ``scale`` and the
        ``(P,)`` largest ``|g * scale|`` (0 for a missing gradient). No host sync."""
        counts = flush_counts(grads, scale, self.fmt)
        present = [g for g in grads if g is not None]
        maxima = iter(max_abs(present).to(counts.device)) if present else iter(())
        zero = torch.zeros((), device=counts.device)
        top = [zero if g is None else next(maxima) for g in grads]
        return counts, (torch.stack(top) if top else torch.zeros(0, device=counts.device)) * scale

    def reduce(self, counts: Tensor, maxima: Tensor, scale: float, step: int) -> ReferenceStats:
        """Reduce ``counts`` and ``maxima`` across processes (sum, max) into a :class:`ReferenceStats`."""
        n = len(self.names)
        if self.metric is None:
            self.metric = FlushStatistics(n).to(counts.device)
        self.metric.update(counts, maxima)
        nonzero, flushed, max_scaled = (t.reshape(n).clone() for t in self.metric.compute())
        self.metric.reset()
        return ReferenceStats(step, scale, self.names, counts[:, 0], counts[:, 1], nonzero, flushed, max_scaled)

    def measure(
        self,
        recorder: Recorder,
        grads: Callable[[], Optional[Sequence[Optional[Tensor]]]],
        scale: float,
        step: int,
        agree: Callable[[bool], bool],
        missing: Optional[str] = None,
    ) -> Optional[ReferenceStats]:
        """Count the fp32 reference gradients that ``grads`` computes (``None``: no loss to differentiate) at
        ``scale``, reduce the counts across processes and queue them; return the result (on every process).

        Every process must call it at the same steps: ``agree(ok)`` must return whether every process has its counts
        (``strategy.reduce_boolean_decision(ok, all=True)``) before the collective of :meth:`reduce`. When one has
        not, the reference is off on every process from then on (the failing one raises when strict, else warns with
        the traceback; the others warn). ``missing``: why this process has nothing to measure (no batch to replay).
        """
        local: Optional[tuple[Tensor, Tensor]] = None
        error: Optional[Exception] = None
        reason = missing
        if self.enabled and missing is None:
            try:
                found = grads()
                if found is None:
                    reason = "returned no loss to differentiate"
                else:
                    local = self.count(found, scale)
            except Exception as e:  # handed to the statistic once the ranks agree: strict raises, else a warning
                error = e
        # every rank must agree before the collective in reduce(): one failing rank would leave the others waiting
        if not agree(local is not None):
            self.retired = True
            if error is not None:
                self.fail(error)
            self.retire(reason or "failed on another process (its warning holds the traceback)")
            return None
        if local is None:  # every rank had a result, this one included (the decision above)
            return None
        stats: Optional[ReferenceStats] = None
        with self.guarded():
            stats = self.reduce(*local, scale, step)
        if recorder.active:  # also where reduce failed: under sharding every process queues (a placeholder)
            self._queue(recorder, stats, step)
        return stats

    def _queue(self, recorder: Recorder, stats: Optional[ReferenceStats], step: int) -> None:
        """Hand ``stats`` to ``recorder``'s next flush, to be written at ``step``.

        Its values are already reduced across processes (:meth:`reduce`), and every process holds them alike: a
        sharded recorder (FSDP2), which sums what it reduces, takes rank 0's (``"first"``), never their sum. There a
        ``None`` (:meth:`reduce` failed here) or a failing queue is a flagged placeholder of the same size, and the
        flush turns the reference off on every process (see :meth:`Recorder.submit`)."""

        def compute() -> Parts:
            if stats is None:
                raise RuntimeError("no reference counts")  # reduce failed (already reported): a placeholder
            return [(torch.cat([stats.nonzero.double(), stats.flushed.double(), stats.max_scaled.double()]), "first")]

        n = len(self.names)
        recorder.submit(self, compute, lambda v: self._write(recorder.sink, v, step), lambda: [(3 * n, "first")])

    def _write(self, sink: Sink, v: list[float], step: int) -> None:
        n = len(self.names)
        nonzero, flushed, max_scaled = v[:n], v[n : 2 * n], v[2 * n :]
        values = {tags.GRAD_UNDERFLOW: ratio(sum(flushed), sum(nonzero))}
        if self.per_parameter:
            for name, z, f in zip(self.names, nonzero, flushed):
                values[tags.per_parameter(tags.GRAD_UNDERFLOW, name)] = ratio(f, z)
        top = max(max_scaled, default=0.0) if all(map(math.isfinite, max_scaled)) else math.nan
        if 0 < top < math.inf:  # a NaN/inf in the fp32 reference itself: no headroom to speak of
            values[tags.SCALE_HEADROOM] = math.log2(self.fmt.max / top)  # negative: the scale overflows
        sink.scalars(values, step)
