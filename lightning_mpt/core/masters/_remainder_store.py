"""The bit-level form of 16-bit masters: :func:`split` and :func:`join` (an fp32 master as its bf16 weight plus a signed
16-bit remainder, exactly), :func:`fingerprint`, and :class:`RemainderStore`, the weights and remainders of a module
laid flat alike (:class:`~lightning_mpt.core.masters._halves.HalfWeights`), whose chunks wake into fp32 masters for
their step. See :mod:`lightning_mpt.core.masters.remainders` for why the rounding is ties away from zero."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_mpt import _compat
from lightning_mpt.core.masters._halves import HalfWeights, fingerprints, slot


def split(master: Tensor) -> tuple[Tensor, Tensor]:
    """The bf16 weight (ties rounded away from zero) and the int16 remainder that :func:`join` makes ``master`` from.

    Args:
        master: an fp32 tensor.

    Example:
        ```python
        tie = torch.tensor([1.0 + 2.0**-8])  # halfway between the bf16 values 1 and 1 + 2**-7
        half, rem = split(tie)
        assert half.item() == 1.0 + 2.0**-7 and tie.to(torch.bfloat16).item() == 1.0  # torch: to even
        assert torch.equal(join(half, rem), tie)
        ```
    """
    master = master.contiguous()
    half = torch.empty_like(master, dtype=torch.bfloat16)
    rem = torch.empty_like(master, dtype=torch.int16)
    _split_into(master, half.view(-1).view(torch.int16), rem.view(-1))
    return half, rem


def join(half: Tensor, rem: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """The fp32 tensor that :func:`split` made ``half`` and ``rem`` from, bit for bit (into ``out`` if given).

    Args:
        half: bf16 weights.
        rem: their int16 remainders.
        out: an fp32 tensor of the same shape to write into.

    Example:
        ```python
        master = torch.randn(1000)
        assert torch.equal(join(*split(master)), master)
        ```
    """
    if out is None:
        out = torch.empty_like(half, dtype=torch.float32)
    out.copy_(half)  # a bf16 value in fp32 is its pattern shifted: (top << 16), exactly
    out.view(torch.int32).add_(rem)  # + remainder: split subtracted the carry's 0x10000 from the low half
    return out


def fingerprint(half: Tensor) -> Tensor:
    """The :func:`~lightning_mpt.core.masters._halves.fingerprints` of one tensor of 2-byte values (``(2,)`` int64,
    on its device): its bits read as 8-byte words in memory order, the last word filled with zeros, as its slot in a
    flat buffer holds them.

    Example:
        ```python
        w = torch.randn(8).to(torch.bfloat16)
        before = fingerprint(w)
        w.clamp_(-0.5, 0.5)
        assert not torch.equal(fingerprint(w), before)
        ```
    """
    bits = half.detach().as_strided((half.numel(),), (1,)).view(torch.int16)  # memory order (a dense tensor)
    words = torch.nn.functional.pad(bits, (0, slot(bits.numel()) - bits.numel())).view(torch.int64)
    return fingerprints([words.view(1, -1)])[0]


def _split_into(master: Tensor, half: Optional[Tensor], rem: Tensor) -> None:
    """:func:`split` of ``master`` (contiguous) into ``half`` (an int16 view of bf16; ``None``: the remainders alone,
    one pass) and ``rem``, in four passes.

    The remainder is the master's low 16 bits read as a signed int16, and the weight its top 16 bits plus one where
    that is negative (the low half ``>= 0x8000``): the bit pattern rounded with ties away from zero, the remainder in
    ``[-0x8000, 0x7FFF]``. torch's conversion to bf16 rounds the same way except at a tie (the low half ``0x8000``),
    which it rounds to the even neighbour: where the top half is even, the tie's weight gets its missing one. A
    non-finite master keeps a non-finite weight and rebuilds as one (a NaN as a NaN, perhaps of another payload)."""
    words = master.view(-1).view(torch.int16).view(-1, 2)  # little-endian: (low half, top half) of each master
    top = words[:, 1]
    rem.copy_(words[:, 0])
    if half is None:
        return
    half.view(torch.bfloat16).copy_(master.view(-1))
    if rem.device.type == "cpu" and rem.numel() >= _TIE_BLOCK * 32:
        # ties are rare (one value in 65,536): fixed where they are, found by a fast minimum per block
        at = _ties(rem)
        half[at] |= torch.bitwise_not(top[at]).bitwise_and_(1)
        return
    missing = torch.bitwise_not(top).bitwise_and_(1)  # 1 where the top half is even
    missing.mul_(rem == -0x8000)  # ... at a tie
    half.bitwise_or_(missing)


_TIE_BLOCK = 512  # remainders per block whose minimum says whether it holds a tie


def _ties(rem: Tensor) -> Tensor:
    """The positions in ``rem`` (int16, on a CPU) of the ties, ``-0x8000``: the smallest int16, so a block holds one
    where its minimum is one, and only those blocks are searched (a comparison per value is slower than a minimum)."""
    n = rem.numel() - rem.numel() % _TIE_BLOCK
    blocks = rem[:n].view(-1, _TIE_BLOCK)
    hit = torch.nonzero(blocks.amin(1) == -0x8000).squeeze(1)
    inside = torch.nonzero(blocks[hit] == -0x8000)
    tail = torch.nonzero(rem[n:] == -0x8000).squeeze(1) + n
    return torch.cat((hit[inside[:, 0]] * _TIE_BLOCK + inside[:, 1], tail))


class RemainderStore:
    """The bf16 weights of parameters on one device and the 16-bit remainders of their fp32 masters, laid flat alike,
    with a fingerprint of each weight; a chunk's fp32 masters hold values only while it is awake (:meth:`wake`).
    Their memory is given back at the sleep, unless a reader still holds a tensor made from a master (an alias, a
    view): the chunk then gets new memory, and the reader keeps the old with the values it saw.

    The masters are views of one fp32 buffer per chunk whose memory is given back while the chunk sleeps: the same
    tensor objects from step to step, so the optimizer's state and the plans keyed by them stay valid.

    Args:
        params: bf16 parameters on one device.
        values: their fp32 masters, aligned with ``params``.
        chunk: about how many elements each chunk holds.

    Example:
        ```python
        params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(2)]
        values = [torch.randn(3), torch.randn(3)]
        store = RemainderStore(params, values, chunk=2**24)
        assert torch.equal(store.value(params[0]), values[0])  # exact, while the chunk sleeps
        store.wake(0)
        assert torch.equal(store.masters[store.position(params[1])], values[1])
        store.sleep(0)
        ```
    """

    def __init__(self, params: Sequence[Tensor], values: Sequence[Tensor], chunk: int) -> None:
        self.halves = HalfWeights(params, chunk)
        self.layout = layout = self.halves.layout
        device = self.halves.device
        self.rem = torch.zeros(layout.numel, dtype=torch.int16, device=device)
        self.rems = layout.views(self.rem)  # each master's remainder, in the layout's order
        self._buffers = [torch.empty(c.numel, dtype=torch.float32, device=device) for c in layout.chunks]
        self._nbytes = [b.untyped_storage().nbytes() for b in self._buffers]
        self.masters = [m for b, c in zip(self._buffers, layout.chunks) for m in layout.views(b, c)]
        self.prints: list[Tensor] = []  # per chunk: each weight's fingerprint when its master last slept
        self.awake: set[int] = set()  # chunks whose masters hold values
        value_of = dict(zip(params, values))
        # each chunk's memory is referenced by its buffer and its masters' views; more means a reader holds one
        self._refs = [_compat.storage_holders(b) for b in self._buffers]
        for k, c in enumerate(layout.chunks):
            self._buffers[k].untyped_storage().resize_(self._nbytes[k])
            self._buffers[k].zero_()  # the unused ends of the slots: zero weights and remainders
            with torch.no_grad():
                _compat.foreach_copy_(
                    self.masters[c.first : c.stop], [value_of[p] for p in layout.tensors[c.first : c.stop]]
                )
            self.prints.append(torch.empty(0))
            self.awake.add(k)
            self.sleep(k)

    @property
    def params(self) -> list[Tensor]:
        return self.layout.tensors

    def position(self, param: Tensor) -> int:
        return self.layout.position[param]

    def chunk_of(self, position: int) -> int:
        """The chunk that holds the parameter at ``position``."""
        for k, c in enumerate(self.layout.chunks):
            if position < c.stop:
                return k
        raise IndexError(position)

    def _slice(self, flat: Tensor, k: int) -> Tensor:
        c = self.layout.chunks[k]
        return flat[c.offset : c.offset + c.numel]

    # ------------------------------------------------------------------ sleep and wake
    def wake(self, k: int) -> None:
        """Rebuild chunk ``k``'s fp32 masters from its weights and remainders."""
        if k in self.awake:
            return
        self._buffers[k].untyped_storage().resize_(self._nbytes[k])
        with torch.no_grad():
            join(self._slice(self.halves.flat, k), self._slice(self.rem, k), out=self._buffers[k])
        self.awake.add(k)

    def sleep(self, k: int) -> None:
        """Put chunk ``k``'s masters back into its weights and remainders, fingerprint the weights, and give the
        masters' memory back."""
        if k not in self.awake:
            return
        with torch.no_grad():
            weights = self._slice(self.halves.flat, k).view(torch.int16)
            _split_into(self._buffers[k], weights, self._slice(self.rem, k))
            self.prints[k] = self._prints(k)
        self.free(k)

    def free(self, k: int) -> None:
        """Give chunk ``k``'s masters' memory back without writing them: nothing changed them since :meth:`wake`. A
        reader's tensor made from one of them (counted by :func:`~lightning_mpt._compat.storage_holders`) keeps that
        memory, valid, and the chunk's masters move to new memory."""
        if _compat.storage_holders(self._buffers[k]) > self._refs[k]:
            self._move(k)
        else:
            self._buffers[k].untyped_storage().resize_(0)
        self.awake.discard(k)

    def _move(self, k: int) -> None:
        """Point chunk ``k``'s buffer and masters at new, empty memory (the same tensor objects: the optimizer's state
        and plans keyed by them stay valid), leaving the old to whoever holds it."""
        chunk = self.layout.chunks[k]
        storage = torch.empty(chunk.numel, dtype=torch.float32, device=self._buffers[k].device).untyped_storage()
        with torch.no_grad():
            self._buffers[k].set_(storage, 0, (chunk.numel,), (1,))
            for i in range(chunk.first, chunk.stop):
                shape, stride = self.layout.shape_of(i)
                self.masters[i].set_(storage, self.layout.offsets[i] - chunk.offset, shape, stride)
        storage.resize_(0)  # never written: nothing was touched

    # ------------------------------------------------------------------ edits
    def _prints(self, k: int) -> Tensor:
        """The :func:`fingerprint` of each weight of chunk ``k``, ``(weights, 2)``."""
        return self.halves.fingerprints(k)

    def check(self) -> Tensor:
        """Which weights (in the layout's order) user code edited since their masters last slept, on the device: an
        edited weight's remainder is zeroed, so its master is the edited value exactly, and it is fingerprinted anew."""
        flags = []
        for k, chunk in enumerate(self.layout.chunks):
            edited = self.check_chunk(k)
            flags.append(torch.zeros(chunk.stop - chunk.first, dtype=torch.bool) if edited is None else edited)
        return torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool)

    def check_chunk(self, k: int) -> Optional[Tensor]:
        """:meth:`check` of chunk ``k``'s weights (asleep): their flags, on the device; ``None`` on a CPU when none was
        edited."""
        chunk = self.layout.chunks[k]
        with torch.no_grad():
            now = self._prints(k)
            edited = torch.ne(now, self.prints[k]).any(1)
            if edited.device.type == "cpu" and not bool(edited.any()):  # a CPU reads it for free: the prints hold
                return None
            rem = self._slice(self.rem, k)
            for run in chunk.runs:
                at = run.first - chunk.first
                self.layout.rows(rem, run, chunk).masked_fill_(edited[at : at + run.count, None], 0)
            self.prints[k] = now
        return edited

    def check_one(self, position: int) -> Tensor:
        """:meth:`check` of the weight at ``position`` alone (0-dim flag, on the device)."""
        k = self.chunk_of(position)
        row = position - self.layout.chunks[k].first
        with torch.no_grad():
            now = fingerprint(self.params[position])
            edited = torch.ne(now, self.prints[k][row]).any()
            self.rems[position].masked_fill_(edited, 0)
            self.prints[k][row] = now
        return edited

    def fingerprint_all(self) -> None:
        """Fingerprint every weight anew (the weights were written on purpose, e.g. made equal across processes)."""
        with torch.no_grad():
            self.prints = [self._prints(k) for k in range(len(self.layout.chunks))]

    def reprint(self, position: int) -> None:
        """Fingerprint the weight at ``position`` anew (its weight was written on purpose)."""
        k = self.chunk_of(position)
        row = position - self.layout.chunks[k].first
        self.prints[k][row] = fingerprint(self.params[position])

    # ------------------------------------------------------------------ one master
    def value(self, param: Tensor) -> Tensor:
        """``param``'s fp32 master, in a tensor of its own."""
        i = self.position(param)
        if self.chunk_of(i) in self.awake:
            return self.masters[i].detach().clone()
        with torch.no_grad():
            return join(param.detach(), self.rems[i])

    def load(self, param: Tensor, master: Tensor) -> Tensor:
        """Make ``master`` (fp32) ``param``'s master: its weight and remainder written, fingerprinted; returns the
        weight."""
        i = self.position(param)
        half, rem = split(master)
        with torch.no_grad():
            param.detach().copy_(half)
            self.rems[i].copy_(rem)
            if self.chunk_of(i) in self.awake:
                self.masters[i].copy_(master)
        self.reprint(i)
        return half
