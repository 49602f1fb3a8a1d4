"""FP32 master copies of a module's half-precision parameters (one device and DDP).

:meth:`CopyMasters.convert` keeps each parameter's fp32 tensor as its master (no copy, so a master is never a
rounded half value) and gives the parameter a new half-precision tensor; modules of ``keep_fp32`` types keep fp32
parameters, which are their own masters, and a parameter shared by several modules (tied weights) has one master.
While converted, ``module.state_dict()`` returns the masters and ``module.load_state_dict()`` writes them.

At a step, :meth:`CopyMasters.prepare` copies the half gradients into fp32 master gradients and unscales them with
torch's fused AMP kernel; on torch >= 2.13 the module's parameters then carry those fp32 gradients and the half ones
are freed. It also flags half weights that user code edited in place since the last step (a WGAN clamp,
``nn.Embedding(max_norm=...)``), for :meth:`CopyMasters.adopt_edits`. :meth:`CopyMasters.enter` puts the masters into
the optimizer's ``param_groups`` (its state follows them) and :meth:`CopyMasters.exit` gives the parameters back and
refreshes the half weights in one foreach copy. The parameters' data never changes dtype during training: that would
reset their autograd gradient accumulators and detach DDP's hooks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_mpt import _compat
from lightning_mpt.core.masters import DEFAULT_KEEP_FP32, HALF_DTYPES, Gradients, distributed
from lightning_mpt.core.masters._conversion import convert_module, exact_state, restore_module
from lightning_mpt.core.masters._edits import copy_into_masters, edit_flags, edit_flags_of, edited_pairs

__all__ = ["CopyMasters"]


@dataclass
class _GroupPlan:
    key: tuple[tuple[int, int], ...]  # (id, length) of each group's parameter list when the plan was made
    own: list[Tensor] = field(default_factory=list)  # parameters that are their own master
    device: Optional[torch.device] = None  # the one device all of them live on, if there is one
    # per group: (its parameter list, its entries as parameters, its entries as masters), for one-call swaps
    groups: list[tuple[list[Tensor], list[Tensor], list[Tensor]]] = field(default_factory=list)
    pairs: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (parameter, master) of every slot


class CopyMasters:
    """FP32 master copies of a module's half-precision parameters.

    Args:
        dtype: the half-precision format, ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types whose parameters stay fp32.
        enabled: keep masters; ``False`` leaves the half weights as the only copy (steps update them directly).

    Example:
        ```python
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        mw = CopyMasters(torch.float16)
        mw.convert(model)
        assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
        assert mw.master_of(model[0].weight).dtype == torch.float32
        mw.restore()
        assert model[0].weight.dtype == torch.float32
        ```
    """

    def __init__(
        self, dtype: torch.dtype, keep_fp32: tuple[type[nn.Module], ...] = DEFAULT_KEEP_FP32, enabled: bool = True
    ) -> None:
        if dtype not in HALF_DTYPES:
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        self.keep_fp32 = tuple(keep_fp32)
        self.enabled = enabled
        self.masters: dict[Tensor, Tensor] = {}
        self._param_of: dict[Tensor, Tensor] = {}  # master -> parameter
        self._plans: dict[Optimizer, _GroupPlan] = {}
        self.converted: dict[Tensor, None] = {}  # every parameter given a half tensor (an ordered set)
        self._kept: list[Gradients] = []  # steps whose masters keep their fp32 gradients until the next forward
        self.names: dict[Tensor, str] = {}
        self._handles: list[RemovableHandle] = []

    # ------------------------------------------------------------------ conversion
    def convert(self, module: nn.Module, restored: bool = False) -> nn.Module:
        """Cast ``module``'s parameters to half precision in place, keeping the fp32 tensors as masters.

        A parameter frozen now (``requires_grad=False``) gets no master: it costs only its half weight. If it is
        unfrozen later, its master is made at its first step, from its half value.

        Args:
            module: the model, its parameters fp32 (or already half).
            restored: the weights were just loaded from a checkpoint of a run under way: a frozen parameter whose
                value the half format cannot hold was trained before (unfrozen then) and keeps its exact master.
        """
        if self.converted:
            self.restore()
        self._handles = convert_module(self, module, restored)
        return module

    def restore(self) -> None:
        """Give the converted parameters fp32 tensors again: their masters, with any edit made to the half weights
        since the last step (for example by a weight-averaging callback at the end of fit) adopted first."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.adopt_all_edits()
        restore_module(self)
        self.converted.clear()
        self.masters.clear()
        self._param_of.clear()
        self._plans.clear()
        self._kept.clear()

    def add_master(self, param: Tensor, master: Tensor) -> None:
        self.masters[param] = master
        self._param_of[master] = param
        self._plans.clear()

    # ------------------------------------------------------------------ queries
    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 tensor that the optimizer steps for ``param`` (``param`` itself when it has no master)."""
        return self.masters.get(param, param)

    def name_of(self, param: Tensor) -> str:
        return self.names.get(param, f"<unnamed {tuple(param.shape)}>")

    def named_masters(self) -> Iterator[tuple[str, Tensor, Tensor]]:
        """``(name, half parameter, master)`` for each converted parameter with a master."""
        for p, m in self.masters.items():
            yield self.names.get(p, ""), p, m

    # ------------------------------------------------------------------ set-up after the module moved / was wrapped
    def follow_devices(self) -> None:
        """Move masters next to their parameters (the module may have moved since :meth:`convert`)."""
        for p, m in list(self.masters.items()):
            if m.device != p.device:
                del self._param_of[m]
                self.masters[p] = m = m.to(p.device)
                self._param_of[m] = p
                self._plans.clear()

    def broadcast(self, src: int = 0, refresh: bool = True) -> None:
        """Make every process hold the masters of rank ``src``; ``refresh``: the half weights follow (leave them when
        DDP made them equal already and a forward's graph may hold them)."""
        if not distributed() or not self.masters:
            return
        with torch.no_grad():
            for group in _by_device(list(self.masters.values())).values():
                flat = torch.cat([m.reshape(-1) for m in group])
                dist.broadcast(flat, src=src)
                _compat.foreach_copy_(
                    group, [t.view_as(m) for t, m in zip(flat.split([m.numel() for m in group]), group)]
                )
        if refresh:
            self.refresh()

    def refresh(self) -> None:
        """Write the masters into the half weights."""
        _write_halves(list(self.masters), list(self.masters.values()))

    def adopt(self, optimizer: Optimizer) -> list[RemovableHandle]:
        """Keep ``optimizer``'s state fp32 and exact, and let ``load_state_dict`` see the masters (torch casts loaded
        state to the dtype of the parameters it finds in ``param_groups``); returns the hooks' handles."""
        exact_state(optimizer, self.masters, self.dtype)
        return [
            optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: self.swap_groups(opt, True)),
            optimizer.register_load_state_dict_post_hook(lambda opt: self.swap_groups(opt, False)),
        ]

    def swap_groups(self, optimizer: Optimizer, to_masters: bool) -> None:
        """Put the masters (or back the parameters) into ``optimizer.param_groups``, in place, with their state.

        In place, because optimizers such as LBFGS keep a reference to the group's list.
        """
        plan = self._plan(optimizer)
        for params, mine, masters in plan.groups:
            params[:] = masters if to_masters else mine  # one slice assignment per group
        state = optimizer.state
        for p, m in plan.pairs:
            x, y = (p, m) if to_masters else (m, p)
            if x in state:
                state[y] = state.pop(x)

    def _plan(self, optimizer: Optimizer) -> _GroupPlan:
        """Where ``optimizer``'s parameters with masters sit in its groups; rebuilt when the groups change."""
        key = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        plan = self._plans.get(optimizer)
        if plan is None or plan.key != key:
            plan = _GroupPlan(key)
            for group in optimizer.param_groups:
                params = group["params"]
                mine = [self._param_of.get(x, x) for x in params]  # the groups may hold the masters right now
                plan.groups.append((params, mine, [self.masters.get(p, p) for p in mine]))
                for p in mine:
                    m = self.masters.get(p)
                    if m is None:
                        plan.own.append(p)
                    else:
                        plan.pairs.append((p, m))
            devices = {p.device for p in plan.own} | {m.device for _, m in plan.pairs}
            plan.device = devices.pop() if len(devices) == 1 else None
            self._plans[optimizer] = plan
        return plan

    # ------------------------------------------------------------------ the optimizer step
    def prepare(self, optimizer: Optimizer, scale: float, check_edits: bool = True) -> Gradients:
        """Copy ``optimizer``'s half gradients into fp32 master gradients and unscale everything by ``1/scale``.

        Gradients of fp32 parameters are unscaled in place. No host sync: ``found_inf`` and ``edited`` stay on the
        device. A parameter without a gradient gets none on its master either, so the optimizer leaves it alone.
        """
        out = Gradients(optimizer=optimizer)
        plan = self._plan(optimizer)
        if self.enabled and any(p.grad is not None and p in self.converted for p in plan.own):
            for p in plan.own:  # frozen at conversion, trainable now: its master starts from its half value
                if p.grad is not None and p in self.converted:
                    self.add_master(p, p.detach().float())
            plan = self._plan(optimizer)
        for p, master in plan.pairs:
            if p.grad is None:
                master.grad = None
            else:
                out.params.append(p)
                out.masters.append(master)
        out.own_params = [p for p in plan.own if p.grad is not None]
        if any(_grad(p).is_sparse for p in out.all_params()):
            raise RuntimeError("MPTPrecision does not support sparse gradients; use dense embeddings (sparse=False).")
        edited = []
        for start, stop in _chunks(out.params):
            edited.append(self._to_fp32(out, start, stop, check_edits))
        if check_edits and edited:
            out.edited = torch.cat(edited)
        out.found_inf = _unscale_(out.fp32_grads(), 1.0 / scale, plan.device)
        if not _compat.GRAD_DTYPE and out.on_params:
            _compat.foreach_copy_(out.on_params, out.master_grads)  # hooks see the unscaled values, in the half format
        if not _compat.GRAD_DTYPE:  # hooks edit the half copies; clipping edits the master gradients
            out.on_params_versions = [_compat.version(g) for g in out.on_params]
            out.master_versions = [_compat.version(g) for g in out.master_grads]
        return out

    def _to_fp32(self, out: Gradients, start: int, stop: int, check_edits: bool) -> Tensor:
        """Give ``out.params[start:stop]`` fp32 gradients (on their masters, and on themselves where torch allows it,
        which frees the half ones at once); the half gradients, dead once copied, are the scratch space of the check
        for edited weights, whose flags are returned."""
        params, masters = out.params[start:stop], out.masters[start:stop]
        halves = [_grad(p) for p in params]
        # few Python objects per step: every container allocated counts toward the cyclic garbage collector's next
        # pass, which walks the whole process (Lightning's object graph) and lands in whatever allocates
        usual = all(g.dtype == p.dtype and g.is_contiguous() for g, p in zip(halves, params))
        if usual:  # every gradient in its parameter's half format, as autograd leaves it
            fp32 = [torch.empty_like(m) for m in masters]
            _compat.foreach_copy_(fp32, halves)
        else:  # a gradient already fp32 (left by the last step and accumulated into) is used in place
            fp32 = [g if g.dtype == torch.float32 else torch.empty_like(m) for g, m in zip(halves, masters)]
            todo = [i for i, (f, g) in enumerate(zip(fp32, halves)) if f is not g]
            if todo:
                _compat.foreach_copy_([fp32[i] for i in todo], [halves[i] for i in todo])
        flags = torch.zeros(0, dtype=torch.bool, device=params[0].device)
        if check_edits:
            scratch = (
                halves
                if usual
                else [
                    g if g.dtype == p.dtype and g.is_contiguous() else torch.empty_like(p)
                    for g, p in zip(halves, params)
                ]
            )
            flags = edit_flags(params, masters, scratch)
        shown = fp32 if _compat.GRAD_DTYPE else halves
        for p, m, f, g in zip(params, masters, fp32, shown):
            _set_grad(p, g)
            m.grad = f
        out.master_grads.extend(fp32)
        out.on_params.extend(shown)
        return flags

    def adopt_edits(self, grads: Gradients, flags: list[float]) -> list[str]:
        """Copy into the masters the half weights that ``flags`` (the host values of ``grads.edited``) mark as edited
        since the last step; return their names."""
        edited = edited_pairs(list(zip(grads.params, grads.masters)), flags)
        copy_into_masters(edited)
        return [self.name_of(p) for p, _ in edited]

    def adopt_all_edits(self) -> list[str]:
        """Check every converted parameter for an edit of its half weight (one host sync) and adopt what is found."""
        pairs = [(p, m) for p, m in self.masters.items() if p.dtype == self.dtype and p.shape == m.shape]
        edited = edited_pairs(pairs, edit_flags_of(pairs))
        copy_into_masters(edited)
        return [self.name_of(p) for p, _ in edited]

    def sync_edits(self, grads: Gradients) -> None:
        """Make the master gradients what hooks left on the parameters since :meth:`prepare`: a gradient edited in
        place (torch < 2.13 shows half copies), assigned, or set to ``None`` (then the optimizer skips it)."""
        if _compat.GRAD_DTYPE:  # the parameters show the master gradients themselves: only reassignments matter
            for i, (p, mg) in enumerate(zip(grads.params, grads.master_grads)):
                now = p.grad
                if now is not mg:
                    if now is None:
                        grads.masters[i].grad = None
                    else:
                        mg.copy_(now)
            return
        for i, (p, shown, v) in enumerate(zip(grads.params, grads.on_params, grads.on_params_versions)):
            now, master_grad = p.grad, grads.master_grads[i]
            if now is master_grad or (now is shown and _compat.version(shown) == v):
                continue
            if now is None:
                grads.masters[i].grad = None
            else:
                master_grad.copy_(now)
            if now is shown:
                grads.on_params_versions[i] = _compat.version(shown)

    def enter(self, optimizer: Optimizer, grads: Gradients) -> None:
        """Hand the masters to ``optimizer`` for its step."""
        self.sync_edits(grads)
        self.swap_groups(optimizer, True)
        grads.entered = True

    def exit(self, optimizer: Optimizer, grads: Gradients, stepped: bool) -> None:
        """Give ``optimizer`` its parameters back and refresh the half weights from the masters.

        The parameters' gradients show what was stepped (clipped values included). After a step (``stepped``) each
        master keeps the fp32 gradient it was stepped with until :meth:`release` (the next forward).
        """
        self.swap_groups(optimizer, False)
        self._show_clipping(grads)
        if stepped:
            self._kept.append(grads)
        else:
            for m in grads.masters:
                m.grad = None
        _write_halves(grads.params, grads.masters)
        grads.entered = False

    def accumulate_in_fp32(self, sync: bool) -> None:
        """Before a backward: give the half parameters fp32 gradients for autograd to accumulate into (zeros at the
        start of a window), so micro-batches are summed in fp32, not in the half format (torch >= 2.13).

        ``sync``: the backward reduces gradients across processes (DDP's last micro-batch); the reducer insists on
        the parameter's dtype, so the fp32 sum so far goes back to the half format, rounded once.
        """
        for p, m in self.masters.items():
            g = p.grad
            if sync:
                _set_grad(p, None if g is None else g.to(p.dtype))
            elif g is None or g.dtype != torch.float32:
                _set_grad(p, torch.zeros_like(m) if g is None else g.float())

    def rescale(self, grads: Gradients, scale: float) -> None:
        """Before a backward: the unscaled gradients that ``grads`` left on its parameters (a step decided but not
        taken, or taken and not zeroed) are multiplied by ``scale``, the new backward's, in their parameters' own
        format, so the backward accumulates into them as into any gradient, as under "32-true" (clipping done
        meanwhile is kept). A gradient zeroed or dropped since stays so."""
        self._show_clipping(grads)
        rest = [p.grad for p in grads.own_params if p.grad is not None]
        for i, (p, m, mg) in enumerate(zip(grads.params, grads.masters, grads.master_grads)):
            m.grad = None
            g = p.grad
            if g is mg or (g is not None and _is_faithful_copy(grads, i, g)):
                _set_grad(p, mg.mul_(scale).to(p.dtype))  # scaled before it is rounded, so small values survive
            elif g is not None:
                rest.append(g)
        if rest and scale != 1.0:
            _compat.foreach_mul_(rest, scale)

    @staticmethod
    def _show_clipping(grads: Gradients) -> None:
        """torch < 2.13: the half copies shown on the parameters learn of clipping done to the master gradients."""
        if _compat.GRAD_DTYPE:
            return
        for i, (shown, mg, v) in enumerate(zip(grads.on_params, grads.master_grads, grads.master_versions)):
            if _compat.version(mg) != v:
                shown.copy_(mg)
                grads.master_versions[i] = _compat.version(mg)
                grads.on_params_versions[i] = _compat.version(shown)

    def discard(self, grads: Gradients) -> None:
        """A skipped step: drop every gradient it grads, the parameters' own included."""
        for m in grads.masters:
            m.grad = None
        for p in grads.params:
            _set_grad(p, None)
        for p in grads.own_params:
            p.grad = None

    def release(self, drop: bool) -> None:
        """Release the fp32 gradients that the masters kept from the last step(s).

        ``drop``: also drop them from the module's parameters (Lightning's automatic optimization zeroes them before
        the next backward anyway), so they do not add to the next forward's memory. Otherwise a parameter still
        holding an fp32 gradient gets it back in its own half format, so that the next backward (and DDP's reducer,
        which insists on the parameter's dtype) accumulates into it as usual.
        """
        for grads in self._kept:
            for p, m, mg in zip(grads.params, grads.masters, grads.master_grads):
                m.grad = None
                g = p.grad
                if g is mg:
                    _set_grad(p, None if drop else mg.to(p.dtype))
                elif g is None and _compat.GRAD_DTYPE and p.grad_dtype is None:
                    p.grad_dtype = (
                        p.dtype
                    )  # zero_grad dropped the fp32 gradient: autograd casts to the half format again
        self._kept.clear()


