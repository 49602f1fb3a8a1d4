"""bf16 masters stored in 16 bits: each fp32 master is its bf16 weight plus a signed 16-bit remainder.

An fp32 number's top 16 bits are a bf16 number. :func:`split` rounds an fp32 master to bf16 with ties away from zero
(in the bit pattern: the low half ``>= 0x8000`` carries into the top half) and keeps ``low - 0x10000 * carry``, which
lies in ``[-0x8000, 0x7FFF]``: an ``int16``. :func:`join` undoes it exactly, bit for bit. Torch's cast rounds ties to
even instead, and no 16-bit storage can be exact with that rounding: a bf16 value whose last bit is 0 is the rounding
of 65,537 fp32 values (both ties round to it). So the half weights differ from ``master.to(torch.bfloat16)`` exactly
when the master's low 16 bits are ``0x8000`` (one value in 65,536), by one bf16 step away from zero. Non-finite masters
stay non-finite, and so do their half weights: an infinity has no low bits to carry, and a NaN's pattern plus one is a
NaN, except for the two largest patterns, which are truncated (their NaN comes back with another payload).

:class:`RemainderMasters` keeps each master asleep between steps: the half weight plus its remainder, 4 bytes per
parameter instead of 6. A master is woken (rebuilt in fp32) for its step, a chunk at a time with the chunked step, and
put back to sleep after it. Anything that asks for a master between steps (``master_of``, diagnostics, weight
averaging) wakes it until the next forward. A half weight edited in place while its master sleeps (a clamp,
``nn.Embedding(max_norm=...)``) is noticed by a fingerprint of its bits (their sum and their sum of squares): the
master then takes the edited value exactly, as with fp32 copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mpt.core.masters import DEFAULT_KEEP_FP32, Gradients, params_of
from lightning_mpt.core.masters._edits import bits_differ, copy_into_masters
from lightning_mpt.core.masters._flat import FlatLayout
from lightning_mpt.core.masters.chunked import DEFAULT_CHUNK, ChunkedMasters, stepped_in_chunks

__all__ = ["RemainderMasters", "fingerprint", "join", "split"]


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
    half, rem, _ = _split(master)
    return half, rem


def _split(master: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`split`, and the bf16 patterns as int32 (sign-extended: what :func:`fingerprint` sums)."""
    bits = master.view(torch.int32)
    top = bits >> 16  # the truncated bf16 pattern, sign-extended
    low = bits & 0xFFFF
    carry = low >= 0x8000
    # a carry keeps an infinity or a NaN non-finite (an infinity has no low bits; a NaN's pattern plus one is a NaN),
    # except from the NaN patterns 0x7FFF and 0xFFFF, whose carry would wrap to a zero: those are truncated, and their
    # low half does not fit an int16 (the rebuilt value is another NaN)
    carry &= (top & 0x7FFF) != 0x7FFF
    top += carry
    low.sub_(carry.to(torch.int32), alpha=0x10000)  # now in [-0x8000, 0x7FFF] but for those NaNs
    return top.to(torch.int16).view(torch.bfloat16), low.to(torch.int16), top


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
    bits = out.view(torch.int32)  # (top << 16) + remainder: split subtracted the carry's 0x10000 from the low half
    bits.copy_(half.view(torch.int16))
    bits.bitwise_left_shift_(16)
    bits.add_(rem)
    return out


def fingerprint(half: Tensor) -> Tensor:
    """The sum and the sum of squares of the bit patterns of ``half`` (int64, on its device): what changes when an
    edit changes its values.

    Example:
        ```python
        w = torch.randn(8).to(torch.bfloat16)
        before = fingerprint(w)
        w.clamp_(-0.5, 0.5)
        assert not torch.equal(fingerprint(w), before)
        ```
    """
    return _fingerprint(half.detach().view(torch.int16).to(torch.int32))


def _fingerprint(patterns: Tensor) -> Tensor:
    """:func:`fingerprint` of int32 bf16 patterns (sign-extended), squared in place."""
    total = patterns.sum(dtype=torch.int64)
    return torch.stack([total, patterns.mul_(patterns).sum(dtype=torch.int64)])


