"""bf16 masters stored in 16 bits: each fp32 master is its bf16 weight plus a signed 16-bit remainder.

An fp32 number's top 16 bits are a bf16 number. :func:`split` rounds an fp32 master to bf16 with ties away from zero
(in the bit pattern: the low half ``>= 0x8000`` carries into the top half) and keeps ``low - 0x10000 * carry``, which
lies in ``[-0x8000, 0x7FFF]``: an ``int16``. :func:`join` undoes it exactly, bit for bit. Torch's cast rounds ties to
even instead, and no 16-bit storage can be exact with that rounding: a bf16 value whose last bit is 0 is the rounding
of 65,537 fp32 values (both ties round to it). So the half weights differ from ``master.to(torch.bfloat16)`` exactly
when the master's low 16 bits are ``0x8000`` under an even top half (one value in 131,072), by one bf16 step away
from zero. Non-finite masters stay non-finite, and so do their half weights (a NaN may come back with another
payload).

:class:`RemainderMasters` keeps each master asleep between steps: the half weight plus its remainder, 4 bytes per
parameter instead of 6. A master is woken (rebuilt in fp32) for its step, a chunk at a time with the chunked step, and
put back to sleep after it. Anything that asks for a master between steps (``master_of``, diagnostics, weight
averaging) wakes it until the next forward. A half weight edited in place while its master sleeps (a clamp,
``nn.Embedding(max_norm=...)``, a permutation of hidden units) is noticed by a fingerprint of its bits
(:func:`fingerprint`: the sum of its 8-byte words, which no edit of one value leaves unchanged, and their sum weighted
by place, which a permutation changes): the master then takes the edited value exactly, as with fp32 copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mpt.core.masters import DEFAULT_KEEP_FP32, Gradients, distributed, params_of
from lightning_mpt.core.masters._remainder_edits import RemainderEdits, adopt_whole_edit
from lightning_mpt.core.masters._remainder_store import RemainderStore, fingerprint, join, split
from lightning_mpt.core.masters.chunked import DEFAULT_CHUNK, ChunkedStep
from lightning_mpt.core.masters.copies import CopyMasters

__all__ = ["RemainderMasters", "fingerprint", "join", "split"]


class RemainderMasters(CopyMasters):
    """Exact fp32 masters of a bf16 model held as 16-bit remainders beside the weights between steps.

    The weights and the remainders lie flat, per device (:class:`~lightning_mpt.core.masters._remainder_store.
    RemainderStore`); a chunk of the layout is woken (its fp32 masters rebuilt) for its step and put back to sleep
    after it, a few kernels over its slice whatever the number of tensors.

    Args:
        keep_fp32: module types whose parameters stay fp32.
        chunk: step torch's per-parameter optimizers about this many elements at a time (each chunk's masters are
            woken for its step only), ``"auto"`` for :func:`~lightning_mpt.core.masters.chunked.auto_chunk` of the
            model; ``None``: one whole step, every master of the optimizer awake during it.

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

    def __init__(
        self,
        keep_fp32: tuple[type[nn.Module], ...] = DEFAULT_KEEP_FP32,
        chunk: Union[int, Literal["auto"], None] = None,
    ) -> None:
        super().__init__(torch.bfloat16, keep_fp32, enabled=True, chunk=chunk)
        self.stores: list[RemainderStore] = []
        self._where: dict[Tensor, RemainderStore] = {}  # parameter -> the store that holds its master
        self._chunk: dict[Tensor, tuple[int, int]] = {}  # parameter -> (its store's index, its chunk's index)
        self.held: dict[Tensor, Tensor] = {}  # parameter -> its master woken for a reader, until the next forward
        self._stale = False  # masters were added (as fp32 tensors of their own) since the stores were laid out
        self.found = RemainderEdits(self)  # the edits found and adopted, until the decision reads them

    # ------------------------------------------------------------------ set-up
    def convert(self, module: nn.Module, restored: bool = False) -> nn.Module:
        super().convert(module, restored)
        self._lay_out()
        return module

    @property
    def layout_chunk(self) -> int:
        """Elements per chunk of the layout: the chunked step's chunk, else :data:`DEFAULT_CHUNK` (a whole step wakes
        every chunk)."""
        return self.stepper.chunk if isinstance(self.stepper, ChunkedStep) else DEFAULT_CHUNK

    def add_master(self, param: Tensor, master: Tensor) -> None:
        super().add_master(param, master)
        self._stale = True

    def _value(self, p: Tensor) -> Tensor:
        """``p``'s master in a tensor of its own; a weight whose data user code replaced on its device is an edit."""
        held = self.held.get(p)
        if held is not None:
            return held
        store = self._where.get(p)
        if store is None:
            return self.masters[p]
        i = store.position(p)
        if store.halves.attached(i):
            if store.chunk_of(i) not in store.awake:  # an edit of its weight since it slept is its master now
                self.found.notice([p], store.check_one(i).reshape(1))
            return store.value(p)
        if p.device == store.halves.device:  # data replaced: the edited value, exactly, as an fp32 copy takes it
            return p.detach().float()
        with torch.no_grad():  # the module moved: the master from where its weight was
            return join(store.halves.view(i), store.rems[i]).to(p.device)

    # it may run inside a validation loop (a state_dict() there): the buffers outlive it, and an inference tensor
    # could never be trained
    @torch.inference_mode(False)
    def _lay_out(self) -> None:
        """Lay the weights and remainders out flat, per device, from the masters' values (also after masters were
        added, or weights moved or given other data)."""
        values = {p: self._value(p) for p in self.masters}
        self.stores, self._where, self._chunk = [], {}, {}
        by_device: dict[torch.device, list[Tensor]] = {}
        for p in values:
            if p.dtype == torch.bfloat16 and p.shape == values[p].shape:
                by_device.setdefault(p.device, []).append(p)
            else:  # its data is of another format now: its master stays a tensor of its own
                self.masters[p] = values[p]
        for params in by_device.values():
            store = RemainderStore(params, [values[p].to(p.device) for p in params], self.layout_chunk)
            for i, (p, m) in enumerate(zip(store.params, store.masters)):
                self.masters[p] = m
                self._where[p] = store
                self._chunk[p] = (len(self.stores), store.chunk_of(i))
            self.stores.append(store)
        self.held = {p: values[p] for p in self.held if p in values}  # the same tensors: readers may hold them
        self._stale = False
        self.groups.invalidate()
        self.edits.invalidate()

    def _ensure_layout(self) -> None:
        if self._stale or any(store.halves.moved() for store in self.stores):
            self._sleep_all()
            self._lay_out()

    def restore(self) -> None:
        self._sleep_all()
        self.absorb_all_edits()
        for p in list(self.masters):
            self.masters[p] = self._value(p)
        self.stores, self._where, self._chunk, self.held = [], {}, {}, {}
        super().restore()

    def follow_devices(self) -> None:
        self._ensure_layout()
        super().follow_devices()

    def broadcast(self, src: int = 0, refresh: bool = True) -> None:
        if not distributed() or not self.masters:
            return
        self._ensure_layout()
        with torch.no_grad():
            for store in self.stores:
                # as bytes: gloo broadcasts neither int16 nor bf16, and the bits are what the ranks must share
                dist.broadcast(store.rem.view(torch.uint8), src=src)
                if refresh:  # else the weights are rank ``src``'s already and a forward's graph may hold them
                    dist.broadcast(store.halves.flat.view(torch.uint8), src=src)
                store.fingerprint_all()
            loose = [m for p, m in self.masters.items() if p not in self._where]
            for m in loose:
                dist.broadcast(m, src=src)
        if refresh:
            self.refresh()

    # ------------------------------------------------------------------ sleep and wake
    def _chunks_of(self, params: list[Tensor]) -> set[tuple[int, int]]:
        """``(store, chunk)`` indices of the chunks holding the masters of ``params``."""
        chunk = self._chunk
        return {chunk[p] for p in params if p in chunk}

    def wake(self, params: list[Tensor], check: bool = True) -> None:
        """Rebuild the fp32 masters of the chunks holding those of ``params``; a master woken for a reader (and
        maybe edited there) is taken as it is. ``check``: a weight edited since the step's decision (in
        ``on_before_optimizer_step``, after ``fabric.clip_gradients``) becomes its master first, exactly, as at the
        decision: its remainder belongs to the value before the edit, and joined with the edited weight would be
        another number (a NaN where the edit zeroed a weight whose remainder is negative)."""
        for s, k in sorted(self._chunks_of(params)):
            store = self.stores[s]
            if k in store.awake:
                continue
            if check:
                edited = store.check_chunk(k)
                if edited is not None:  # reported at the next decision
                    chunk = store.layout.chunks[k]
                    self.found.notice(store.params[chunk.first : chunk.stop], edited)
            store.wake(k)
            chunk = store.layout.chunks[k]
            for p in store.params[chunk.first : chunk.stop]:
                held = self.held.get(p)
                if held is not None:
                    store.masters[store.position(p)].copy_(held)

    def write_back(self, params: list[Tensor], masters: list[Tensor]) -> None:
        """Put the chunks holding the masters of ``params`` to sleep: their weights and remainders from them."""
        self._sleep(self._chunks_of(params))
        loose = [(p, m) for p, m in zip(params, masters) if p not in self._where]
        if loose:
            self.write_halves([p for p, _ in loose], [m for _, m in loose])

    def _sleep(self, chunks: set[tuple[int, int]]) -> None:
        for s, k in sorted(chunks):
            store = self.stores[s]
            if k not in store.awake:
                continue
            chunk = store.layout.chunks[k]
            for p in store.params[chunk.first : chunk.stop]:  # a reader's master follows the step
                held = self.held.get(p)
                if held is not None:
                    held.copy_(store.masters[store.position(p)])
            store.sleep(k)

    def _sleep_all(self) -> None:
        self._sleep({(s, k) for s, store in enumerate(self.stores) for k in store.awake})

    def release(self, drop: bool) -> None:
        """Before a forward or a backward: also put the masters woken for readers since the step to sleep. A weight
        edited since (a clamp in ``on_train_batch_end``) becomes its master first, on the device, the whole tensor, as
        an edit made while the master sleeps and as with 4-byte masters (so reading a master, which wakes it, never
        changes the run); the half weights are then the masters' already and are not written (a forward's graph may
        hold them)."""
        super().release(drop)
        self._sleep_all()
        if not self.held:
            return
        with torch.no_grad():
            for p, m in self.held.items():
                adopt_whole_edit(p, m)
                store = self._where.get(p)
                if store is not None:
                    store.rems[store.position(p)].copy_(split(m)[1])
                else:
                    self.masters[p] = m
        self.held = {}

    # ------------------------------------------------------------------ the step
    def prepare(self, optimizer: Optimizer, scale: float, check_edits: bool = True) -> Gradients:
        self._ensure_layout()
        self._sleep_all()  # a step taken again, or decided again: from the weights and remainders as they are
        chunked = self.in_chunks(optimizer)
        # a chunked step checks each chunk as it wakes it for its step, which also sees edits made after the decision
        # (in on_before_optimizer_step): here only the masters outside the stores, and the edits found since
        if check_edits:
            self.found.check(stores=not chunked)
        else:
            self.found.flags = None
        if not chunked:  # the whole step reads every master of the optimizer
            self.wake(params_of(optimizer), check=False)  # checked just now
        return super().prepare(optimizer, scale, check_edits)

    def check_edits(self, out: Gradients) -> None:
        if self.found.flags is not None:
            out.edited = self.found.flags.any().reshape(1)

    def outside_stores(self) -> list[tuple[Tensor, Tensor]]:
        """``(parameter, master)`` of the masters that are tensors of their own: outside the flat stores, or woken for
        readers (the woken tensor)."""
        held = self.held
        return [(p, held.get(p, m)) for p, m in self.masters.items() if p not in self._where or p in held]

    def absorb_edits(self, grads: Gradients, flags: list[float]) -> list[str]:
        """The names of the weights edited since the last step; their masters took the edits at the check."""
        return self.report_edits(self.found.take(flags))

    @torch.inference_mode(False)  # from a state_dict() inside a validation loop: the state it writes outlives it
    def absorb_all_edits(self) -> list[str]:
        self._ensure_layout()
        self._sleep_all()
        self.found.check()
        return self.absorb_edits(Gradients(), [1.0])

    def step_chunks(
        self, params: list[Tensor], masters: list[Tensor], chunk: int
    ) -> list[tuple[list[Tensor], list[Tensor]]]:
        """The chunks of the layout, each with the optimizer's parameters it holds; the rest in one chunk after."""
        chunks: dict[tuple[int, int], tuple[list[Tensor], list[Tensor]]] = {}
        where = self._chunk
        for p, m in zip(params, masters):
            in_chunk, their_masters = chunks.setdefault(where.get(p, (len(self.stores), 0)), ([], []))
            in_chunk.append(p)
            their_masters.append(m)
        return [chunks[key] for key in sorted(chunks)]

    def exit(self, optimizer: Optimizer, grads: Gradients, stepped: bool) -> None:
        super().exit(optimizer, grads, stepped)
        self._sleep_all()

    def discard(self, grads: Gradients, zero: bool = False) -> None:
        super().discard(grads, zero)
        self._sleep_all()

    # ------------------------------------------------------------------ reading and writing the masters
    @torch.inference_mode(False)  # a master woken inside a validation loop is stepped after it
    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 master of ``param``: while its chunk is awake (a step), the tensor the optimizer steps; else woken
        into a tensor of its own until the next forward, which a step meanwhile updates (later steps may store the
        master elsewhere)."""
        if param not in self.masters:
            return param
        store = self._where.get(param)
        if store is None:
            return self.masters[param]
        i = store.position(param)
        if store.chunk_of(i) in store.awake:  # the tensor being stepped (a reader keeping it keeps its memory)
            return store.masters[i]
        held = self.held.get(param)
        if held is None:
            held = self.held[param] = self._value(param)
        return held

    def named_masters(self) -> Iterator[tuple[str, Tensor, Tensor]]:
        for p in list(self.masters):
            yield self.name_of(p), p, self.master_of(p)

    def storage(self) -> list[Tensor]:
        """The remainders of the masters asleep and the masters awake."""
        out = []
        for p, m in self.masters.items():
            store = self._where.get(p)
            out.append(self.held.get(p, m) if store is None else self.held.get(p, store.rems[store.position(p)]))
        return out

    def saved_master(self, param: Tensor) -> Optional[Tensor]:
        """The master woken for readers (:meth:`master_of`): one tensor per parameter, so a tied weight's names share
        it in the state dict, as with 4-byte masters (``save_pretrained`` and ``torch.save`` save it once)."""
        return None if param not in self.masters else self.master_of(param)

    def load_master(self, param: Tensor, value: Tensor) -> Optional[Tensor]:
        master = value.detach().to(param.device, torch.float32)
        held = self.held.get(param)
        if held is not None:
            held.copy_(master)
        store = self._where.get(param)
        if store is not None:
            return store.load(param, master)
        self.masters[param].copy_(master)
        return split(master)[0]

    def refresh(self) -> None:
        awake = self.outside_stores()
        self.write_halves([p for p, _ in awake], [m for _, m in awake])

    def write_halves(self, params: list[Tensor], masters: list[Tensor]) -> None:
        with torch.no_grad():
            for p, m in zip(params, masters):
                half, rem = split(m)
                p.copy_(half)
                store = self._where.get(p)
                if store is not None:
                    i = store.position(p)
                    store.rems[i].copy_(rem)
                    store.reprint(i)
