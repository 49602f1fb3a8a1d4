"""Noticing half weights that user code edited in place outside the optimizer step (a WGAN clamp,
``nn.Embedding(max_norm=...)``, a weight average copied in), so that the masters adopt the edits instead of the next
refresh undoing them. A half weight was edited when it differs from its master rounded to the half format."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from lightning_mpt import _compat
from lightning_mpt.core.masters._flat import FlatLayout
from lightning_mpt.core.masters._halves import HalfWeights


def edit_flags(params: list[Tensor], masters: list[Tensor], layout: Optional[FlatLayout] = None) -> Tensor:
    """Whether each half weight differs from its rounded master, on the device. On CPU a single flag for all of them:
    :func:`edited_pairs` then finds which.

    Args:
        params: the half weights.
        masters: their fp32 masters.
        layout: the :class:`FlatLayout` of ``masters``, when known: the masters are rounded into its reused buffer of
            the half format (on CPU the weights of each of its shapes are then compared at once).

    Example:
        ```python
        w = torch.tensor([1.0, 2.0], dtype=torch.float16)
        m = torch.tensor([1.0, 2.0001])  # rounds to w: not an edit
        assert not edit_flags([w], [m]).any()
        w[0] = 3.0
        assert edit_flags([w], [m]).all()
        ```
    """
    if not params:
        return torch.zeros(0, dtype=torch.bool)
    if params[0].device.type == "cpu":
        # CPUs emulate half arithmetic (60 ms for 3.4M values) and pay per tensor in Python: one comparison of the
        # bit patterns of everything, a single flag; which parameters were edited is worked out only if one was
        return _any_edited(params, masters, layout).reshape(1)
    return _each_edited(params, masters, layout)


def _each_edited(params: list[Tensor], masters: list[Tensor], layout: Optional[FlatLayout]) -> Tensor:
    """One flag per half weight, from fused multi-tensor kernels: the masters rounded into a scratch of the weights'
    format, minus the weights, each difference's largest magnitude. The scratch is a buffer of its own (``layout``'s
    reused one when the weights share a format), never the half gradients: user code may hold those."""
    dtype, device = params[0].dtype, params[0].device
    if layout is not None and all(p.dtype == dtype for p in params):
        scratch = layout.views(dtype, device, "rounded masters")[1]
    else:
        layout, scratch = None, [torch.empty_like(p) for p in params]
    _compat.foreach_copy_(scratch, masters)  # the masters rounded to the half format
    flags = torch.zeros(len(params), dtype=torch.bool, device=device)
    full = [i for i, t in enumerate(scratch) if t.numel()]  # an empty tensor cannot be edited (nor normed)
    if full:  # one fused launch per op: difference, then each tensor's largest
        _compat.foreach_sub_([scratch[i] for i in full], [params[i].detach() for i in full])
        changed = torch.stack(list(_compat.foreach_norm([scratch[i] for i in full], float("inf")))) != 0
        flags = (
            changed
            if len(full) == len(params)
            else flags.index_copy(0, torch.tensor(full, device=flags.device), changed)
        )
    del scratch  # dead now: its memory goes back
    if layout is not None:
        layout.release("rounded masters")
    return flags


def _any_edited(params: list[Tensor], masters: list[Tensor], layout: Optional[FlatLayout]) -> Tensor:
    """Whether any half weight differs from its master rounded (0-dim): the weights, and the masters, of one shape
    stacked in one call each, not viewed or copied one by one from Python (which costs more than the comparison),
    the masters rounded in one cast (the rounding of a copy into the half format), into ``layout``'s buffer of the
    half format when given (its views reused from step to step). A group of mixed dtypes is stacked in the widest:
    that may flag an unedited weight, never miss an edited one, and :func:`edited_pairs` compares each weight exactly
    once a flag is up."""
    if layout is None:
        layout = FlatLayout(masters)
    groups = layout.groups
    with torch.no_grad():  # the weights' stack needs no autograd record
        halves = [torch.stack([params[i] for i in idx]).reshape(-1) for idx in groups]
        dtype = halves[0].dtype
        if any(h.dtype != dtype for h in halves):  # a weight's data replaced by another format: the widest
            dtype = functools.reduce(torch.promote_types, [h.dtype for h in halves])
            halves = [h.to(dtype) for h in halves]
        # not the step's gradient buffer, which the caller holds now: a purpose of its own
        flat, views = layout.views(dtype, masters[0].device, "rounded masters")
        _compat.foreach_copy_(views, masters)
        # one comparison per shape: concatenating the stacks would hold 4 more bytes per parameter at the step's peak
        same = all(_bits_equal(h, flat[o : o + h.numel()]) for h, o in zip(halves, layout.offsets))
    del flat, views  # dead now: their memory goes back
    layout.release("rounded masters")
    return torch.tensor(not same)


def edit_flags_of(pairs: list[tuple[Tensor, Tensor]]) -> list[float]:
    """:func:`edit_flags` of ``(half weight, master)`` pairs, read on the host (one sync)."""
    if not pairs:
        return []
    with torch.no_grad():
        flags = edit_flags([p for p, _ in pairs], [m for _, m in pairs])
    return list(flags.tolist())


def edited_pairs(pairs: list[tuple[Tensor, Tensor]], flags: list[float]) -> list[tuple[Tensor, Tensor]]:
    """The ``(half weight, master)`` pairs that ``flags`` (host values of :func:`edit_flags`) mark as edited. Fewer
    flags than pairs (CPU flags a range of pairs at once) say only that one was: each is compared then, which is
    rare."""
    if len(flags) != len(pairs):  # a flag per range of pairs (CPU compares each range at once): one was edited
        if not any(flags):
            return []
        flags = [float(bits_differ(m.to(p.dtype), p)) for p, m in pairs]
    return [pair for pair, f in zip(pairs, flags) if f]


def copy_into_masters(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """Adopt the edits: each master takes its half weight's value."""
    if pairs:
        with torch.no_grad():
            _compat.foreach_copy_([m for _, m in pairs], [p for p, _ in pairs])


