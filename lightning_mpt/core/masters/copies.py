"""FP32 master weights for a module whose parameters live in half precision (pure torch, no Lightning).

Life cycle, driven by :class:`~lightning_mpt.MPTPrecision`:

1. :meth:`MasterWeights.convert` keeps each parameter's fp32 tensor as its master (no copy, so a master is never a
   rounded half value) and gives the parameter a new half-precision tensor. Modules of ``keep_fp32`` types keep
   fp32 parameters, which are their own masters. A parameter shared by several modules (tied weights) has one
   master under every name.
2. :meth:`MasterWeights.prepare` copies the half gradients into fp32 master gradients and unscales them with torch's
   fused AMP kernel (non-finite check included, no host sync). On torch >= 2.13 the module's parameters then carry
   those fp32 gradients and the half ones are freed; on older torch the half gradients receive the unscaled values.
   It also flags, on the device, half weights that user code edited in place since the last step (a WGAN clamp,
   ``nn.Embedding(max_norm=...)``): :meth:`MasterWeights.adopt_edits` copies those edits into the masters.
3. :meth:`MasterWeights.enter` puts the masters into the optimizer's ``param_groups`` (its state follows them) for
   ``optimizer.step()``; :meth:`MasterWeights.exit` gives the parameters back and refreshes the half weights from
   the masters in one foreach copy. The parameters' data never changes dtype during training: that would reset
   their autograd gradient accumulators and detach DDP's hooks.
4. :meth:`MasterWeights.restore` gives the module its fp32 masters back.

While converted, ``module.state_dict()`` returns the masters and ``module.load_state_dict()`` writes them.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils.parametrize import ParametrizationList
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_mpt import _compat
from lightning_mpt.core.numerics import max_abs

# parameters of these modules stay fp32: normalisation statistics and affine parameters are precision-sensitive
DEFAULT_KEEP_FP32: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
    nn.CrossMapLRN2d,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),  # torch >= 2.4
    # a parametrized tensor (spectral_norm, orthogonal, weight_norm): its parametrization runs ops that autocast does
    # not cover (mv, matrix_exp, QR) and that lose the constraint in half precision; it also covers the legacy
    # hook-based spectral_norm and weight_norm (see _reparametrized)
    ParametrizationList,
)

# modules with parameters whose ops torch.autocast does not cover: their floating inputs (positional and keyword)
# are cast to the weights' dtype. Found by running every nn module with half weights under CPU and CUDA autocast.
_AUTOCAST_UNCOVERED = (nn.Bilinear, nn.RNNBase, nn.RNNCellBase, nn.EmbeddingBag, nn.AdaptiveLogSoftmaxWithLoss)

HALF_DTYPES = (torch.float16, torch.bfloat16)


def distributed() -> bool:
    """Whether this process is one of several in a ``torch.distributed`` group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass
class PreparedGrads:
    """The gradients of one optimizer, unscaled into fp32, waiting for the step."""

    params: list[Tensor] = field(default_factory=list)  # module parameters that have a separate master
    masters: list[Tensor] = field(default_factory=list)
    master_grads: list[Tensor] = field(default_factory=list)
    shown: list[Tensor] = field(default_factory=list)  # what each parameter's ``.grad`` holds for hooks to see
    shown_versions: list[int] = field(default_factory=list)  # of ``shown`` as written, to notice edits by hooks
    own_params: list[Tensor] = field(default_factory=list)  # parameters that are their own master (fp32)
    found_inf: Optional[Tensor] = None  # 0-dim, > 0 when a gradient was non-finite; None when no gradients
    # whether the half weights were edited since the last step: one flag per entry of ``params``, or a single flag
    # for all of them (on CPU; adopt_edits then finds which)
    edited: Optional[Tensor] = None
    entered: bool = False  # whether the optimizer holds the masters now
    master_versions: list[int] = field(default_factory=list)  # of the master grads as prepared, to notice clipping
    optimizer: Optional[Optimizer] = None  # whose gradients these are: its parameter order is every process's

    def all_params(self) -> list[Tensor]:
        return self.params + self.own_params

    def fp32_grads(self) -> list[Tensor]:
        """The unscaled gradients, aligned with :meth:`all_params` (this process's part of each)."""
        return self.master_grads + [p.grad for p in self.own_params if p.grad is not None]

    def nonfinite_mask(self) -> Optional[Tensor]:
        """Per-parameter flags (aligned with :meth:`all_params`) of gradients that are non-finite on any process, on
        the device, no host sync.

        Across processes the flags are all-reduced (max) in the optimizer's parameter order, which every process
        shares: a collective, so every process must call it, as the engine does on a skipped step (decided the same
        everywhere). So every process names the same culprits, also for a gradient that is non-finite on one process
        only (FSDP2's shards, or a gradient edited after DDP's all-reduce).
        """
        grads = self.fp32_grads()
        local = ~torch.isfinite(max_abs(grads)) if grads else None
        if self.optimizer is None or not distributed():
            return local
        order = {p: i for i, p in enumerate(_params_of(self.optimizer))}
        device = local.device if local is not None else next(iter(order)).device
        positions = torch.tensor([order[p] for p in self.all_params()], dtype=torch.long, device=device)
        flags = torch.zeros(len(order), device=device)
        if local is not None:
            flags[positions] = local.float()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags[positions] > 0


