"""The statistics of the diagnostics, without Lightning's ``Trainer``: compute them from parameters, gradients and
masters at a loss scale in a half format, and hand them to a :class:`~lightning_mpt.diagnostics.sink.Sink`.

The Trainer callbacks (:mod:`lightning_mpt.callbacks`) only decide *when* and gather the tensors from the Trainer;
everything below takes plain tensors, names and numbers, so that another driver (a Fabric loop, a script) writes the
same tags with the same code. The pieces:

* :class:`Recorder`: what the statistics of one run share: the :class:`Sink`, the **read-out** (device tensors
  queued during a step and read on the host with one ``.tolist()`` for all of them at :meth:`Recorder.flush`), and
  the exponent histograms of the stored gradients, computed once per backward for all statistics.
* :class:`Statistic`: the unit that fails alone. An internal error in one statistic is one warning with its
  traceback and turns that statistic off; the others and training go on. With ``strict`` (or the environment
  variable ``LIGHTNING_MPT_STRICT_DIAGNOSTICS=1``) the error is raised instead, as the tests run them.
* the statistics: :class:`StoredFractions`, :class:`ExponentHistograms`, :class:`ValueHistograms`,
  :class:`UpdateUnderflow`, :class:`FlushReference` (with :class:`FlushStatistics`, its cross-rank reduction) and
  :class:`LossScaleLog`.
* what a precision plugin exposes, read by duck typing (:func:`half_format`, :func:`loss_scale`,
  :class:`ParamTable`): ``MPTPrecision`` (``half_dtype``, ``master_of``, ``backward_scale``) and Lightning's
  autocast precisions (``precision``, ``scaler``).

Example:
    ```python
    import tempfile

    import torch
    from torch.utils.tensorboard import SummaryWriter
    from lightning_mpt.diagnostics.sink import Sink
    from lightning_mpt.diagnostics.statistics import Recorder, StoredFractions
    from lightning_mpt.core.numerics import FP16

    grads = [torch.tensor([0.0, 1e-6, 3.0], dtype=torch.float16), torch.ones(4, dtype=torch.float16)]
    with SummaryWriter(tempfile.mkdtemp()) as writer:
        recorder = Recorder(Sink(writer))
        StoredFractions(["a", "b"], FP16).measure(recorder, grads, step=0)   # queued on the device
        recorder.flush()                                                     # one host read, then written
    assert recorder.syncs == 1
    ```
"""

from __future__ import annotations

import math
import os
import random
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Optional, Union

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_mpt._compat import fsdp_forward_hooks_suspended, metric_private_state, version
from lightning_mpt.core.masters import DEFAULT_KEEP_FP32, HALF_DTYPES
from lightning_mpt.core.numerics import (
    BF16,
    FP16,
    FloatFormat,
    exponent_bins,
    exponent_histograms,
    flush_counts,
    format_of,
    max_abs,
    stored_counts,
    update_underflow_counts,
    value_histograms,
    value_ranges,
)
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.sink import Sink

STRICT_ENV = "LIGHTNING_MPT_STRICT_DIAGNOSTICS"