def _chunks(params: list[Tensor], budget: int = 2**24) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` index ranges of ``params`` holding about ``budget`` elements each: the half gradients of one
    range are freed before the fp32 ones of the next are allocated, so the step's peak stays near 18 bytes per
    parameter (plus one range), not 20."""
    start, size = 0, 0
    for i, p in enumerate(params):
        size += p.numel()
        if size >= budget:
            yield start, i + 1
            start, size = i + 1, 0
    if start < len(params):
        yield start, len(params)


def _grad(p: Tensor) -> Tensor:
    """The gradient of a parameter known to have one."""
    g = p.grad
    if g is None:
        raise RuntimeError(f"MPTPrecision: a parameter of shape {tuple(p.shape)} lost its gradient during the step.")
    return g


def _set_grad(p: Tensor, grad: Optional[Tensor]) -> None:
    """Give the half parameter ``p`` the gradient ``grad``. One of another dtype (its fp32 gradient at the step) needs
    ``grad_dtype = None`` (torch >= 2.13); otherwise the parameter's own dtype is pinned again, so that autograd casts
    what it accumulates there (and DDP's reducer gets the dtype it insists on)."""
    if _compat.GRAD_DTYPE:
        if grad is not None and grad.dtype != p.dtype:
            if p.grad_dtype is not None:
                p.grad_dtype = None
        elif p.grad_dtype is None:
            p.grad = None  # a gradient of the other dtype may still be there
            p.grad_dtype = p.dtype
    p.grad = grad


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


def _is_faithful_copy(grads: Gradients, i: int, grad: Tensor) -> bool:
    """torch < 2.13: whether ``grad`` is the half copy of master gradient ``i`` shown on its parameter, untouched
    since it was written (so the master gradient holds the same values, unrounded)."""
    return (
        not _compat.GRAD_DTYPE and grad is grads.on_params[i] and _compat.version(grad) == grads.on_params_versions[i]
    )