@dataclass
class _Plan:
    key: tuple[tuple[int, int], ...]  # (id, length) of each group's parameter list when the plan was made
    own: list[Tensor] = field(default_factory=list)  # parameters that are their own master
    device: Optional[torch.device] = None  # the one device all of them live on, if there is one
    # per group: (its parameter list, its entries as parameters, its entries as masters), for one-call swaps
    groups: list[tuple[list[Tensor], list[Tensor], list[Tensor]]] = field(default_factory=list)
    pairs: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (parameter, master) of every slot


class MasterWeights:
    """FP32 master copies of a module's half-precision parameters.

    Args:
        dtype: the half-precision format, ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types whose parameters stay fp32.
        enabled: keep masters; ``False`` leaves the half weights as the only copy (steps update them directly).

    Example:
        ```python
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        mw = MasterWeights(torch.float16)
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
        self._masters: dict[Tensor, Tensor] = {}
        self._param_of: dict[Tensor, Tensor] = {}  # master -> parameter
        self._plans: dict[Optimizer, _Plan] = {}
        self._converted: dict[Tensor, None] = {}  # every parameter given a half tensor (an ordered set)
        self._stepped: list[PreparedGrads] = []  # steps whose masters keep their fp32 gradients until the next forward
        self._names: dict[Tensor, str] = {}
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
        if self._converted:
            self.restore()
        kept = {id(p) for m in module.modules() if isinstance(m, self.keep_fp32) for p in m.parameters()}
        if ParametrizationList in self.keep_fp32:
            kept |= {id(p) for m in module.modules() for p in _reparametrized(m)}
        self._names = {p: name for name, p in module.named_parameters()}
        trained = _not_half(module, kept, self.dtype) if restored and self.enabled else set()
        owners: dict[nn.Module, list[str]] = defaultdict(list)
        for mod in module.modules():
            for name, p in mod.named_parameters(recurse=False):
                if id(p) in kept or not _castable(p):
                    continue
                owners[mod].append(name)  # every name of a shared parameter: each must save the master
                if p in self._converted:
                    continue
                master = p.data if p.dtype == torch.float32 else p.data.float()
                grad = p.grad
                _point(p, master.to(self.dtype), None if grad is None else grad.to(self.dtype))
                self._converted[p] = None
                if self.enabled and (p.requires_grad or p in trained):
                    self._add_master(p, master)
        self._handles.append(module.register_state_dict_pre_hook(self._before_state_dict))
        for mod, names in owners.items():
            self._handles.append(_compat.register_state_dict_post_hook(mod, _MasterStateDictHook(self, names)))
            self._handles.append(_compat.register_load_state_dict_pre_hook(mod, _MasterLoadHook(self, names)))
            if isinstance(mod, _AUTOCAST_UNCOVERED):
                self._handles.append(mod.register_forward_pre_hook(_cast_inputs_to_weight, with_kwargs=True))
        return module

    def restore(self) -> None:
        """Give the converted parameters fp32 tensors again: their masters, with any edit made to the half weights
        since the last step (for example by a weight-averaging callback at the end of fit) adopted first."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.adopt_all_edits()
        for p in self._converted:
            master = self._masters.get(p)
            data = p.data
            if master is None or data.dtype != self.dtype:  # no master, or replaced by other code: take it as is
                master = data.float()
            grad = p.grad
            if grad is not None and grad.dtype != torch.float32:
                grad = master.grad if master.grad is not None and grad.shape == master.shape else grad.float()
            p.grad = None
            if _compat.GRAD_DTYPE:
                p.grad_dtype = torch.float32  # it was switched at the step; an fp32 parameter takes fp32 gradients
            p.data = master.to(data.device)
            if grad is not None:
                p.grad = grad
            master.grad = None
        self._converted.clear()
        self._masters.clear()
        self._param_of.clear()
        self._plans.clear()
        self._stepped.clear()

    def _add_master(self, param: Tensor, master: Tensor) -> None:
        self._masters[param] = master
        self._param_of[master] = param
        self._plans.clear()

    # ------------------------------------------------------------------ queries
    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 tensor that the optimizer steps for ``param`` (``param`` itself when it has no master)."""
        return self._masters.get(param, param)

    def main_params(self, params: Iterable[Tensor]) -> list[Tensor]:
        return [self._masters.get(p, p) for p in params]

    def name_of(self, param: Tensor) -> str:
        return self._names.get(param, f"<unnamed {tuple(param.shape)}>")

    def named_masters(self) -> Iterator[tuple[str, Tensor, Tensor]]:
        """``(name, half parameter, master)`` for each converted parameter with a master."""
        for p, m in self._masters.items():
            yield self._names.get(p, ""), p, m

    # ------------------------------------------------------------------ set-up after the module moved / was wrapped
    def follow_devices(self) -> None:
        """Move masters next to their parameters (the module may have moved since :meth:`convert`)."""
        for p, m in list(self._masters.items()):
            if m.device != p.device:
                del self._param_of[m]
                self._masters[p] = m = m.to(p.device)
                self._param_of[m] = p
                self._plans.clear()

    def broadcast(self, src: int = 0) -> None:
        """Make every process hold the masters of rank ``src`` (their half weights follow)."""
        if not distributed() or not self._masters:
            return
        for group in _by_device(list(self._masters.values())).values():
            flat = torch.cat([m.reshape(-1) for m in group])
            dist.broadcast(flat, src=src)
            _compat.foreach_copy_(group, [t.view_as(m) for t, m in zip(flat.split([m.numel() for m in group]), group)])
        self.refresh()

    def refresh(self) -> None:
        """Write the masters into the half weights."""
        _write_halves(list(self._masters), list(self._masters.values()))

    def adopt_optimizer(self, optimizer: Optimizer) -> list[RemovableHandle]:
        """Keep ``optimizer``'s state fp32 and exact, and let ``load_state_dict`` see the masters (torch casts loaded
        state to the dtype of the parameters it finds in ``param_groups``).

        State an optimizer builds at construction for half parameters (Adagrad's accumulator) was computed in half
        precision: it is rebuilt exactly by constructing the same optimizer over the masters.
        """
        rounded = [
            (p, k)
            for p in _params_of(optimizer)
            if p in self._masters
            for k, v in optimizer.state.get(p, {}).items()
            if isinstance(v, Tensor) and v.dtype == self.dtype
        ]
        if rounded:
            fresh = _rebuild_over_masters(optimizer, self._masters)
            for p, k in rounded:
                master = self._masters[p]
                exact = None if fresh is None else fresh.state.get(master, {}).get(k)
                optimizer.state[p][k] = exact if isinstance(exact, Tensor) else optimizer.state[p][k].float()
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

    def _plan(self, optimizer: Optimizer) -> _Plan:
        """Where ``optimizer``'s parameters with masters sit in its groups; rebuilt when the groups change."""
        key = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        plan = self._plans.get(optimizer)
        if plan is None or plan.key != key:
            plan = _Plan(key)
            for group in optimizer.param_groups:
                params = group["params"]
                mine = [self._param_of.get(x, x) for x in params]  # the groups may hold the masters right now
                plan.groups.append((params, mine, self.main_params(mine)))
                for p in mine:
                    m = self._masters.get(p)
                    if m is None:
                        plan.own.append(p)
                    else:
                        plan.pairs.append((p, m))
            devices = {p.device for p in plan.own} | {m.device for _, m in plan.pairs}
            plan.device = devices.pop() if len(devices) == 1 else None
            self._plans[optimizer] = plan
        return plan

    # ------------------------------------------------------------------ the optimizer step
    def prepare(self, optimizer: Optimizer, scale: float, check_edits: bool = True) -> PreparedGrads:
        """Copy ``optimizer``'s half gradients into fp32 master gradients and unscale everything by ``1/scale``.

        Gradients of fp32 parameters are unscaled in place. No host sync: ``found_inf`` and ``edited`` stay on the
        device. A parameter without a gradient gets none on its master either, so the optimizer leaves it alone.
        """
        out = PreparedGrads(optimizer=optimizer)
        plan = self._plan(optimizer)
        if self.enabled and any(p.grad is not None and p in self._converted for p in plan.own):
            for p in plan.own:  # frozen at conversion, trainable now: its master starts from its half value
                if p.grad is not None and p in self._converted:
                    self._add_master(p, p.detach().float())
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
        if not _compat.GRAD_DTYPE and out.shown:
            _compat.foreach_copy_(out.shown, out.master_grads)  # hooks see the unscaled values, in the half format
        if not _compat.GRAD_DTYPE:  # hooks edit the half copies; clipping edits the master gradients
            out.shown_versions = [_compat.version(g) for g in out.shown]
            out.master_versions = [_compat.version(g) for g in out.master_grads]
        return out

    def _to_fp32(self, out: PreparedGrads, start: int, stop: int, check_edits: bool) -> Tensor:
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
            flags = _edited(params, masters, scratch)
        shown = fp32 if _compat.GRAD_DTYPE else halves
        for p, m, f, g in zip(params, masters, fp32, shown):
            _carry(p, g)
            m.grad = f
        out.master_grads.extend(fp32)
        out.shown.extend(shown)
        return flags

    def adopt_edits(self, prepared: PreparedGrads, flags: list[float]) -> list[str]:
        """Copy into the masters the half weights that ``flags`` (the host values of ``prepared.edited``) mark as
        edited since the last step; return their names."""
        edited = _which(list(zip(prepared.params, prepared.masters)), flags)
        self._copy_into_masters(edited)
        return [self.name_of(p) for p, _ in edited]

    def adopt_all_edits(self) -> list[str]:
        """Check every converted parameter for an edit of its half weight (one host sync) and adopt what is found."""
        pairs = [(p, m) for p, m in self._masters.items() if p.dtype == self.dtype and p.shape == m.shape]
        if not pairs:
            return []
        with torch.no_grad():
            flags = _edited([p for p, _ in pairs], [m for _, m in pairs], [torch.empty_like(p) for p, _ in pairs])
        edited = _which(pairs, flags.tolist())
        self._copy_into_masters(edited)
        return [self.name_of(p) for p, _ in edited]

    @staticmethod
    def _copy_into_masters(pairs: list[tuple[Tensor, Tensor]]) -> None:
        if pairs:
            with torch.no_grad():
                _compat.foreach_copy_([m for _, m in pairs], [p for p, _ in pairs])

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not keep_vars:
            self.adopt_all_edits()  # a checkpoint written after a hook clamped the weights holds the clamped values

    def sync_edits(self, prepared: PreparedGrads) -> None:
        """Make the master gradients what hooks left on the parameters since :meth:`prepare`: a gradient edited in
        place (torch < 2.13 shows half copies), assigned, or set to ``None`` (then the optimizer skips it)."""
        if _compat.GRAD_DTYPE:  # the parameters show the master gradients themselves: only reassignments matter
            for i, (p, mg) in enumerate(zip(prepared.params, prepared.master_grads)):
                now = p.grad
                if now is not mg:
                    if now is None:
                        prepared.masters[i].grad = None
                    else:
                        mg.copy_(now)
            return
        for i, (p, shown, v) in enumerate(zip(prepared.params, prepared.shown, prepared.shown_versions)):
            now, master_grad = p.grad, prepared.master_grads[i]
            if now is master_grad or (now is shown and _compat.version(shown) == v):
                continue
            if now is None:
                prepared.masters[i].grad = None
            else:
                master_grad.copy_(now)
            if now is shown:
                prepared.shown_versions[i] = _compat.version(shown)

    def enter(self, optimizer: Optimizer, prepared: PreparedGrads) -> None:
        """Hand the masters to ``optimizer`` for its step."""
        self.sync_edits(prepared)
        self.swap_groups(optimizer, True)
        prepared.entered = True

    def exit(self, optimizer: Optimizer, prepared: PreparedGrads, stepped: bool) -> None:
        """Give ``optimizer`` its parameters back and refresh the half weights from the masters.

        The parameters' gradients show what was stepped (clipped values included). After a step (``stepped``) each
        master keeps the fp32 gradient it was stepped with until :meth:`release_stepped` (the next forward).
        """
        self.swap_groups(optimizer, False)
        self._show_clipping(prepared)
        if stepped:
            self._stepped.append(prepared)
        else:
            for m in prepared.masters:
                m.grad = None
        _write_halves(prepared.params, prepared.masters)
        prepared.entered = False

    def accumulate_in_fp32(self, sync: bool) -> None:
        """Before a backward: give the half parameters fp32 gradients for autograd to accumulate into (zeros at the
        start of a window), so micro-batches are summed in fp32, not in the half format (torch >= 2.13).

        ``sync``: the backward reduces gradients across processes (DDP's last micro-batch); the reducer insists on
        the parameter's dtype, so the fp32 sum so far goes back to the half format, rounded once.
        """
        for p, m in self._masters.items():
            g = p.grad
            if sync:
                _carry(p, None if g is None else g.to(p.dtype))
            elif g is None or g.dtype != torch.float32:
                _carry(p, torch.zeros_like(m) if g is None else g.float())

    def rescale(self, prepared: PreparedGrads, scale: float) -> None:
        """Before a backward: the unscaled gradients that ``prepared`` left on its parameters (a step decided but not
        taken, or taken and not zeroed) are multiplied by ``scale``, the new backward's, in their parameters' own
        format, so the backward accumulates into them as into any gradient, as under "32-true" (clipping done
        meanwhile is kept). A gradient zeroed or dropped since stays so."""
        self._show_clipping(prepared)
        rest = [p.grad for p in prepared.own_params if p.grad is not None]
        for i, (p, m, mg) in enumerate(zip(prepared.params, prepared.masters, prepared.master_grads)):
            m.grad = None
            g = p.grad
            if g is mg or (g is not None and _is_faithful_copy(prepared, i, g)):
                _carry(p, mg.mul_(scale).to(p.dtype))  # scaled before it is rounded, so small values survive
            elif g is not None:
                rest.append(g)
        if rest and scale != 1.0:
            _compat.foreach_mul_(rest, scale)

    @staticmethod
    def _show_clipping(prepared: PreparedGrads) -> None:
        """torch < 2.13: the half copies shown on the parameters learn of clipping done to the master gradients."""
        if _compat.GRAD_DTYPE:
            return
        for i, (shown, mg, v) in enumerate(zip(prepared.shown, prepared.master_grads, prepared.master_versions)):
            if _compat.version(mg) != v:
                shown.copy_(mg)
                prepared.master_versions[i] = _compat.version(mg)
                prepared.shown_versions[i] = _compat.version(shown)

    def discard(self, prepared: PreparedGrads) -> None:
        """A skipped step: drop every gradient it prepared, the parameters' own included."""
        for m in prepared.masters:
            m.grad = None
        for p in prepared.params:
            _carry(p, None)
        for p in prepared.own_params:
            p.grad = None

    def release_stepped(self, drop_module_grads: bool) -> None:
        """Release the fp32 gradients that the masters kept from the last step(s).

        ``drop_module_grads``: also drop them from the module's parameters (Lightning's automatic optimization zeroes
        them before the next backward anyway), so they do not add to the next forward's memory. Otherwise a
        parameter still holding an fp32 gradient gets it back in its own half format, so that the next backward
        (and DDP's reducer, which insists on the parameter's dtype) accumulates into it as usual.
        """
        for prepared in self._stepped:
            for p, m, mg in zip(prepared.params, prepared.masters, prepared.master_grads):
                m.grad = None
                g = p.grad
                if g is mg:
                    _carry(p, None if drop_module_grads else mg.to(p.dtype))
                elif g is None and _compat.GRAD_DTYPE and p.grad_dtype is None:
                    p.grad_dtype = (
                        p.dtype
                    )  # zero_grad dropped the fp32 gradient: autograd casts to the half format again
        self._stepped.clear()


class _MasterStateDictHook:
    """``state_dict`` post-hook of one module: its converted parameters are saved as their fp32 masters."""

    def __init__(self, owner: MasterWeights, names: list[str]) -> None:
        self.owner, self.names = owner, names

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name in self.names:
            key = prefix + name
            value = state_dict.get(key)
            if value is None or isinstance(value, nn.Parameter):  # keep_vars=True: leave the objects
                continue
            p = module.get_parameter(name)
            master = self.owner._masters.get(p)
            if master is not None:
                state_dict[key] = master.detach()
            elif p in self.owner._converted:
                state_dict[key] = value.float()

    def __deepcopy__(self, memo: dict[int, Any]) -> _MasterStateDictHook:
        # a deep copy of the module (e.g. an averaged model) shares the hook; its own parameters are not ours
        return self


class _MasterLoadHook:
    """``load_state_dict`` pre-hook of one module: loaded values go into the masters exactly.

    A parameter without a master (frozen at conversion) gets one when the loaded value is not a half-precision
    value: the checkpoint was saved after it was unfrozen, and resuming must continue from its exact master.
    """

    def __init__(self, owner: MasterWeights, names: list[str]) -> None:
        self.owner, self.names = owner, names

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        owner = self.owner
        for name in self.names:
            value = state_dict.get(prefix + name)
            p = module.get_parameter(name)
            if not isinstance(value, Tensor) or value.shape != p.shape:
                continue  # load_state_dict reports the mismatch
            master = owner._masters.get(p)
            with torch.no_grad():
                if master is not None:
                    master.copy_(value)
                elif (
                    owner.enabled
                    and value.dtype == torch.float32
                    and p in owner._converted
                    and not torch.equal(value, value.to(owner.dtype).float())
                ):
                    owner._add_master(p, value.to(p.device, copy=True))

    def __deepcopy__(self, memo: dict[int, Any]) -> _MasterLoadHook:
        return self


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


def _edited(params: list[Tensor], masters: list[Tensor], scratch: list[Tensor]) -> Tensor:
    """Per parameter, on the device: whether the half weight differs from its rounded master (cast and compare,
    in ``scratch``, which is overwritten)."""
    _compat.foreach_copy_(scratch, masters)  # the masters rounded to the half format
    if not params:
        return torch.zeros(0, dtype=torch.bool)
    if params[0].device.type == "cpu":
        # CPUs emulate half arithmetic (60 ms for 3.4M values) and pay per tensor in Python: one comparison of the
        # bit patterns of everything, a single flag; which parameters were edited is worked out only if one was
        flat = torch.cat([s.reshape(-1) for s in scratch]), torch.cat([p.detach().reshape(-1) for p in params])
        return _bits_differ(*flat).reshape(1)
    flags = torch.zeros(len(params), dtype=torch.bool, device=params[0].device)
    full = [i for i, t in enumerate(scratch) if t.numel()]  # an empty tensor cannot be edited (nor normed)
    if full:  # one fused launch per op: difference, then each tensor's largest
        _compat.foreach_sub_([scratch[i] for i in full], [params[i].detach() for i in full])
        changed = torch.stack(list(_compat.foreach_norm([scratch[i] for i in full], float("inf")))) != 0
        flags = (
            changed
            if len(full) == len(params)
            else flags.index_copy(0, torch.tensor(full, device=flags.device), changed)
        )
    return flags


def _which(pairs: list[tuple[Tensor, Tensor]], flags: list[float]) -> list[tuple[Tensor, Tensor]]:
    """The ``(half parameter, master)`` pairs that ``flags`` (host values of :func:`_edited`) mark as edited. A single
    flag for several pairs (CPU) says only that one was: each is compared then, which is rare."""
    if len(flags) == 1 < len(pairs):
        if not flags[0]:
            return []
        flags = [float(_bits_differ(m.to(p.dtype), p)) for p, m in pairs]
    return [pair for pair, f in zip(pairs, flags) if f]


def _bits_differ(a: Tensor, b: Tensor) -> Tensor:
    """Whether two half tensors of one shape differ in any bit (0-dim, on their device), compared as integers: as
    int64 words of four values where the layout allows, else value by value as int16."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    aligned = a.numel() % 4 == 0 and a.storage_offset() % 4 == 0 and b.storage_offset() % 4 == 0
    word = torch.int64 if aligned else torch.int16
    return torch.ne(a.view(word), b.view(word)).any()


def _rebuild_over_masters(optimizer: Optimizer, masters: dict[Tensor, Tensor]) -> Optional[Optimizer]:
    """The same optimizer constructed over the masters (its construction-time state then is exact fp32), or ``None``
    with a warning when its class cannot be constructed from its param groups alone."""
    groups = [{**g, "params": [masters.get(p, p) for p in g["params"]]} for g in optimizer.param_groups]
    try:  # torch's optimizers take their ``defaults`` as keyword arguments (Adagrad reads its accumulator from there)
        return type(optimizer)(groups, **optimizer.defaults)
    except Exception as err:  # a custom optimizer whose constructor takes other arguments
        warnings.warn(
            f"MPTPrecision: {type(optimizer).__name__} created state for half-precision parameters at construction, "
            f"and it could not be rebuilt over the fp32 masters ({type(err).__name__}: {err}); that state is cast to "
            "fp32 from its half-precision values. To keep it exact, let the optimizer create its state at the "
            "first step, or accept `params` and keyword arguments only in its constructor.",
            stacklevel=2,
        )
        return None


def _grad(p: Tensor) -> Tensor:
    """The gradient of a parameter known to have one."""
    g = p.grad
    if g is None:
        raise RuntimeError(f"MPTPrecision: a parameter of shape {tuple(p.shape)} lost its gradient during the step.")
    return g


def _carry(p: Tensor, grad: Optional[Tensor]) -> None:
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


def _castable(p: Tensor) -> bool:
    return p.dtype == torch.float32 or p.dtype in HALF_DTYPES


def _cast_inputs_to_weight(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    dtype = next(module.parameters()).dtype
    return _cast_floating(args, dtype), {k: _cast_floating(v, dtype) for k, v in kwargs.items()}


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast_floating(v, dtype) for v in x)
    return x


def _point(p: Tensor, data: Tensor, grad: Optional[Tensor]) -> None:
    """Make parameter ``p`` hold ``data`` (possibly of another dtype) and ``grad``, keeping its identity. Its
    ``grad_dtype`` is pinned to the new dtype: an earlier stage's restore pinned fp32 there (torch >= 2.13)."""
    p.grad = None
    if _compat.GRAD_DTYPE:
        p.grad_dtype = data.dtype
    p.data = data
    if grad is not None:
        p.grad = grad


def _params_of(optimizer: Optimizer) -> Iterator[Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


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


def _reparametrized(module: nn.Module) -> list[Tensor]:
    """The parameters of ``module`` that a legacy hook-based ``spectral_norm`` or ``weight_norm`` reparametrizes (the
    parametrize-based ones live in a ``ParametrizationList``)."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    names = []
    for hook in _compat.forward_pre_hooks(module):
        if isinstance(hook, SpectralNorm):
            names.append(hook.name + "_orig")
        elif isinstance(hook, WeightNorm):
            names += [hook.name + "_g", hook.name + "_v"]
    return [p for n, p in module.named_parameters(recurse=False) if n in names]


def _is_faithful_copy(prepared: PreparedGrads, i: int, grad: Tensor) -> bool:
    """torch < 2.13: whether ``grad`` is the half copy of master gradient ``i`` shown on its parameter, untouched
    since it was written (so the master gradient holds the same values, unrounded)."""
    return not _compat.GRAD_DTYPE and grad is prepared.shown[i] and _compat.version(grad) == prepared.shown_versions[i]


def _not_half(module: nn.Module, kept: set[int], dtype: torch.dtype) -> set[Tensor]:
    """The frozen fp32 parameters of ``module`` (outside ``kept``) whose values ``dtype`` cannot hold (one host
    sync)."""
    frozen = list({
        p: None for p in module.parameters() if not p.requires_grad and id(p) not in kept and p.dtype == torch.float32
    })
    if not frozen:
        return set()
    flags = torch.stack([torch.ne(p.detach(), p.detach().to(dtype).float()).any() for p in frozen]).tolist()
    return {p for p, differs in zip(frozen, flags) if differs}