def strict_from_env() -> bool:
    """Whether ``LIGHTNING_MPT_STRICT_DIAGNOSTICS`` asks for strict diagnostics (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class DiagnosticsWarning(UserWarning):
    """A diagnostic statistic failed and was turned off; training goes on."""


# ------------------------------------------------------------------------------------------- failing alone
class Statistic:
    """A statistic that fails alone: an exception inside :meth:`guarded` turns it off with one
    :class:`DiagnosticsWarning` holding the traceback (or propagates, when ``strict``).

    Args:
        owner: who computes it, for the message (a callback's class name).
        what: what it is, for the message (e.g. ``"the fp32 reference (<its tags>)"``).
        strict: re-raise internal errors; ``None`` reads ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``.
    """

    def __init__(self, owner: str, what: str, strict: Optional[bool] = None) -> None:
        self.owner = owner
        self.what = what
        self.strict = strict_from_env() if strict is None else strict
        self.enabled = True
        self.retired = False  # off on every process (sharded parameters: see Recorder.submit)
        self.error: Optional[BaseException] = None

    def guarded(self) -> _Guard:
        """A context that hands an ``Exception`` raised in it to :meth:`fail` (and swallows it unless strict)."""
        return _Guard(self)

    def fail(self, error: BaseException) -> None:
        """Turn this statistic off with one warning, or raise ``error`` when strict."""
        if self.strict:
            raise error
        if not self.enabled:
            return
        self.enabled = False
        self.error = error
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        rank = _rank()
        warnings.warn(
            f"{self.owner}: {self.what} failed{f' on rank {rank}' if rank else ''} with {type(error).__name__}: "
            f"{error}. It is off for the rest of this run; training and the other statistics go on. Set "
            f"{STRICT_ENV}=1 (or the callback's strict=True) to raise instead.\n{trace}",
            DiagnosticsWarning,
            stacklevel=3,
        )


class _Guard:
    def __init__(self, stat: Statistic) -> None:
        self.stat = stat

    def __enter__(self) -> Statistic:
        return self.stat

    def __exit__(self, kind: Optional[type], error: Optional[BaseException], trace: Optional[TracebackType]) -> bool:
        if error is None or not isinstance(error, Exception) or self.stat.strict:
            return False  # nothing happened, an interrupt, or strict: let it propagate
        self.stat.fail(error)
        return True


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ------------------------------------------------------------------------------------------ sharded tensors
#: How a queued value is combined across processes whose tensors are shards (FSDP2): ``"sum"`` (counts, sums),
#: ``"max"`` (maxima) or ``"first"`` (a value every process holds alike: rank 0's is taken).
Reduce = Literal["sum", "max", "first"]
#: What a statistic queues: its device tensors, each with how it is reduced across shards.
Parts = list[tuple[Tensor, Reduce]]
#: The sizes of a statistic's parts, which every process knows without computing them.
Layout = list[tuple[int, Reduce]]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and gradients), by duck typing so
    that no torch version without ``DTensor`` is needed."""
    return isinstance(t, Tensor) and callable(getattr(t, "to_local", None)) and hasattr(t, "placements")


def local_tensor(t: Tensor) -> Tensor:
    """This process's shard of a ``DTensor`` (the local tensor itself, detached: it sees in-place updates of the
    parameter), or ``t`` detached."""
    if is_dtensor(t):
        with torch.no_grad():
            local: Tensor = t.to_local()  # type: ignore[attr-defined]  # a DTensor method
        return local.detach()
    return t.detach()


class Shards:
    """The processes among which parameters are sharded (FSDP2): what the statistics sum their counts over.

    A statistic computed on the local shards is made global by one collective per logging step (see
    :meth:`Recorder.flush`): counts and sums are summed, maxima maxed, and the fractions derived from the totals equal
    those of the whole, unsharded tensors. Every process must take part; rank 0 writes.

    Args:
        device: where the local shards live (the collective's device).
        group: the process group; ``None`` for the default (every process).
    """

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group
        self.world_size = torch.distributed.get_world_size(group)
        self.rank = torch.distributed.get_rank(group)
        self.calls = 0  # collectives run, for tests and benchmarks

    @classmethod
    def of(cls, params: Sequence[Tensor]) -> Optional[Shards]:
        """The shards of ``params`` if any is a ``DTensor``, ``None`` for replicated (DDP) or local parameters.

        Raises ``ValueError`` when the parameters' device meshes do not span every process (pipeline stages), where a
        sum over all processes would not be the sum over one model's shards."""
        sharded = [p for p in params if is_dtensor(p)]
        if not sharded:
            return None
        world = torch.distributed.get_world_size()
        for p in sharded:
            mesh: Any = p.device_mesh  # type: ignore[attr-defined]  # a DTensor attribute
            if mesh.size() != world:
                raise ValueError(
                    f"the diagnostics sum the parameters' shards over all {world} processes, and a parameter is "
                    f"sharded over a device mesh of {mesh.size()}: only meshes that span every process are supported."
                )
        return cls(local_tensor(sharded[0]).device)

    def owns(self, p: Tensor) -> bool:
        """Whether this process counts its local part of ``p``: always for sharded dimensions; for replicated mesh
        dimensions (HSDP, tensor parallel with replicated parameters) only the process at coordinate 0 does, so that
        no value is counted twice."""
        if not is_dtensor(p):
            return self.rank == 0
        placements: Any = p.placements  # type: ignore[attr-defined]
        coordinate = p.device_mesh.get_coordinate()  # type: ignore[attr-defined]
        if coordinate is None:
            return False
        return all(c == 0 for c, place in zip(coordinate, placements) if not place.is_shard())

    def all_reduce(self, tensor: Tensor, op: Literal["sum", "max"]) -> None:
        """``torch.distributed.all_reduce`` of ``tensor`` in place (no host sync)."""
        dist = torch.distributed
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        self.calls += 1

    def reduce_ranges(self, ranges: Tensor) -> Tensor:
        """The global ``(min, max)`` rows of per-process ``(min, max)`` rows
        (:func:`~lightning_mpt.core.numerics.value_ranges`): one collective."""
        both = torch.stack([-ranges[:, 0], ranges[:, 1]], dim=1).to(self.device, torch.float64)
        self.all_reduce(both, "max")
        return torch.stack([-both[:, 0], both[:, 1]], dim=1)


#: Tensors, or a function that returns them (called guarded, so that an error in gathering them is the statistic's)
Tensors = Union[Sequence[Optional[Tensor]], Callable[[], Sequence[Optional[Tensor]]]]


def _resolve(tensors: Tensors) -> Sequence[Optional[Tensor]]:
    return tensors() if callable(tensors) else tensors


@dataclass
class _Entry:
    stat: Statistic
    parts: Parts
    consume: Callable[[list[float]], None]
    failed: bool = False  # a placeholder of a statistic that failed here (sharded: the others learn it at the flush)


# --------------------------------------------------------------------------------------------- the recorder
class Recorder:
    """What the statistics of one run share: the sink, the one-sync read-out and the per-backward cache.

    During a step, statistics :meth:`queue` (or :meth:`submit`) device tensors with a consumer; :meth:`flush` reads all
    of them with one ``.tolist()`` (one host sync, on a GPU one wait for the device) and hands each consumer its
    values as floats. Each consumer runs guarded by its statistic: one failing consumer turns off its statistic only.
    If the joint read itself fails, each tensor is read alone so that only the statistic whose tensor fails goes off.

    **Sharded parameters** (FSDP2, ``shards`` given): each process measures its local shards and :meth:`flush` reduces
    what every process queued in **one** collective before the one host read (sums, maxima, see :data:`Reduce`). Every
    process must then queue the same statistics in the same order and flush together: the statistics decide from
    what every process knows alike (the step, the cadence, :meth:`live`), never from whether their sink writes (only
    rank 0's does). A statistic that fails on one process queues a placeholder of its known :data:`Layout` with a
    flag; the flush turns it off on every process (:attr:`Statistic.retired`), so the processes never disagree about
    what they reduce.

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
        self._pending: list[_Entry] = []
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

    def queue(
        self, stat: Statistic, values: Tensor, consume: Callable[[list[float]], None], reduce: Reduce = "first"
    ) -> None:
        """Read ``values`` at the next :meth:`flush` and pass them (flattened, as floats) to ``consume``; under sharding
        they are reduced across processes by ``reduce``."""
        self._pending.append(_Entry(stat, [(values.detach().reshape(-1), reduce)], consume))

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
            self._pending.append(_Entry(stat, parts, consume))
        elif self.shards is not None:
            zeros = [(torch.zeros(n, device=self.shards.device), op) for n, op in layout()]
            self._pending.append(_Entry(stat, zeros, consume, failed=True))

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

    def _flush_sharded(self, pending: list[_Entry], shards: Shards) -> None:
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
                self._retire(e.stat)
                continue
            with e.stat.guarded():
                e.consume(v)

    @staticmethod
    def _retire(stat: Statistic) -> None:
        """``stat`` failed on some process: it is off on every process from now on."""
        stat.retired = True
        if stat.enabled:  # it failed on another process: say so here too
            stat.enabled = False
            warnings.warn(
                f"{stat.owner}: {stat.what} failed on another process (its warning holds the traceback). It is off on "
                "every process for the rest of this run; training and the other statistics go on.",
                DiagnosticsWarning,
                stacklevel=3,
            )

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


# ------------------------------------------------------------------------ what a precision plugin exposes
def has_masters(plugin: Any) -> bool:
    """Whether ``plugin`` keeps half-precision weights with fp32 masters the way ``MPTPrecision`` does (it has
    ``half_dtype`` and ``master_of``)."""
    return hasattr(plugin, "half_dtype") and callable(getattr(plugin, "master_of", None))


def half_format(plugin: Any) -> Optional[FloatFormat]:
    """The half-precision format the plugin computes in: fp16 or bf16, ``None`` for full precision."""
    if has_masters(plugin):
        return format_of(plugin.half_dtype)
    precision = str(getattr(plugin, "precision", ""))
    if precision.startswith("16"):
        return FP16
    if precision.startswith("bf16"):
        return BF16
    return None


def grad_scaler(plugin: Any) -> Optional[torch.amp.GradScaler]:
    """The :class:`torch.amp.GradScaler` of Lightning's ``MixedPrecision`` plugin, if any."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def loss_scale(plugin: Any) -> float:
    """The loss scale the current step's gradients were computed with (read before the scaler updates)."""
    if has_masters(plugin) and hasattr(plugin, "backward_scale"):
        return float(plugin.backward_scale)
    scaler = grad_scaler(plugin)
    return scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0


def describe_precision(plugin: Any) -> dict[str, Any]:
    """The fields of the ``mpt/data/run`` record that describe the precision plugin."""
    fmt = half_format(plugin)
    scaler = getattr(plugin, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler):
        scaling = "grad_scaler" if scaler.is_enabled() else "none"
    elif scaler is None:
        scaling = "none"
    else:
        scaling = "static" if getattr(scaler, "is_static", False) else "dynamic"
    return {
        "format": fmt.name if fmt is not None else None,
        "plugin": type(plugin).__name__,
        "precision": str(getattr(plugin, "precision", "")),
        "loss_scaling": scaling,
    }


class ParamTable:
    """The parameters computed in the half format, in ``named_parameters()`` order.

    Under a plugin with masters (``MPTPrecision``) these are the parameters it cast to fp16/bf16 (norm layers stay
    fp32 and are left out). Under Lightning's autocast precisions every parameter is fp32, and the gradients of the
    layers that autocast runs in half precision are formed from half-precision values: all floating-point
    parameters except those of norm layers.

    **FSDP2** (``shards`` given): the parameters are fp32 ``DTensor`` shards, which are the masters; a parameter is in
    the table when its ``fully_shard`` group all-gathers it in the half format. :meth:`grads` and :meth:`masters` then
    give this process's shards (empty where another process counts a replicated shard, see :meth:`Shards.owns`).
    """

    def __init__(self, module: nn.Module, plugin: Any, shards: Optional[Shards] = None) -> None:
        masters = has_masters(plugin)
        kept = {id(p) for m in module.modules() if isinstance(m, DEFAULT_KEEP_FP32) for p in m.parameters()}
        compute: dict[str, torch.dtype] = {}
        if shards is not None and masters:
            from lightning_mpt.core.masters.sharded import compute_dtypes

            compute = compute_dtypes(module)
        self.shards = shards
        self.names: list[str] = []
        self.params: list[Tensor] = []
        for name, p in module.named_parameters():
            if shards is not None and masters:
                half = compute.get(name, p.dtype) in HALF_DTYPES
            else:
                half = (p.dtype in HALF_DTYPES) if masters else (p.is_floating_point() and id(p) not in kept)
            if half:
                self.names.append(name)
                self.params.append(p)
        self._owned = [shards is None or shards.owns(p) for p in self.params]

    def __len__(self) -> int:
        return len(self.params)

    def grads(self) -> list[Optional[Tensor]]:
        """Each parameter's gradient as stored (this process's shard under FSDP2), ``None`` where it has none."""
        if self.shards is None:
            return [p.grad for p in self.params]
        return [None if p.grad is None else _owned(p.grad, own) for p, own in zip(self.params, self._owned)]

    def masters(self, plugin: Any) -> list[Optional[Tensor]]:
        """The fp32 tensor the optimizer steps for each parameter, ``None`` where the half tensor is stepped itself
        (``MPTPrecision(master_weights=False)``, ``"16-true"``). Under FSDP2 the fp32 shards."""
        if self.shards is not None:
            return [_owned(p, own) if p.dtype == torch.float32 else None for p, own in zip(self.params, self._owned)]
        if has_masters(plugin):
            return [m if m is not p else None for p, m in ((p, plugin.master_of(p)) for p in self.params)]
        return [p if p.dtype == torch.float32 else None for p in self.params]


def _owned(t: Tensor, own: bool) -> Tensor:
    local = local_tensor(t)
    return local if own else local.new_empty(0)


def module_name(param_name: str) -> str:
    """``"encoder.0.linear.weight"`` -> ``"encoder.0.linear"``; a parameter of the root module -> ``"(root)"``."""
    owner, _, _ = param_name.rpartition(".")
    return owner or "(root)"


def ratio(num: float, den: float) -> Optional[float]:
    """``num / den``, ``None`` when undefined (no values to take a share of)."""
    return num / den if den > 0 else None


def histogram_buckets(limits: list[float], counts: list[float]) -> tuple[list[float], list[float]]:
    """Merge runs of empty buckets into one (TensorBoard draws the same picture from fewer bytes)."""
    out_limits: list[float] = []
    out_counts: list[float] = []
    for limit, count in zip(limits, counts):
        if count == 0 and out_counts and out_counts[-1] == 0:
            out_limits[-1] = limit
        else:
            out_limits.append(limit)
            out_counts.append(count)
    return out_limits, out_counts


class PerParameter(Statistic):
    """A statistic of named parameters in a half format, written in total and, with ``per_parameter``, for each
    parameter under its name. Subclasses say what they measure in :attr:`what`.

    Args:
        names: the parameters' names, one per tensor the statistic is given.
        fmt: the half format.
        per_parameter: also write each parameter's figures.
        owner: who measures (for messages).
        strict: raise rather than warn when the statistic fails (``None``: ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).
    """

    what = "a per-parameter statistic"

    def __init__(
        self,
        names: Sequence[str],
        fmt: FloatFormat,
        per_parameter: bool = True,
        owner: str = "diagnostics",
        strict: Optional[bool] = None,
    ) -> None:
        super().__init__(owner, self.what, strict)
        self.names, self.fmt, self.per_parameter = list(names), fmt, per_parameter


# -------------------------------------------------------------------------------- the stored half gradients
class StoredFractions(PerParameter):
    """Zero, subnormal and overflow fractions of the stored (scaled) half gradients, and the headroom of the largest
    stored value: ``mpt/grad_zero_fraction``, ``mpt/grad_subnormal_fraction``, ``mpt/grad_overflow_fraction``
    (global, and per parameter with ``per_parameter``), ``mpt/stored_headroom``.

    Args (:class:`PerParameter`): ``names``, one per gradient passed to :meth:`measure`; ``fmt``, the half format
    the gradients are stored in.
    """

    what = f"the stored-gradient fractions ({tags.GRAD_ZERO}, {tags.GRAD_SUBNORMAL}, ...)"

    def measure(self, recorder: Recorder, grads: Tensors, step: int) -> None:
        """Queue the counts of ``grads`` (the gradients as the backward left them; ``None`` for none). Under FSDP2,
        this process's shards: the counts are summed and the largest value maxed across processes."""

        def compute() -> Parts:
            found = _resolve(grads)
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

        def fractions(name: Optional[str], numel: float, zero: float, sub: float, nzf: float, over: float) -> None:
            for tag, value in (
                (tags.GRAD_ZERO, ratio(zero, numel)),
                (tags.GRAD_SUBNORMAL, ratio(sub, nzf)),
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
    ``mpt/grad_exponent/<group>``, and once the format's marks (``mpt/format/*``, ``mpt/legend/grad_exponent``).

    Layout (x axis in powers of two; fp16 numbers shown): one bucket per exponent from the format's min subnormal
    (-24) to its max (15; the min normal is -14); the bucket left of a gap (at -27) counts exact zeros and the bucket
    right of a gap (at 18) counts inf/NaN. The axis always spans the whole format.

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
            hist = recorder.stored_histograms(_resolve(grads), self.fmt)
            if self._index.device != hist.device:
                self._index = self._index.to(hist.device)  # once: a host-to-device copy waits for the device
            grouped = torch.zeros(len(self.groups), hist.shape[1], dtype=hist.dtype, device=hist.device)
            grouped.index_add_(0, self._index, hist)
            return [(grouped, "sum")]

        size = len(self.groups) * len(exponent_bins(self.fmt))
        recorder.submit(self, compute, lambda v: self._write(recorder.sink, v, step), lambda: [(size, "sum")])

    def _write(self, sink: Sink, v: list[float], step: int) -> None:
        fmt = self.fmt
        nb = len(exponent_bins(fmt))
        lo_e, hi_e = fmt.min_exponent, fmt.max_exponent
        # x positions: zero bucket (lo_e-3, lo_e-2], gap, exponent e at (e, e+1], gap, non-finite (hi_e+3, hi_e+4]
        limits = [lo_e - 2, lo_e, *range(lo_e + 1, hi_e + 2), hi_e + 3, hi_e + 4]
        centers = [lo_e - 2.5, 0.0, *(e + 0.5 for e in range(lo_e, hi_e + 1)), 0.0, hi_e + 3.5]
        for i, name in enumerate(self.groups):
            row = v[i * nb : (i + 1) * nb]
            num = sum(row)
            if num <= 0:
                continue
            counts = [row[0], 0.0, *row[1:-1], 0.0, row[-1]]
            total = sum(c * x for c, x in zip(counts, centers))
            squares = sum(c * x * x for c, x in zip(counts, centers))
            lim, cnt = histogram_buckets([float(x) for x in limits], counts)
            sink.histogram_raw(
                tags.per_parameter(tags.GRAD_EXPONENT, name),
                step,
                min=float(lo_e - 3),
                max=float(hi_e + 4),
                num=num,
                sum=total,
                sum_squares=squares,
                bucket_limits=lim,
                bucket_counts=cnt,
            )


# ----------------------------------------------------------------------------------- the true gradients
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
                step_ = (hi - lo) / self.bins
                limits = [lo + (k + 1) * step_ for k in range(self.bins)]
                limits[-1] = hi
            else:
                limits, counts = [hi], [num]
            limits, counts = histogram_buckets(limits, counts)
            sink.histogram_raw(
                tags.per_parameter(tags.GRAD_HIST, name),
                step,
                min=lo,
                max=hi,
                num=num,
                sum=total,
                sum_squares=squares,
                bucket_limits=limits,
                bucket_counts=counts,
            )


# ------------------------------------------------------------------------------------------- the updates
class UpdateUnderflow(PerParameter):
    """``mpt/update_underflow_fraction``: of the master weights an optimizer step changed, the share whose change a
    half-precision weight would not see (DESIGN.md §4). :meth:`snapshot` copies the masters before the step (4 bytes
    per parameter, transient), :meth:`measure` compares after it. A skipped step changes nothing: nothing is written.

    Args (:class:`PerParameter`): ``names``, one per master passed to :meth:`snapshot`; ``fmt``, the half format.
    """

    what = f"the update underflow ({tags.UPDATE_UNDERFLOW})"
    _due: Optional[tuple[int, list[int]]] = None  # the step and the parameters with a master
    _snapshot: Optional[tuple[list[Tensor], list[Tensor]]] = None  # the masters and their copies

    @property
    def pending(self) -> bool:
        return self._due is not None

    def snapshot(self, masters: Tensors, step: int) -> None:
        """Copy the fp32 masters before the optimizer step (``None`` for a parameter stepped in half precision; under
        FSDP2 this process's shards, all present)."""
        if self._due is not None:
            return
        index = list(range(len(self.names)))  # where gathering the masters fails: every parameter, as under FSDP2
        if self.enabled:
            with self.guarded():
                found = _resolve(masters)
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
        self._due = self._snapshot = None

    def _write(self, sink: Sink, v: list[float], step: int, index: list[int]) -> None:
        changed, lost = v[0::2], v[1::2]
        values = {tags.UPDATE_UNDERFLOW: ratio(sum(lost), sum(changed))}
        if self.per_parameter:
            for i, c, lo in zip(index, changed, lost):
                values[tags.per_parameter(tags.UPDATE_UNDERFLOW, self.names[i])] = ratio(lo, c)
        sink.scalars(values, step)


# ------------------------------------------------------------------------------------ the fp32 reference
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
    ``torch.distributed``: every rank must call it, or none); :meth:`queue` hands the result to the writer.

    Args (:class:`PerParameter`): ``names``, one per reference gradient; ``fmt``, the half format the gradients are
    stored in.
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
            elif self.enabled:
                self.enabled = False
                warnings.warn(
                    f"{self.owner}: the fp32 reference step {reason or 'failed on another process'}; flush fractions "
                    "and scale headroom are off for the rest of this run.",
                    DiagnosticsWarning,
                    stacklevel=3,
                )
            return None
        if local is None:  # every rank had a result, this one included (the decision above)
            return None
        stats: Optional[ReferenceStats] = None
        with self.guarded():
            stats = self.reduce(*local, scale, step)
        if recorder.active:  # also where reduce failed: under sharding every process queues (a placeholder)
            self.queue(recorder, stats, step)
        return stats

    def queue(self, recorder: Recorder, stats: Optional[ReferenceStats], step: Optional[int] = None) -> None:
        """Hand ``stats`` to ``recorder``'s next flush, to be written at ``step`` (``stats.step`` by default).

        Its values are already reduced across processes (:meth:`reduce`), and every process holds them alike: a
        sharded recorder (FSDP2), which sums what it reduces, takes rank 0's (``"first"``), never their sum. There a
        ``None`` (:meth:`reduce` failed here) or a failing queue is a flagged placeholder of the same size, and the
        flush turns the reference off on every process (see :meth:`Recorder.submit`)."""
        at = step if step is not None else stats.step if stats is not None else 0

        def compute() -> Parts:
            if stats is None:
                raise RuntimeError("no reference counts")  # reduce failed (already reported): a placeholder
            return [(torch.cat([stats.nonzero.double(), stats.flushed.double(), stats.max_scaled.double()]), "first")]

        n = len(self.names)
        recorder.submit(self, compute, lambda v: self._write(recorder.sink, v, at), lambda: [(3 * n, "first")])

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


# ------------------------------------------------------------------------------- the fp32 re-run of a batch
def reference_gradients(
    module: nn.Module,
    table: ParamTable,
    plugin: Any,
    run: Callable[..., Any],
    args: tuple[Any, ...] = (),
    rng: Optional[dict[str, Any]] = None,
    divisor: float = 1.0,
) -> Optional[list[Optional[Tensor]]]:
    """fp32 gradients of a loss for ``table``'s parameters, computed with the fp32 masters, leaving every state as it
    was: ``run(module, *args)`` is called with ``module``'s parameters replaced by fp32 weights (the masters; other
    half parameters cast to fp32), autocast off and floating-point tensors in ``args`` cast to fp32, and returns the
    loss (a tensor, or a mapping with ``"loss"``); ``None`` when it returns nothing to differentiate.

    The weights stand in for the parameters through ``torch.func.functional_call``, which swaps module attributes:
    the parameters themselves (their data, gradients and autograd accumulators, which DDP hooks) are never touched.
    Buffers (BatchNorm statistics) and torchmetrics states the re-run updates are restored; with ``rng`` (from
    :func:`rng_state`, taken before the real forward) the re-run draws the same random numbers (dropout masks), and
    the random state continues afterwards where it was. ``divisor`` divides the loss (gradient accumulation).

    **FSDP2** (``table.shards`` given): each parameter is an fp32 ``DTensor`` shard, the master. The whole fp32
    weights are gathered first (:func:`full_parameters`, a collective per sharded parameter that every process enters
    in the same order, before any of ``run``'s code), and ``run`` goes with the forward hooks of ``fully_shard``
    suspended (:func:`~lightning_mpt._compat.fsdp_forward_hooks_suspended`): no all-gather of the half compute copy,
    no reduce-scatter into the real gradients. Each process then differentiates its own batch with respect to the
    whole weights, as under DDP, holding a whole fp32 copy of the weights and of their gradients meanwhile.

    Example:
        ```python
        import torch
        from torch import nn
        from lightning_mpt.diagnostics.statistics import ParamTable, reference_gradients
        from lightning_mpt.fabric import MPTPrecision

        plugin = MPTPrecision("fp16")
        model = plugin.convert_module(nn.Linear(4, 2))       # half weights, fp32 masters
        x = torch.randn(8, 4)
        grads = reference_gradients(model, ParamTable(model, plugin), plugin, lambda m, x: m(x).pow(2).mean(), (x,))
        master = plugin.master_of(model.weight).detach().requires_grad_()
        (expected,) = torch.autograd.grad((x @ master.T + plugin.master_of(model.bias)).pow(2).mean(), [master])
        assert grads[0].dtype == torch.float32 and torch.allclose(grads[0], expected)
        plugin.restore()
        ```
    """
    # FSDP2: the parameters are fp32 shards (the masters), gathered whole first, before any user code runs
    whole = full_parameters(module, table)
    masters = table.masters(plugin) if table.shards is None else [None] * len(table)
    # a master not yet next to its parameter (a plugin moves them at the first forward) is copied there
    weights = {
        n: (
            whole[n].float() if n in whole else m.detach().to(p.device) if m is not None else p.detach().float()
        ).requires_grad_(p.requires_grad)
        for n, p, m in zip(table.names, table.params, masters)
    }
    # the other sharded parameters (fp32 norm layers) whole, other half parameters ("16-true" norm layers) in fp32
    weights.update({n: w.float() for n, w in whole.items() if n not in weights})
    weights.update({
        n: p.detach().float() for n, p in module.named_parameters() if p.dtype in HALF_DTYPES and n not in weights
    })
    inputs = apply_to_collection(args, Tensor, lambda t: t.float() if t.is_floating_point() else t)
    device = next((w.device for w in weights.values()), torch.device("cpu"))
    with ExitStack() as stack:
        if whole:  # nothing of FSDP2 runs: no all-gather of the half copy, no reduce-scatter into the gradients
            stack.enter_context(fsdp_forward_hooks_suspended(module))
        stack.enter_context(restored_state(module))
        if rng is not None:
            stack.enter_context(replayed_rng(rng))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autocast(device.type, enabled=False))
        out = torch.func.functional_call(
            _Run(module, run), {f"module.{n}": w for n, w in weights.items()}, tuple(inputs), strict=False
        )
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            return None
        if divisor != 1.0:
            loss = loss / divisor
        wanted = [i for i, p in enumerate(table.params) if p.requires_grad]
        found = torch.autograd.grad(loss, [weights[table.names[i]] for i in wanted], allow_unused=True)
    grads: list[Optional[Tensor]] = [None] * len(table)
    for i, g in zip(wanted, found):
        grads[i] = g
    return grads