def _bits_equal(a: Tensor, b: Tensor) -> bool:
    """Whether two flat half tensors on the CPU hold the same bits (:func:`bits_differ` read at once: the CPU needs no
    sync, and ``torch.equal`` stops at the first difference)."""
    word = _word(a, b)
    return torch.equal(a.view(word), b.view(word))


def _word(a: Tensor, b: Tensor) -> torch.dtype:
    """The integer type to compare two flat half tensors in: int64 words of four values where the layout allows."""
    aligned = a.numel() % 4 == 0 and a.storage_offset() % 4 == 0 and b.storage_offset() % 4 == 0
    return torch.int64 if aligned else torch.int16


def bits_differ(a: Tensor, b: Tensor) -> Tensor:
    """Whether two half tensors of one shape differ in any bit (0-dim, on their device), compared as integers: as
    int64 words of four values where the layout allows, else value by value as int16."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    word = _word(a, b)
    return torch.ne(a.view(word), b.view(word)).any()


class FlatEdits:
    """The edit check of fp32 masters whose weights lie flat (:class:`HalfWeights`): the masters are rounded into a
    scratch of the weights' format a chunk at a time and compared with the weights' slice at once, the scratch's memory
    given back after. On a CPU an equal slice needs nothing more; otherwise a flag per weight comes from one reduction
    per run of equal-sized weights, on the device (no host sync).

    Args:
        halves: the flat weights.

    Example:
        ```python
        from lightning_mpt.core.masters._halves import HalfWeights

        masters = [torch.randn(3, 4), torch.randn(4)]
        params = [torch.nn.Parameter(m.half()) for m in masters]
        halves = HalfWeights(params, chunk=2**24)
        check = FlatEdits(halves)
        master_of = dict(zip(params, masters))
        aligned = [master_of[p] for p in halves.params]  # the layout's order
        assert check.flags(aligned) is None  # nothing edited (a CPU knows it without a flag per weight)
        params[0].data.clamp_(-0.1, 0.1)  # invisible to autograd's version counter
        assert check.flags(aligned).tolist() == [p is params[0] for p in halves.params]
        ```
    """

    def __init__(self, halves: HalfWeights) -> None:
        self.halves = halves
        layout = halves.layout
        self.scratch = torch.empty(max(c.numel for c in layout.chunks), dtype=halves.dtype, device=halves.device)
        self.views = [layout.views(self.scratch, c) for c in layout.chunks]
        self._nbytes = self.scratch.untyped_storage().nbytes()
        self.scratch.untyped_storage().resize_(0)

    def flags(self, masters: list[Tensor]) -> Optional[Tensor]:
        """Whether each weight (in the layout's order) differs from its master (``masters``, aligned with it) rounded;
        ``None`` on a CPU when none does."""
        halves, layout = self.halves, self.halves.layout
        cpu = halves.device.type == "cpu"
        storage = self.scratch.untyped_storage()
        storage.resize_(self._nbytes)
        parts: list[Tensor] = []
        differ = False
        try:
            with torch.no_grad():
                for chunk, views in zip(layout.chunks, self.views):
                    _compat.foreach_copy_(views, masters[chunk.first : chunk.stop])
                    weights = halves.flat[chunk.offset : chunk.offset + chunk.numel].view(torch.int16)
                    rounded = self.scratch[: chunk.numel].view(torch.int16)
                    if cpu and torch.equal(weights, rounded):  # the usual case: one comparison, stopped at a difference
                        parts.append(torch.zeros(chunk.stop - chunk.first, dtype=torch.bool))
                        continue
                    differ = True
                    unequal = weights != rounded
                    parts.extend(layout.rows(unequal, run, chunk).any(1) for run in chunk.runs)
        finally:
            storage.resize_(0)
        if cpu and not differ:
            return None
        return torch.cat(parts)


class WeightEdits:
    """The edit check of every master's half weight: the weights laid flat per device (:class:`HalfWeights`) at the
    first check, and again once the masters change or user code gave a weight other data (which is then compared as
    it is). A weight that cannot lie flat (its data of another format now) is compared on its own.

    Args:
        masters: parameter -> fp32 master, the owner's own dict (:meth:`invalidate` after a change).
        dtype: the half format of the weights.
        chunk: elements rounded into the scratch at a time.

    Example:
        ```python
        w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
        edits = WeightEdits({w: torch.ones(4)}, torch.float16)
        assert edits.flags([w]) is None
        w.data[0] = 2.0
        assert edits.flags([w]).tolist() == [True]
        ```
    """

    def __init__(self, masters: dict[Tensor, Tensor], dtype: torch.dtype, chunk: int = 2**24) -> None:
        self.masters = masters
        self.dtype = dtype
        self.chunk = chunk
        self._flat: Optional[list[tuple[HalfWeights, FlatEdits, list[Tensor]]]] = None
        self._where: dict[Tensor, int] = {}  # parameter -> its place in the flat weights, one device after another
        self._positions: dict[tuple[int, ...], tuple[Tensor, list[int]]] = {}

    def invalidate(self) -> None:
        """The masters changed: the weights are laid flat again at the next check."""
        self._flat = None
        self._positions.clear()

    def flat(self) -> list[tuple[HalfWeights, FlatEdits, list[Tensor]]]:
        """``(weights, their check, their masters in the layout's order)`` per device, laid out when first needed."""
        if self._flat is None:
            by_device: dict[torch.device, list[Tensor]] = {}
            for p, m in self.masters.items():
                if p.dtype == self.dtype and p.shape == m.shape and p.device == m.device:
                    by_device.setdefault(p.device, []).append(p)
            self._flat, self._where = [], {}
            for params in by_device.values():
                halves = HalfWeights(params, self.chunk)
                base = len(self._where)
                self._where.update((p, base + i) for i, p in enumerate(halves.params))
                self._flat.append((halves, FlatEdits(halves), [self.masters[p] for p in halves.params]))
        return self._flat

    def flags(self, params: list[Tensor]) -> Optional[Tensor]:
        """Whether the half weight of each of ``params`` (each with a master) differs from its master rounded, on the
        device; ``None`` when none does and a CPU knows it without a flag per weight."""
        if any(halves.moved() for halves, _, _ in self.flat()):  # data replaced since it was laid flat
            self.invalidate()
        flat = self.flat()
        key = tuple(map(id, params))
        positions = self._positions.get(key)
        if positions is None:
            n = len(self._where)
            loose = [i for i, p in enumerate(params) if p not in self._where]
            at = [self._where[p] if p in self._where else n + loose.index(i) for i, p in enumerate(params)]
            device = flat[0][0].device if flat else params[0].device
            positions = self._positions[key] = (torch.tensor(at, dtype=torch.long, device=device), loose)
        index, loose = positions
        parts = [edits.flags(masters) for _, edits, masters in flat]
        if not loose and all(part is None for part in parts):
            return None
        device = index.device
        every = [
            (torch.zeros(len(halves.params), dtype=torch.bool) if part is None else part).to(device)
            for (halves, _, _), part in zip(flat, parts)
        ]
        every += [bits_differ(self.masters[params[i]].to(params[i].dtype), params[i]).to(device) for i in loose]
        return torch.cat([t.reshape(-1) for t in every])[index]