class RemainderMasters(ChunkedMasters):
    """Exact fp32 masters of a bf16 model held as 16-bit remainders beside the weights between steps.

    Args:
        keep_fp32: module types whose parameters stay fp32.
        chunk: step torch's per-parameter optimizers about this many elements at a time (each chunk's masters are
            woken for its step only); ``None``: one whole step, every master of the optimizer awake during it.

    Example:
        ```python
        from torch import nn
        from lightning_mpt.core.engine import MixedPrecisionEngine

        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        engine = MixedPrecisionEngine(RemainderMasters(chunk=16))
        engine.convert(model)
        optimizer = torch.optim.AdamW(model.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.scale_loss(model(torch.randn(3, 4)).float().sum()).backward()
        engine.step(optimizer, engine.decide(optimizer))
        engine.restore()
        assert model[0].weight.dtype == torch.float32
        ```
    """

    def __init__(self, keep_fp32: tuple[type[nn.Module], ...] = DEFAULT_KEEP_FP32, chunk: Optional[int] = None) -> None:
        super().__init__(torch.bfloat16, keep_fp32, DEFAULT_CHUNK if chunk is None else chunk)
        self.chunked = chunk is not None
        self.rems: dict[Tensor, Tensor] = {}  # parameter -> remainder, for each master asleep
        self.prints: dict[Tensor, Tensor] = {}  # parameter -> fingerprint of its half weight when its master slept
        self._found: dict[Tensor, Tensor] = {}  # parameter -> whether its weight was edited while asleep (0-dim)
        self._reusable: set[int] = set()  # masters woken in our own storage, never handed out: freed in place
        self._woken_now: set[int] = set()  # ids of the parameters whose masters the prepare under way woke

    # ------------------------------------------------------------------ set-up
    def convert(self, module: nn.Module, restored: bool = False) -> nn.Module:
        super().convert(module, restored)
        self.write_back(list(self.masters), list(self.masters.values()))
        return module

    def restore(self) -> None:
        self.wake(list(self.masters))
        super().restore()
        self.rems.clear()
        self.prints.clear()
        self._found.clear()
        self._reusable.clear()

    def follow_devices(self) -> None:
        for p in list(self.rems):
            if self.rems[p].device != p.device:
                self.rems[p], self.prints[p] = self.rems[p].to(p.device), self.prints[p].to(p.device)
                self._replace(p)
                self.groups.invalidate()
        super().follow_devices()

    def broadcast(self, src: int = 0, refresh: bool = True) -> None:
        self.wake(list(self.masters))
        super().broadcast(src, refresh)
        # without ``refresh`` the half weights are rank ``src``'s already and a forward's graph may hold them: only
        # the remainders are split off
        self._sleep(list(self.masters), list(self.masters.values()), write_halves=refresh)

    # ------------------------------------------------------------------ sleep and wake
    def wake(self, params: list[Tensor]) -> None:
        """Rebuild the fp32 masters of ``params`` that sleep; a weight edited meanwhile becomes its master exactly."""
        asleep = [p for p in params if p in self.rems]
        if not asleep:
            return
        self._check(asleep)
        with torch.no_grad():
            for p in asleep:
                m = self.masters[p]
                m.untyped_storage().resize_(m.numel() * m.element_size())
                join(p, self.rems.pop(p), out=m)
                del self.prints[p]
                self._reusable.add(id(m))

    def write_back(self, params: list[Tensor], masters: list[Tensor]) -> None:
        """Put the masters of ``params`` to sleep: their half weights and remainders from them, their memory freed."""
        self._sleep(params, masters)

    def _sleep(self, params: list[Tensor], masters: list[Tensor], write_halves: bool = True) -> None:
        replaced = False
        with torch.no_grad():
            for p, m in zip(params, masters):
                if p in self.rems or self.masters.get(p) is not m:
                    continue
                half, self.rems[p], patterns = _split(m)
                if write_halves:
                    p.copy_(half)
                self.prints[p] = _fingerprint(patterns)
                self._found.pop(p, None)
                if id(m) in self._reusable:  # its gradient, if it keeps one, is a tensor of its own
                    self._reusable.discard(id(m))
                    m.untyped_storage().resize_(0)
                else:  # someone may hold it (it came from the module or was handed out): it keeps its memory
                    self._replace(p)
                    replaced = True
        if replaced:  # once, not per master: the plans are rebuilt from every master
            self.groups.invalidate()

    def _replace(self, p: Tensor) -> None:
        """Give ``p`` a new sleeping master: an fp32 tensor of its shape whose storage is empty until woken."""
        placeholder = torch.empty_like(p, dtype=torch.float32)
        placeholder.untyped_storage().resize_(0)
        self.masters[p] = placeholder  # the caller invalidates the groups' plans

    def release(self, drop: bool) -> None:
        """Before a forward or a backward: also put the masters woken since the step to sleep. A weight edited since
        (a clamp in ``on_train_batch_end``) becomes its master first, on the device, the whole tensor, as an edit made
        while the master sleeps and as with 4-byte masters (so reading a master, which wakes it, never changes the
        run); the half weights are then the masters' already and are not written (a forward's graph may hold them)."""
        super().release(drop)
        awake = [p for p in self.masters if p not in self.rems]
        with torch.no_grad():
            for p in awake:
                m = self.masters[p]
                edited = torch.ne(p.detach().view(torch.int16), split(m)[0].view(torch.int16)).any()
                m.copy_(torch.where(edited, p.detach().float(), m))
        self._sleep(awake, [self.masters[p] for p in awake], write_halves=False)

    def in_chunks(self, optimizer: Optimizer) -> bool:
        return self.chunked and stepped_in_chunks(optimizer, self._whole)

    # ------------------------------------------------------------------ the step
    def prepare(self, optimizer: Optimizer, scale: float, check_edits: bool = True) -> Gradients:
        # each step fingerprints the sleeping weights again: a skipped step's findings are stale once user code ran
        self._found.clear()
        if not self.in_chunks(optimizer):  # the whole step reads every master
            asleep = [p for p in params_of(optimizer) if p in self.rems]
            self.wake(asleep)
            self._woken_now = {id(p) for p in asleep}
        try:
            return super().prepare(optimizer, scale, check_edits)
        finally:
            self._woken_now = set()

    def edit_flags(self, params: list[Tensor], masters: list[Tensor], layout: Optional[FlatLayout] = None) -> Tensor:
        """Per weight of ``params``: edited since its master was last written (asleep: its fingerprint changed, and
        the master has taken the edit already; woken for this step and not handed out: the same, as the weight is
        its master's top half by construction; otherwise: it differs from its master rounded as :func:`split` does)."""
        self._check([p for p in params if p in self.rems])
        false = torch.zeros((), dtype=torch.bool, device=params[0].device)
        flags = []
        for p, m in zip(params, masters):
            if p in self.rems or self._fresh(p, m):
                flags.append(self._found.get(p, false))
            else:
                flags.append(bits_differ(split(m.detach())[0], p))
        return torch.stack(flags)

    def _fresh(self, p: Tensor, m: Tensor) -> bool:
        """Whether ``m`` was woken from ``p`` and its remainder by the :meth:`prepare` under way and never handed out:
        then ``p`` is ``m``'s top half (an edit made while it slept is in ``m`` already). A master left awake by a
        skipped step is compared with its weight again: user code may have edited the weight since."""
        return id(p) in self._woken_now and id(m) in self._reusable

    def _check(self, asleep: list[Tensor]) -> None:
        """Compare the fingerprints of sleeping masters' weights with those they slept with (no host sync); an edited
        weight's remainder is zeroed, so that its master wakes as the edited value."""
        for p in asleep:
            if p in self._found:
                continue
            now = fingerprint(p)
            edited = torch.ne(now, self.prints[p]).any()
            self.rems[p].masked_fill_(edited, 0)
            self.prints[p] = now
            self._found[p] = edited

    def absorb_edits(self, grads: Gradients, flags: list[float]) -> list[str]:
        """The names of the weights edited since the last step, their masters made equal to them."""
        return self._absorb(list(zip(grads.params, grads.masters)), flags)

    def absorb_all_edits(self) -> list[str]:
        pairs = list(self.masters.items())
        if not pairs:
            return []
        flags = self.edit_flags([p for p, _ in pairs], [m for _, m in pairs]).any().reshape(1).tolist()
        return self._absorb(pairs, flags)

    def _absorb(self, pairs: list[tuple[Tensor, Tensor]], flags: list[float]) -> list[str]:
        if not any(flags):
            return []
        names = [self.name_of(p) for p, edited in self._found.items() if bool(edited)]
        for p in self._found:  # reported once; the entry stays: the weight was checked since its master slept
            self._found[p] = torch.zeros((), dtype=torch.bool, device=p.device)
        awake = [(p, m) for p, m in pairs if p not in self.rems and bool(bits_differ(split(m.detach())[0], p))]
        copy_into_masters(awake)
        return names + [self.name_of(p) for p, _ in awake]

    # ------------------------------------------------------------------ reading and writing the masters
    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 master of ``param``, awake until the next forward (later steps may store it elsewhere)."""
        if param not in self.masters:
            return param
        self.wake([param])
        m = self.masters[param]
        self._reusable.discard(id(m))
        return m

    def named_masters(self) -> Iterator[tuple[str, Tensor, Tensor]]:
        for p in list(self.masters):
            yield self.name_of(p), p, self.master_of(p)

    def storage(self) -> list[Tensor]:
        """The remainders of the masters asleep and the masters awake."""
        return [self.rems.get(p, m) for p, m in self.masters.items()]

    def saved_master(self, param: Tensor) -> Optional[Tensor]:
        rem = self.rems.get(param)
        if rem is not None:
            return join(param.detach(), rem)
        return None if param not in self.masters else self.master_of(param)

    def load_master(self, param: Tensor, value: Tensor) -> Optional[Tensor]:
        master = value.detach().to(param.device, torch.float32)
        half, rem = split(master)
        if param in self.rems:
            self.rems[param], self.prints[param] = rem, fingerprint(half)
            self._found.pop(param, None)
        else:
            self.masters[param].copy_(master)
        return half

    def refresh(self) -> None:
        awake = [p for p in self.masters if p not in self.rems]
        self.write_halves(awake, [self.masters[p] for p in awake])

    def write_halves(self, params: list[Tensor], masters: list[Tensor]) -> None:
        with torch.no_grad():
            for p, m in zip(params, masters):
                if p not in self.rems:
                    p.copy_(split(m)[0])