def full_parameters(module: nn.Module, table: ParamTable) -> dict[str, Tensor]:
    """The whole fp32 tensors of the sharded (``DTensor``) parameters of ``module`` by name, detached: those of
    ``table`` (the masters FSDP2 steps), then the others (norm layers sharded in fp32) in ``named_parameters()`` order;
    empty without sharded parameters. Each is a collective (``DTensor.full_tensor()``, an all-gather): every process
    must call it at the same time with the same module, as the fp32 reference does before it runs any user code."""
    found = [(n, p) for n, p in zip(table.names, table.params) if is_dtensor(p)]
    named = set(table.names)
    found += [(n, p) for n, p in module.named_parameters() if is_dtensor(p) and n not in named]
    with torch.no_grad():
        return {n: p.full_tensor().detach() for n, p in found}  # type: ignore[attr-defined]  # a DTensor method


class _Run(nn.Module):
    """``run(module, *args)`` as a forward, so that ``torch.func.functional_call`` can swap ``module``'s weights."""

    def __init__(self, module: nn.Module, run: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self.run = run

    def forward(self, *args: Any) -> Any:
        return self.run(self.module, *args)


@contextmanager
def restored_state(module: nn.Module) -> Iterator[None]:
    """Restore buffers (BatchNorm running statistics) and torchmetrics states that code run inside may update."""
    buffers = [(m, name, b, b.clone()) for m in module.modules() for name, b in m.named_buffers(recurse=False)]
    metrics = [(m, _metric_state(m)) for m in module.modules() if isinstance(m, Metric)]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, copy in buffers:
                if getattr(m, name) is not b:
                    setattr(m, name, b)  # the re-run rebound it: put the original back (Module.__setattr__)
                b.copy_(copy)
        for m, state in metrics:
            for k, v in state.items():
                setattr(m, k, v)


def _metric_state(m: Metric) -> dict[str, Any]:
    state = {k: (v.clone() if isinstance(v, Tensor) else list(v)) for k, v in m.metric_state.items()}
    state.update(metric_private_state(m))
    return state


def rng_state() -> dict[str, Any]:
    """The random state of torch (CPU and, once initialised, CUDA), Python and NumPy (if imported)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a state of :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


@contextmanager
def replayed_rng(state: dict[str, Any]) -> Iterator[None]:
    """Run with the random state ``state`` (same dropout masks as the real step), then continue where it was."""
    now = rng_state()
    set_rng_state(state)
    try:
        yield
    finally:
        set_rng_state(now)


# ----------------------------------------------------------------------------------------- the loss scale
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
        self.overflows = 0  # skipped steps seen, cumulative (also across a resume)
        self.seen = -1  # the last step of a plugin's history logged by :meth:`history`

    def history(self, sink: Sink, records: Sequence[Any], scale_now: float) -> None:
        """Log the steps of a plugin's ``history`` (``MPTPrecision.history``: records with ``step``, ``scale``,
        ``skipped``, ``nonfinite_params``, ``loss_finite``) that are newer than :attr:`seen`; ``scale_now`` is the
        plugin's ``loss_scale``, the scale after the last record."""
        new = []
        for record in reversed(records):
            if record.step <= self.seen:
                break
            new.append(record)
        new.reverse()
        for i, r in enumerate(new):
            after = new[i + 1].scale if i + 1 < len(new) else scale_now
            self.step(sink, r.step, r.scale, after, r.skipped, _names_of(r), r.loss_finite)
            self.seen = r.step

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
                shown = ", ".join(f"`{n}`" for n in bad[: self.max_names])
                more = f" and {len(bad) - self.max_names} more" if len(bad) > self.max_names else ""
                loss = "unknown" if loss_finite is None else ("finite" if loss_finite else "**non-finite**")
                sink.text(
                    tags.NONFINITE_TEXT,
                    f"step {step} skipped: {len(bad)} parameter(s) with inf/NaN gradients: "
                    f"{shown or '(none found)'}{more}; loss {loss}; scale {scale:g} -> {after:g}",
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
