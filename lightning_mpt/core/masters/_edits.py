"""Noticing half weights that user code edited in place outside the optimizer step (a WGAN clamp,
``nn.Embedding(max_norm=...)``, a weight average copied in), so that the masters adopt the edits instead of the next
refresh undoing them. A half weight was edited when it differs from its master rounded to the half format.

Rounding every master at every step is a pass over the masters per tensor; so once that check has run, the
:func:`~lightning_mpt.core.masters._halves.fingerprints` of the weights as they should be (their masters rounded, three
sums each) are kept, updated where the step writes weights, and a later check compares the weights' fingerprints with
them: a few kernels over the flat weights, whatever the number of tensors. A weight whose fingerprint differs is
marked, and compared exactly before its master takes it (:meth:`WeightEdits.adopt`: one more host sync, only when one
is marked), so a weight written alike with its master (the master edited at full precision, then copied into it) is
not an edit. Writing masters any other way (loading a checkpoint) forgets the fingerprints: the next check rounds
every master again."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_mpt import _compat
from lightning_mpt.core.masters._flat import PerList
from lightning_mpt.core.masters._halves import Fingerprints, HalfWeights, run_words


def edited_pairs(pairs: list[tuple[Tensor, Tensor]], flags: list[float]) -> list[tuple[Tensor, Tensor]]:
    """The ``(half weight, master)`` pairs that ``flags`` (host values of :meth:`WeightEdits.flags`) mark as edited.
    Fewer flags than pairs say only that one was: each is compared then, which is rare."""
    if len(flags) != len(pairs):  # one flag for several pairs: one was edited
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
    """Whether two flat int16 tensors on the CPU hold the same bits: as int64 words of four values where both start
    on a word (the CPU needs no sync, and ``torch.equal`` stops at the first difference)."""
    n = a.numel() // 4 * 4 if a.storage_offset() % 4 == 0 and b.storage_offset() % 4 == 0 else 0
    head = torch.equal(a[:n].view(torch.int64), b[:n].view(torch.int64)) if n else True
    return head and torch.equal(a[n:], b[n:])


def _comparison_dtype(a: Tensor, b: Tensor) -> torch.dtype:
    """The integer type to compare two flat half tensors in: int64 words of four values where the layout allows."""
    aligned = a.numel() % 4 == 0 and a.storage_offset() % 4 == 0 and b.storage_offset() % 4 == 0
    return torch.int64 if aligned else torch.int16


def bits_differ(a: Tensor, b: Tensor) -> Tensor:
    """Whether two half tensors of one shape differ in any bit (0-dim, on their device), compared as integers: as
    int64 words of four values where the layout allows, else value by value as int16."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    word = _comparison_dtype(a, b)
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
        assert check.flags(aligned)[0] is None  # nothing edited (a CPU knows it without a flag per weight)
        params[0].data.clamp_(-0.1, 0.1)  # invisible to autograd's version counter
        assert check.flags(aligned)[0].tolist() == [p is params[0] for p in halves.params]
        ```
    """

    def __init__(self, halves: HalfWeights) -> None:
        self.halves = halves
        layout = halves.layout
        self.scratch = torch.empty(max(c.numel for c in layout.chunks), dtype=halves.dtype, device=halves.device)
        self.views = [layout.views(self.scratch, c) for c in layout.chunks]
        self.prints = [
            Fingerprints(run_words(layout, self.scratch[: c.numel], c, alone=True), upper=True) for c in layout.chunks
        ]
        self._nbytes = self.scratch.untyped_storage().nbytes()
        self.scratch.untyped_storage().resize_(0)

    def flags(self, masters: list[Tensor]) -> tuple[Optional[Tensor], Tensor]:
        """Whether each weight (in the layout's order) differs from its master (``masters``, aligned with it) rounded,
        ``None`` on a CPU when none does; and the fingerprints of the masters rounded, ``(weights, 3)``."""
        halves, layout = self.halves, self.halves.layout
        cpu = halves.device.type == "cpu"
        storage = self.scratch.untyped_storage()
        storage.resize_(self._nbytes)
        parts: list[Tensor] = []
        prints: list[Tensor] = []
        differ = False
        try:
            with torch.no_grad():
                for chunk, views, prints_of in zip(layout.chunks, self.views, self.prints):
                    self.scratch[: chunk.numel].zero_()  # the unused ends of the slots, zero in the weights too
                    _compat.foreach_copy_(views, masters[chunk.first : chunk.stop])
                    prints.append(prints_of())
                    weights = halves.flat[chunk.offset : chunk.offset + chunk.numel].view(torch.int16)
                    rounded = self.scratch[: chunk.numel].view(torch.int16)
                    if cpu and _bits_equal(weights, rounded):  # the usual case: one comparison, stopped at a difference
                        parts.append(torch.zeros(chunk.stop - chunk.first, dtype=torch.bool))
                        continue
                    differ = True
                    unequal = weights != rounded
                    parts.extend(layout.rows(unequal, run, chunk).any(1) for run in chunk.runs)
        finally:
            storage.resize_(0)
        expected = torch.cat(prints)
        if cpu and not differ:
            return None, expected
        return torch.cat(parts), expected


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
        # per list of parameters: their places in the flat weights, and which are loose (see :meth:`_positions_of`)
        self._positions = PerList(self._positions_of, size=None)
        # the fingerprints the weights should have (their masters rounded), in the layout's order, while known; kept
        # for the weights of one device only (several devices: every check rounds the masters)
        self._expected: Optional[Tensor] = None

    def invalidate(self) -> None:
        """The masters changed: the weights are laid flat again at the next check."""
        self._flat = None
        self._positions.clear()
        self._expected = None

    def forget(self) -> None:
        """Masters were written other than by the step (a checkpoint loaded): the next check rounds them all."""
        self._expected = None

    def flat(self) -> list[tuple[HalfWeights, FlatEdits, list[Tensor]]]:
        """``(weights, their check, their masters in the layout's order)`` per device, laid out when first needed."""
        if self._flat is None:
            by_device: dict[torch.device, list[Tensor]] = {}
            for p, m in self.masters.items():
                if p.dtype == self.dtype and p.shape == m.shape and p.device == m.device:
                    by_device.setdefault(p.device, []).append(p)
            self._flat, self._where = [], {}
            # the first check may come inside a validation loop (a state_dict() there): the weights' new buffer
            # outlives it, and an inference tensor could never be trained
            with torch.inference_mode(False):
                for params in by_device.values():
                    halves = HalfWeights(params, self.chunk)
                    base = len(self._where)
                    self._where.update((p, base + i) for i, p in enumerate(halves.params))
                    self._flat.append((halves, FlatEdits(halves), [self.masters[p] for p in halves.params]))
        return self._flat

    def _positions_of(self, params: list[Tensor]) -> tuple[Tensor, list[int]]:
        """``params``' places in the flat weights (on their device; a loose one counts after them), and the indices
        into ``params`` of the loose ones, those not laid flat (made once per list: :attr:`_positions`)."""
        flat = self.flat()
        n = len(self._where)
        loose = [i for i, p in enumerate(params) if p not in self._where]
        at = [self._where[p] if p in self._where else n + loose.index(i) for i, p in enumerate(params)]
        device = flat[0][0].device if flat else params[0].device
        return torch.tensor(at, dtype=torch.long, device=device), loose

    def flags(self, params: list[Tensor]) -> Optional[Tensor]:
        """Whether the half weight of each of ``params`` (each with a master) differs from its master rounded, on the
        device; ``None`` when none does and a CPU knows it without a flag per weight."""
        # loops, not comprehensions: this runs every step
        for halves, _, _ in self.flat():
            if halves.moved():  # data replaced since it was laid flat
                self.invalidate()
                break
        flat = self.flat()
        index, loose = self._positions.get(params)
        expected = self._expected
        if expected is not None and not loose:  # one device: its fingerprints against the expected ones
            halves = flat[0][0]
            now = halves.fingerprints(upper=True)
            if halves.device.type == "cpu" and torch.equal(now, expected):  # the usual case (a GPU would sync)
                return None
            return (now != expected).any(1)[index]  # marked, confirmed by :meth:`adopt`
        parts = []
        edited = bool(loose)
        for _, edits, masters in flat:
            part, expected = edits.flags(masters)
            parts.append(part)
            edited = edited or part is not None
        self._expected = expected if len(flat) == 1 else None
        if not edited:
            return None
        device = index.device
        every = [
            (torch.zeros(len(halves.params), dtype=torch.bool) if part is None else part).to(device)
            for (halves, _, _), part in zip(flat, parts)
        ]
        every += [bits_differ(self.masters[params[i]].to(params[i].dtype), params[i]).to(device) for i in loose]
        return torch.cat([t.reshape(-1) for t in every])[index]

    def adopt(self, pairs: list[tuple[Tensor, Tensor]], flags: list[float]) -> list[tuple[Tensor, Tensor]]:
        """Copy into the masters the half weights of the ``(half weight, master)`` pairs that ``flags`` (host values of
        :meth:`flags` for their weights) mark and that differ from their masters rounded; return those pairs. A marked
        weight holds its master rounded then, which its fingerprint is expected to show from now on.

        A fingerprint also changes where code wrote a weight and its master alike (the master edited at full precision,
        then copied into the weight): one comparison per marked weight, read in one host sync, only when some are
        marked, keeps such a master from being rounded."""
        marked = edited_pairs(pairs, flags)
        if not marked:
            return []
        device = marked[0][0].device
        with torch.no_grad():
            differ = torch.stack([bits_differ(m.to(p.dtype), p).to(device) for p, m in marked]).tolist()
        edited = [pair for pair, d in zip(marked, differ) if d]
        copy_into_masters(edited)
        self.settled([p for p, _ in marked])
        return edited

    def settled(self, params: list[Tensor]) -> None:
        """The half weights of ``params`` hold their masters rounded now (written from them, or taken by them): their
        fingerprints now are those expected of them."""
        expected = self._expected
        if expected is None or self._flat is None or not params:
            return
        index, loose = self._positions.get(params)
        if loose:  # not laid flat any more (its data replaced): the next check rounds every master
            self._expected = None
            return
        now = self._flat[0][0].fingerprints(upper=True)
        if len(params) == len(expected):  # every weight (each one once)
            self._expected = now
        else:
            expected[index] = now[index]
