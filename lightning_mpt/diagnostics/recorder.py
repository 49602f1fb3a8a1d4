"""``Recorder``: what the statistics of one run share: the sink, the one-sync read-out and the per-backward cache
(see ``docs/diagnostics.md``, "Without a Trainer", for a loop that drives it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor

from lightning_mpt._compat import version
from lightning_mpt.core.numerics import FloatFormat, exponent_histograms
from lightning_mpt.diagnostics.shards import Shards
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistic import Statistic

#: How a queued value is combined across processes whose tensors are shards (FSDP2): ``"sum"`` (counts, sums),
#: ``"max"`` (maxima) or ``"first"`` (a value every process holds alike: rank 0's is taken).
Reduce = Literal["sum", "max", "first"]
#: What a statistic queues: its device tensors, each with how it is reduced across shards.
Parts = list[tuple[Tensor, Reduce]]
#: The sizes of a statistic's parts, which every process knows without computing them.
Layout = list[tuple[int, Reduce]]
#: Tensors, or a function that returns them (called guarded, so that an error in gathering them is the statistic's)
Tensors = Union[Sequence[Optional[Tensor]], Callable[[], Sequence[Optional[Tensor]]]]


def resolve(tensors: Tensors) -> Sequence[Optional[Tensor]]:
    """The tensors themselves: ``tensors()`` when it is a function."""
    return tensors() if callable(tensors) else tensors


@dataclass
class _Queued:
    stat: Statistic
    parts: Parts
    consume: Callable[[list[float]], None]
    failed: bool = False  # a placeholder of a statistic that failed here (sharded: the others learn it at the flush)


class Recorder:
    """What the statistics of one run share: the sink, the one-sync read-out and the per-backward cache.

    During a step, statistics :meth:`queue` (or :meth:`submit`) device tensors with a consumer; :meth:`flush` reads all
    of them with one ``.tolist()`` (one host sync, on a GPU one wait for the device) and hands each consumer its
    values as floats. Each consumer runs guarded by its statistic: one failing consumer turns off its statistic only.
    If the joint read itself fails, each tensor is read alone so that only the statistic whose tensor fails goes off.

    **Sharded parameters** (FSDP2, ``shards`` given): each process measures its local shards and :meth:`flush` reduces
    what every process queued in **one** collective before the one host read (see :data:`Reduce`). Every process
    must then queue the same statistics in the same order and flush together: the statistics decide from what every
    process knows alike (the step, the cadence, :meth:`live`), never from whether their sink writes (only rank 0's
    does). A statistic that fails on one process queues a placeholder of its known :data:`Layout` with a flag; the
    flush turns it off on every process (:meth:`Statistic.retire`), so the processes never disagree about what they
    reduce.

    Args:
        sink: where the values go (rank 0's writer; an inactive sink elsewhere).
        shards: the processes among which the parameters are sharded, ``None`` when every process holds whole tensors.
        active: whether the statistics are measured at all; ``None`` for ``sink.active``. Under sharding every process
            must measure when rank 0 writes: pass the same value on every process.
    """

    def __init__(self, sink: Sink, shards: Optional[Shards] = None, active: Optional[bool] = None) -> None:
        self.sink = sink
        self.shards = shards
        self._active = active
        self.syncs = 0  # host reads done by flush(), for benchmarks and tests
        self.collectives = 0  # collectives done by flush() (sharded parameters)
        self._pending: list[_Queued] = []
        self._stored_key: Optional[tuple[Any, ...]] = None
        self._stored: Optional[Tensor] = None

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def active(self) -> bool:
        """Whether the statistics are measured (whether anything would be written, on some process)."""
        return self.sink.active if self._active is None else self._active

    @active.setter
    def active(self, value: Optional[bool]) -> None:
        self._active = value

    @property
    def sharded(self) -> bool:
        return self.shards is not None

    def live(self, stat: Statistic) -> bool:
        """Whether ``stat`` still takes part: ``stat.enabled`` on whole tensors; under sharding until every process
        agreed it is off (a statistic that failed here still queues its placeholder until then)."""
        return not stat.retired if self.shards is not None else stat.enabled

    def measures(self, stat: Optional[Statistic]) -> bool:
        """Whether ``stat`` is measured now: it exists, the recorder is active and ``stat`` is :meth:`live`."""
        return stat is not None and self.active and self.live(stat)

    def queue(
        self, stat: Statistic, values: Tensor, consume: Callable[[list[float]], None], reduce: Reduce = "first"
    ) -> None:
        """Read ``values`` at the next :meth:`flush` and pass them (flattened, as floats) to ``consume``; under sharding
        they are reduced across processes by ``reduce``."""
        self._pending.append(_Queued(stat, [(values.detach().reshape(-1), reduce)], consume))

    def submit(
        self,
        stat: Statistic,
        compute: Callable[[], Parts],
        consume: Callable[[list[float]], None],
        layout: Callable[[], Layout],
    ) -> None:
        """Queue what ``compute`` returns, guarded by ``stat``, for ``consume`` (the parts' values concatenated).

        ``layout`` gives the parts' sizes without computing them: under sharding a statistic that is off here, or
        whose ``compute`` fails, queues zeros of that layout with a failure flag, so that every process reduces the
        same values (see the class docstring). On whole tensors a statistic that is off queues nothing.
        """
        if not self.live(stat):
            return
        parts: Optional[Parts] = None
        if stat.enabled:
            with stat.guarded():
                parts = [(t.detach().reshape(-1), op) for t, op in compute()]
                if self.shards is not None:
                    got, want = [(t.numel(), op) for t, op in parts], layout()
                    if got != want:
                        raise RuntimeError(f"{stat.what}: the computed parts {got} do not match the layout {want}")
        if parts is not None:
            self._pending.append(_Queued(stat, parts, consume))
        elif self.shards is not None:
            zeros = [(torch.zeros(n, device=self.shards.device), op) for n, op in layout()]
            self._pending.append(_Queued(stat, zeros, consume, failed=True))

    def flush(self) -> None:
        """Read everything queued with one host sync (after one collective under sharding) and hand it to the
        consumers. Called at the end of every step: it also drops the step's cache."""
        self._stored_key = self._stored = None
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if self.shards is not None:
            self._flush_sharded(pending, self.shards)
            return
        try:
            device = pending[0].parts[0][0].device
            dtype = torch.float32 if device.type == "mps" else torch.float64  # counts need float64's 53 bits
            flat = [t.to(device=device, dtype=dtype) for e in pending for t, _ in e.parts]
            values = torch.cat(flat).tolist()  # the one sync
            self.syncs += 1
        except Exception:
            for e in pending:
                with e.stat.guarded():
                    e.consume(torch.cat([t.double().reshape(-1) for t, _ in e.parts]).tolist())
            return
        start = 0
        for e in pending:
            n = sum(t.numel() for t, _ in e.parts)
            with e.stat.guarded():
                e.consume(values[start : start + n])
            start += n

    def _flush_sharded(self, pending: list[_Queued], shards: Shards) -> None:
        """One ``all_reduce`` (sum) of ``[flags | sums | rank-0 values | maxima, one slot per process]``, one host
        read; the maxima of the slots are taken after it (a sum with zeros is exact, so the slots are an all-gather)."""
        try:
            device, world, rank = shards.device, shards.world_size, shards.rank
            sums: list[Tensor] = []
            maxima: list[Tensor] = []
            for e in pending:
                for t, op in e.parts:
                    t = t.to(device=device, dtype=torch.float64)
                    if op == "max":
                        maxima.append(t)
                    else:
                        sums.append(t if op == "sum" or rank == 0 else torch.zeros_like(t))
            flags = torch.tensor([float(e.failed) for e in pending], dtype=torch.float64, device=device)
            n_sum = len(pending) + sum(t.numel() for t in sums)
            n_max = sum(t.numel() for t in maxima)
            buffer = torch.zeros(n_sum + world * n_max, dtype=torch.float64, device=device)
            buffer[:n_sum] = torch.cat([flags, *sums])
            if n_max:
                buffer[n_sum + rank * n_max : n_sum + (rank + 1) * n_max] = torch.cat(maxima)
            shards.all_reduce(buffer, "sum")
            self.collectives += 1
            top = buffer[n_sum:].view(world, n_max).amax(0) if n_max else buffer[:0]
            values = torch.cat([buffer[:n_sum], top]).tolist()  # the one sync
            self.syncs += 1
        except Exception as error:  # the collective itself failed: every statistic of this flush goes off
            for e in pending:
                with e.stat.guarded():
                    raise error
            return
        failed, at_sum, at_max = values[: len(pending)], len(pending), n_sum
        for e, flag in zip(pending, failed):
            v: list[float] = []
            for t, op in e.parts:
                n = t.numel()
                if op == "max":
                    v += values[at_max : at_max + n]
                    at_max += n
                else:
                    v += values[at_sum : at_sum + n]
                    at_sum += n
            if flag > 0:
                e.stat.retire()
                continue
            with e.stat.guarded():
                e.consume(v)

    def clear(self) -> None:
        """Drop what is queued (after an exception in the training step)."""
        self._pending.clear()

    def stored_histograms(self, grads: Sequence[Optional[Tensor]], fmt: FloatFormat) -> Tensor:
        """:func:`~lightning_mpt.core.numerics.exponent_histograms` of the stored gradients ``grads``, computed once per
        backward for every statistic that asks (recomputed when a gradient was replaced or edited in place)."""
        # the tensors are alive while a step measures them, so their address, shape and in-place counter name them
        # (the local shards of FSDP2's gradients are new objects at each call); flush() drops the cache every step
        key = (fmt.name, *(None if g is None else (g.data_ptr(), g.dtype, tuple(g.shape), version(g)) for g in grads))
        if key != self._stored_key or self._stored is None:
            self._stored = exponent_histograms(grads, fmt)
            self._stored_key = key
        return self._stored

    def release(self) -> None:
        """Drop the cache and the queue (between fits)."""
        self._stored_key = self._stored = None
        self._pending.clear()
