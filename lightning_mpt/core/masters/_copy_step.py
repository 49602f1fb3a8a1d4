"""The gradients' way through a step with fp32 master copies: half and scaled after the backward, fp32 and unscaled
on the masters for the optimizer, released (or scaled again) before the next forward. :class:`WholeStep` is the step of
:class:`~lightning_mpt.core.masters.copies.CopyMasters` taken whole (the chunked step,
:class:`~lightning_mpt.core.masters.chunked.ChunkedStep`, extends it)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Generator
from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpt import _compat
from lightning_mpt.core.masters import Gradients, whole_step
from lightning_mpt.core.masters._groups import GroupPlan, GroupSwap
from lightning_mpt.core.masters._halves import ranges
from lightning_mpt.core.masters._shown import is_faithful_copy, kept_exactly, show_clipping, sync_shown
from lightning_mpt.core.masters._zeros import StandInZeros

if TYPE_CHECKING:
    from lightning_mpt.core.masters.copies import CopyMasters

_DTYPE, _GRAD = attrgetter("dtype"), attrgetter("grad")
_SPARSE = "MPTPrecision does not support sparse gradients; use dense embeddings (sparse=False)."

#: the most elements a chunk of ``chunked_step=True`` holds: 64 MiB of fp32 gradients at a time
DEFAULT_CHUNK = 2**24
#: the fewest: below it a chunk's fixed cost (an optimizer call, a few foreach launches) outweighs what it saves
MIN_CHUNK = 2**18


def auto_chunk(numel: int) -> int:
    """The elements per chunk of ``chunked_step=True`` for masters of ``numel`` elements in all: about a sixteenth of
    the model (the step's peak then holds a sixteenth of its fp32 gradients and woken masters), between
    :data:`MIN_CHUNK` and :data:`DEFAULT_CHUNK`.

    Example:
        ```python
        assert auto_chunk(16 * 10**6) == 10**6  # a sixteenth
        assert auto_chunk(10**9) == 2**24 and auto_chunk(3_450_000) == 2**18  # at most, at least
        ```
    """
    return max(MIN_CHUNK, min(DEFAULT_CHUNK, -(-numel // 16)))


class WholeStep:
    """The step of fp32 master copies taken whole: the verbs :meth:`prepare`, :meth:`enter`, :meth:`exit`,
    :meth:`steps`, :meth:`discard`, :meth:`rescale`, :meth:`release` and :meth:`accumulate_in_fp32` of
    :class:`~lightning_mpt.core.masters.Masters`, for the masters that own it, which store the masters and write the
    half weights (:meth:`CopyMasters.write_back <lightning_mpt.core.masters.copies.CopyMasters.write_back>`).

    Args:
        owner: the masters this step belongs to (their ``masters``, ``groups``, ``add_master``, ``check_edits``,
            ``write_back``, ``enter`` and ``exit``).

    Example:
        ```python
        from lightning_mpt.core.masters.copies import CopyMasters

        masters = CopyMasters(torch.float16)  # builds its WholeStep
        assert isinstance(masters.stepper, WholeStep) and masters.stepper.owner is masters
        ```
    """

    def __init__(self, owner: CopyMasters) -> None:
        self.owner = owner
        self.groups: GroupSwap = owner.groups
        self._kept: list[Gradients] = []  # steps whose masters keep their fp32 gradients until the next forward
        self.zeros = StandInZeros()  # zero gradients standing for none (fp32 accumulation, a skip's zero_grad)
        self._sized: tuple[int, int] = (-1, MIN_CHUNK)  # (masters counted, :func:`auto_chunk` of them)

    def auto_chunk(self) -> int:
        """:func:`auto_chunk` of the owner's masters (counted again when masters are added or dropped)."""
        masters = self.owner.masters
        count, size = self._sized
        if count != len(masters):
            size = auto_chunk(sum(m.numel() for m in masters.values()))
            self._sized = (len(masters), size)
        return size

    def in_chunks(self, optimizer: Optimizer) -> bool:
        """A whole step is never chunked."""
        return False

    def reset(self) -> None:
        """The masters were given back to the module: forget the kept gradients, zeros and hooks."""
        self._kept.clear()
        self.zeros.reset()

    def prepare(self, optimizer: Optimizer, scale: float, check_edits: bool = True) -> Gradients:
        """Copy ``optimizer``'s half gradients into fp32 master gradients and unscale everything by ``1/scale``.

        Gradients of fp32 parameters are unscaled in place. No host sync: ``found_inf`` and ``edited`` stay on the
        device. A parameter without a gradient gets none on its master either, so the optimizer leaves it alone.
        """
        out = Gradients(optimizer=optimizer)
        plan, halves = self.collect(optimizer, out)
        if check_edits:  # first: its scratch (the masters rounded) never adds to the fp32 gradients' peak
            self.owner.check_edits(out)
        unscale: list[Tensor] = []  # flat buffers of master gradients, or the gradients themselves
        budget = self.auto_chunk()
        if len(out.params) == len(plan.params):  # the usual case, every one has a gradient: the ranges are the plan's
            spans = plan.spans.get(budget)
            if spans is None:
                spans = plan.spans[budget] = _chunks(out.params, budget)
        else:
            spans = _chunks(out.params, budget)
        for start, stop in spans:
            self._to_fp32(out, halves, start, stop, unscale)
            if _compat.GRAD_DTYPE and stop < len(halves):  # the parameters hold the fp32 ones: free this range's
                halves[start:stop] = repeat(None, stop - start)  # type: ignore[arg-type]
        if _compat.GRAD_DTYPE:
            halves.clear()  # the last range's half gradients
        unscale += [p.grad for p in out.own_params if p.grad is not None]
        out.found_inf = _unscale_(unscale, 1.0 / scale, plan.device)
        if not _compat.GRAD_DTYPE and out.on_params:
            _compat.foreach_copy_(out.on_params, out.master_grads)  # hooks see the unscaled values, in the half format
        if not _compat.GRAD_DTYPE:  # hooks edit the half copies; clipping edits the master gradients
            out.on_params_versions = [_compat.version(g) for g in out.on_params]
            out.master_versions = [_compat.version(g) for g in out.master_grads]
        return out

    def collect(self, optimizer: Optimizer, out: Gradients) -> tuple[GroupPlan, list[Tensor]]:
        """Put the parameters of ``optimizer`` that have a gradient into ``out`` (a master whose parameter has none
        gets none either, so the optimizer leaves it alone); a frozen one that has one now gets its master. Returns the
        plan and the half gradients of ``out.params``."""
        if self.zeros.given:
            self.zeros.take_back_unused()
        plan = self.groups.plan(optimizer)
        if plan.frozen and self.owner.enabled:
            unfrozen = [p for p in plan.frozen if p.grad is not None]
            if unfrozen:  # frozen at conversion, trainable now: its master starts from its half value
                for p in unfrozen:
                    self.owner.add_master(p, p.detach().float())
                plan = self.groups.plan(optimizer)
        halves = list(map(_GRAD, plan.params))
        if all(map(is_not, halves, repeat(None))):  # the usual case: every one has one (sparse refused at the copy)
            out.params, out.masters = plan.params, plan.masters  # shared, never changed: caches key on them
        else:
            kept = []
            for (p, master), grad in zip(plan.pairs, halves):
                if grad is None:
                    master.grad = None
                elif grad.is_sparse:
                    raise RuntimeError(_SPARSE)
                else:
                    out.params.append(p)
                    out.masters.append(master)
                    kept.append(grad)
            halves = kept
        for p in plan.own:
            grad = p.grad
            if grad is not None:
                if grad.is_sparse:
                    raise RuntimeError(_SPARSE)
                out.own_params.append(p)
        return plan, halves

    def _to_fp32(self, out: Gradients, grads: list[Tensor], start: int, stop: int, unscale: list[Tensor]) -> None:
        """Give ``out.params[start:stop]`` (whose half gradients are ``grads[start:stop]``) fp32 gradients, on their
        masters and on themselves where torch allows it, which frees the half ones at once. What the unscale is to
        multiply goes into ``unscale``: the flat buffer of the new gradients when they are views of one."""
        whole = start == 0 and stop == len(out.params)  # the usual case: the lists themselves, not copies
        params, masters = (out.params, out.masters) if whole else (out.params[start:stop], out.masters[start:stop])
        halves = grads if whole else grads[start:stop]
        # few Python objects and calls per step: every container allocated counts toward the cyclic garbage
        # collector's next pass, which walks the whole process (Lightning's object graph)
        # torch < 2.13, a step taken again: the half copies the last step left on the parameters stand for its exact
        # fp32 gradients, which are stepped again unrounded
        exact = kept_exactly(self._kept) if self._kept and not _compat.GRAD_DTYPE else {}
        usual = (
            not exact
            and all(map(is_, map(_DTYPE, halves), map(_DTYPE, params)))
            and all(map(Tensor.is_contiguous, halves))
        )
        if not usual and any(g.is_sparse for g in halves):
            raise RuntimeError(_SPARSE)
        layout = self.groups.layouts.get(masters) if usual else None
        if layout is not None:  # the usual case: one allocation, views of it (one unscale kernel)
            flat, fp32 = layout.views(torch.float32, masters[0].device)
            _compat.foreach_copy_(fp32, halves)
            unscale.append(flat)
        elif usual:  # every gradient in its parameter's half format, as autograd leaves it
            fp32 = [torch.empty_like(m) for m in masters]
            _compat.foreach_copy_(fp32, halves)
            unscale.extend(fp32)
        else:  # a gradient already fp32 (left by the last step and accumulated into) is used in place
            fp32 = [
                exact.get(id(g), g if g.dtype == torch.float32 else torch.empty_like(m))
                for g, m in zip(halves, masters)
            ]
            todo = [i for i, (f, g) in enumerate(zip(fp32, halves)) if f is not g and id(g) not in exact]
            if todo:
                _compat.foreach_copy_([fp32[i] for i in todo], [halves[i] for i in todo])
            unscale.extend(fp32)
        del halves  # the half gradients go as soon as the parameters hold the fp32 ones
        if _compat.GRAD_DTYPE:  # the parameters carry the fp32 gradients (their half ones are freed now)
            for p, m, f in zip(params, masters, fp32):
                p.grad = f
                m.grad = f
        else:  # the parameters keep their half gradients, which will show the unscaled values
            for m, f in zip(masters, fp32):
                m.grad = f
        out.master_grads.extend(fp32)
        out.on_params.extend(fp32 if _compat.GRAD_DTYPE else grads[start:stop])

    def sync_edits(self, grads: Gradients) -> None:
        """Make the master gradients what hooks left on the parameters since :meth:`prepare`: a gradient edited in
        place (torch < 2.13 shows half copies), assigned, or set to ``None`` (then the optimizer skips it)."""
        if _compat.GRAD_DTYPE:  # the parameters show the master gradients themselves: only reassignments matter
            if all(map(is_, map(_GRAD, grads.params), grads.master_grads)):  # the usual case: none (a C-level pass)
                return
            for i, (p, mg) in enumerate(zip(grads.params, grads.master_grads)):
                now = p.grad
                if now is not mg:
                    if now is None:
                        grads.masters[i].grad = None
                    else:
                        mg.copy_(now)
            return
        sync_shown(grads)

    def enter(self, optimizer: Optimizer, grads: Gradients) -> None:
        """Hand the masters to ``optimizer`` for its step."""
        self.sync_edits(grads)
        self.groups.swap(optimizer, True)
        grads.entered = True

    def exit(self, optimizer: Optimizer, grads: Gradients, stepped: bool) -> None:
        """Give ``optimizer`` its parameters back and refresh the half weights from the masters.

        The parameters' gradients show what was stepped (clipped values included). After a step (``stepped``) each
        master keeps the fp32 gradient it was stepped with until :meth:`release` (the next forward).
        """
        self.groups.swap(optimizer, False)
        if not _compat.GRAD_DTYPE:
            show_clipping(grads)
        if stepped:
            self._kept.append(grads)
        else:
            for m in grads.masters:
                m.grad = None
        self.owner.write_back(grads.params, grads.masters)
        grads.entered = False

    def steps(self, optimizer: Optimizer, grads: Gradients) -> Generator[None, None, None]:
        """Hand ``optimizer`` the masters for one whole step (the caller steps once) and take them back."""
        return whole_step(self.owner, optimizer, grads)

    def accumulate_in_fp32(self, sync: bool, zeros: bool = True) -> None:
        """:meth:`StandInZeros.accumulate_in_fp32` of the owner's masters."""
        self.zeros.accumulate_in_fp32(self.owner.masters, sync, zeros)

    def rescale(self, grads: Gradients, scale: float) -> None:
        """Before a backward: the unscaled gradients that ``grads`` left on its parameters (a step decided but not
        taken, or taken and not zeroed) are multiplied by ``scale``, the new backward's, in their parameters' own
        format, so the backward accumulates into them as into any gradient, as under "32-true" (clipping done
        meanwhile is kept). A gradient zeroed or dropped since stays so."""
        if not _compat.GRAD_DTYPE:
            show_clipping(grads)
        rest = [p.grad for p in grads.own_params if p.grad is not None]
        for i, (p, m, mg) in enumerate(zip(grads.params, grads.masters, grads.master_grads)):
            m.grad = None
            g = p.grad
            if g is mg or (g is not None and is_faithful_copy(grads, i, g)):
                p.grad = mg.mul_(scale).to(p.dtype)  # scaled before it is rounded, so small values survive
            elif g is not None:
                rest.append(g)
        if rest and scale != 1.0:
            _compat.foreach_mul_(rest, scale)

    def discard(self, grads: Gradients, zero: bool = False) -> None:
        """A skipped step: drop every gradient it had, the parameters' own included.

        ``zero``: leave zeros in the parameters' own formats instead, which ``zero_grad(set_to_none=False)`` keeps (a
        parameter unused in the next step then has a zero gradient, as under "32-true"). Until something writes
        into them (that ``zero_grad``, a backward), they stand for no gradient: a step taken again finds none
        (:meth:`StandInZeros.take_back_unused`), as ``GradScaler`` skips it again.
        """
        for m in grads.masters:
            m.grad = None
        for p in [*grads.params, *grads.own_params]:
            if zero and p.grad is not None:
                self.zeros.give(p, torch.zeros_like(p), track_version=True)
            else:
                p.grad = None

    def release(self, drop: bool) -> None:
        """Release the fp32 gradients that the masters kept from the last step(s).

        ``drop``: also drop them from the module's parameters (Lightning's automatic optimization zeroes them before
        the next backward anyway), so they do not add to the next forward's memory. Otherwise a parameter still
        holding an fp32 gradient gets it back in its own half format, so that the next backward (and DDP's reducer,
        which insists on the parameter's dtype) accumulates into it as usual. The buffer they were views of keeps its
        views for the next step, its memory given back.
        """
        for i in range(len(self._kept)):  # by index: a loop variable would still hold a step's gradients below
            _release(self._kept[i], drop)
        self._kept.clear()
        if self.zeros.given:  # the zeros a skip left that are no longer the gradients are gone
            self.zeros.forget_replaced()
        self.groups.layouts.release()


def _chunks(params: list[Tensor], budget: int = 2**24) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges of ``params`` holding about ``budget`` elements each (:func:`ranges` of their
    sizes): the half gradients of one range are freed before the fp32 ones of the next are allocated, so the step's
    peak stays near 18 bytes per parameter (plus one range's half gradients), not 20."""
    return ranges(list(map(Tensor.numel, params)), budget)


def _release(grads: Gradients, drop: bool) -> None:
    """:meth:`WholeStep.release` of one step's gradients."""
    for p, m, mg in zip(grads.params, grads.masters, grads.master_grads):
        m.grad = None
        if p.grad is mg:
            p.grad = None if drop else mg.to(p.dtype)


def _write_halves(params: list[Tensor], masters: list[Tensor]) -> None:
    """Round the masters into their half parameters, in one foreach copy."""
    if params:
        with torch.no_grad():
            _compat.foreach_copy_(params, masters)


def _by_device(tensors: list[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return groups


def _unscale_(grads: list[Tensor], inv_scale: float, device: Optional[torch.device] = None) -> Optional[Tensor]:
    """Multiply ``grads`` by ``inv_scale`` in place with the fused AMP kernel; return the non-finite flag.

    ``device``: the one device all ``grads`` are on, when known (skips grouping them).
    """
    if not grads:
        return None
    groups = [(device, grads)] if device is not None else [(d, g) for (d, _), g in _by_device(grads).items()]
    found: Optional[Tensor] = None
    for dev, group in groups:
        found_inf = torch.zeros((), device=dev)
        _compat.unscale_(group, found_inf, torch.full((), inv_scale, device=dev))
        found = found_inf if found is None else found + found_inf.to(found.device)
    return found
