"""FP32 master weights for a module whose parameters live in half precision (pure torch, no Lightning).

Life cycle, driven by :class:`~lightning_mpt.MPTPrecision`:

1. :meth:`MasterWeights.convert` keeps each parameter's fp32 tensor as its master (no copy, so a master is never a
   rounded half value) and gives the parameter a new half-precision tensor. Modules of ``keep_fp32`` types keep
   fp32 parameters, which are their own masters.
2. :meth:`MasterWeights.prepare` copies the half gradients into fresh fp32 master gradients and unscales them
   with torch's fused AMP kernel (non-finite check included, no host sync).
3. :meth:`MasterWeights.enter` puts the masters into the optimizer's ``param_groups`` (its state follows them)
   for clipping and ``optimizer.step()``, and, where torch allows a gradient of another dtype
   (``Tensor.grad_dtype``), shows the fp32 master gradients on the module's parameters too, so clipping hooks that
   walk ``module.parameters()`` act on what gets stepped. :meth:`MasterWeights.exit` undoes that and refreshes the
   half weights from the masters in one foreach copy. The parameters' data never changes dtype during training:
   that would reset their autograd gradient accumulators and detach DDP's hooks.
4. :meth:`MasterWeights.restore` gives the module its fp32 masters back.

While converted, ``module.state_dict()`` returns the masters and ``module.load_state_dict()`` writes them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_mpt.numerics import max_abs

# parameters of these modules stay fp32: normalisation statistics and affine parameters are precision-sensitive
DEFAULT_KEEP_FP32: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm* and their lazy variants
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)

# modules with parameters whose ops torch.autocast does not cover: their floating inputs are cast to the weights
_AUTOCAST_UNCOVERED = (nn.Bilinear, nn.RNNBase)

HALF_DTYPES = (torch.float16, torch.bfloat16)

# torch >= 2.13 lets a parameter hold a gradient of another dtype (``Tensor.grad_dtype = None``). A dtype set
# there stays pinned, so converted parameters get ``None`` once and keep it: gradients of any dtype are accepted.
_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")


@dataclass
class PreparedGrads:
    """The gradients of one optimizer, unscaled into fp32, waiting for the step."""

    params: list[Tensor] = field(default_factory=list)  # module parameters that have a separate master
    masters: list[Tensor] = field(default_factory=list)
    master_grads: list[Tensor] = field(default_factory=list)
    half_grads: list[Tensor] = field(default_factory=list)
    own_params: list[Tensor] = field(default_factory=list)  # parameters that are their own master (fp32)
    found_inf: Optional[Tensor] = None  # 0-dim, > 0 when a gradient was non-finite; None when no gradients
    entered: bool = False  # whether the optimizer holds the masters now
    half_versions: list[int] = field(default_factory=list)  # of the half grads as written, to notice edits by hooks
    master_versions: list[int] = field(default_factory=list)  # of the master grads at enter, to notice clipping

    def all_params(self) -> list[Tensor]:
        return self.params + self.own_params

    def fp32_grads(self) -> list[Tensor]:
        return self.master_grads + [p.grad for p in self.own_params]

    def nonfinite_mask(self) -> Optional[Tensor]:
        """Per-parameter flags (aligned with :meth:`all_params`) of non-finite gradients, on device, no sync."""
        grads = self.fp32_grads()
        return ~torch.isfinite(max_abs(grads)) if grads else None


@dataclass
class _Plan:
    key: tuple  # (id, length) of each group's parameter list when the plan was made
    slots: list[tuple[list, int, Tensor, Tensor]] = field(default_factory=list)  # (group list, index, param, master)
    own: list[Tensor] = field(default_factory=list)  # parameters that are their own master
    device: Optional[torch.device] = None  # the one device all of them live on, if there is one


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
    def convert(self, module: nn.Module) -> nn.Module:
        """Cast ``module``'s parameters to half precision in place, keeping the fp32 tensors as masters."""
        if self._converted:
            self.restore()
        kept = {id(p) for m in module.modules() if isinstance(m, self.keep_fp32) for p in m.parameters()}
        self._names = {p: name for name, p in module.named_parameters()}
        owners: dict[nn.Module, list[str]] = defaultdict(list)
        for mod in module.modules():
            for name, p in mod.named_parameters(recurse=False):
                if id(p) in kept or p in self._converted or not _castable(p):
                    continue
                owners[mod].append(name)
                master = p.data if p.dtype == torch.float32 else p.data.float()
                grad = p.grad
                _point(p, master.to(self.dtype), None if grad is None else grad.to(self.dtype))
                if _GRAD_DTYPE:
                    p.grad_dtype = None  # may carry its fp32 master gradient while clipping (see enter())
                self._converted[p] = None
                if self.enabled:
                    self._masters[p] = master
                    self._param_of[master] = p
        for mod, names in owners.items():
            self._handles.append(mod._register_state_dict_hook(_MasterStateDictHook(self, names)))
            self._handles.append(
                mod._register_load_state_dict_pre_hook(_MasterLoadHook(self, names), with_module=True)
            )
            if isinstance(mod, _AUTOCAST_UNCOVERED):
                self._handles.append(mod.register_forward_pre_hook(_cast_inputs_to_weight))
        return module

    def restore(self) -> None:
        """Give the converted parameters fp32 tensors again: their masters, or the values that other code wrote.

        A half weight that no longer equals its rounded master was written from outside the optimizer step (for
        example by a weight-averaging callback at the end of fit); it is taken as is.
        """
        for h in self._handles:
            h.remove()
        self._handles.clear()
        last_half_grad = {p: g for prepared in self._stepped for p, g in zip(prepared.params, prepared.half_grads)}
        for p in self._converted:
            master = self._masters.get(p)
            data = p.data
            if master is None or data.dtype != self.dtype or not torch.equal(data, master.to(data.device, data.dtype)):
                master = data.float()
            grad = p.grad
            if grad is not None and grad is last_half_grad.get(p) and master.grad is not None:
                grad = master.grad  # the exact fp32 gradient of the last step
            p.grad = None
            p.data = master.to(data.device)
            if grad is not None:
                p.grad = grad.float()
            master.grad = None
        self._converted.clear()
        self._masters.clear()
        self._param_of.clear()
        self._plans.clear()
        self._stepped.clear()

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
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2 or not self._masters:
            return
        masters = list(self._masters.values())
        for group in _by_device(masters).values():
            flat = torch._utils._flatten_dense_tensors(group)
            dist.broadcast(flat, src=src)
            torch._foreach_copy_(group, torch._utils._unflatten_dense_tensors(flat, group))
        self.refresh()

    def refresh(self) -> None:
        """Write the masters into the half weights."""
        _write_halves(list(self._masters), list(self._masters.values()))

    def adopt_optimizer(self, optimizer: Optimizer) -> list[RemovableHandle]:
        """Keep ``optimizer``'s state fp32: cast state it created for half parameters (Adagrad does so at
        construction) and let ``load_state_dict`` see the masters, since torch casts loaded state to the dtype of
        the parameters it finds in ``param_groups``."""
        for p in _params_of(optimizer):
            master = self._masters.get(p)
            if master is None:
                continue
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, Tensor) and v.dtype == self.dtype and v.shape == p.shape:
                    optimizer.state[p][k] = v.to(master.dtype)
        return [
            optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: self.swap_groups(opt, True)),
            optimizer.register_load_state_dict_post_hook(lambda opt: self.swap_groups(opt, False)),
        ]

    def swap_groups(self, optimizer: Optimizer, to_masters: bool) -> None:
        """Put the masters (or back the parameters) into ``optimizer.param_groups``, in place, with their state.

        In place, because optimizers such as LBFGS keep a reference to the group's list.
        """
        state = optimizer.state
        for params, i, p, m in self._plan(optimizer).slots:
            x, y = (p, m) if to_masters else (m, p)
            params[i] = y
            st = state.pop(x, None)
            if st is not None:
                state[y] = st

    def _plan(self, optimizer: Optimizer) -> _Plan:
        """Where ``optimizer``'s parameters with masters sit in its groups; rebuilt when the groups change."""
        key = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        plan = self._plans.get(optimizer)
        if plan is None or plan.key != key:
            plan = _Plan(key)
            for group in optimizer.param_groups:
                params = group["params"]
                for i, x in enumerate(params):
                    p = self._param_of.get(x, x)  # the groups may hold the masters right now
                    m = self._masters.get(p)
                    if m is None:
                        plan.own.append(p)
                    else:
                        plan.slots.append((params, i, p, m))
            devices = {p.device for p in plan.own} | {m.device for *_, m in plan.slots}
            plan.device = devices.pop() if len(devices) == 1 else None
            self._plans[optimizer] = plan
        return plan

    # ------------------------------------------------------------------ the optimizer step
    def prepare(self, optimizer: Optimizer, scale: float) -> PreparedGrads:
        """Copy ``optimizer``'s half gradients into fp32 master gradients and unscale everything by ``1/scale``.

        Gradients of fp32 parameters are unscaled in place. The half ``.grad`` receives the unscaled values too, so
        hooks that read ``param.grad`` see true gradients. No host sync: ``found_inf`` stays on the device.
        """
        out = PreparedGrads()
        plan = self._plan(optimizer)
        for _, _, p, master in plan.slots:
            g = p.grad
            if g is not None:
                out.params.append(p)
                out.masters.append(master)
                out.half_grads.append(g)
        out.own_params = [p for p in plan.own if p.grad is not None]
        if any(g.is_sparse for g in out.half_grads) or any(p.grad.is_sparse for p in out.own_params):
            raise RuntimeError("MPTPrecision does not support sparse gradients; use dense embeddings (sparse=False).")
        out.master_grads = [torch.empty_like(m) for m in out.masters]
        if out.masters:
            torch._foreach_copy_(out.master_grads, out.half_grads)
        out.found_inf = _unscale_(out.fp32_grads(), 1.0 / scale, plan.device)
        if scale != 1.0 and out.half_grads:
            torch._foreach_copy_(out.half_grads, out.master_grads)
        out.half_versions = [g._version for g in out.half_grads]
        for m, g in zip(out.masters, out.master_grads):
            m.grad = g
        return out

    def sync_edits(self, prepared: PreparedGrads) -> None:
        """Copy into the master gradients the half gradients that hooks changed (in place or by assignment) since
        :meth:`prepare` wrote them: what the user edited is what gets stepped."""
        for i, (p, g, v) in enumerate(zip(prepared.params, prepared.half_grads, prepared.half_versions)):
            now, master_grad = p.grad, prepared.master_grads[i]
            if now is master_grad or (now is g and g._version == v):
                continue
            if now is None:
                master_grad.zero_()
            else:
                master_grad.copy_(now)
            if now is g:
                prepared.half_versions[i] = g._version

    def enter(self, optimizer: Optimizer, prepared: PreparedGrads, show_on_module: bool) -> None:
        """Hand the masters to ``optimizer`` for clipping and its step.

        ``show_on_module``: also let the module's parameters carry their fp32 master gradients until :meth:`exit`,
        for user code that walks ``module.parameters()`` meanwhile (torch >= 2.13 only, see ``_GRAD_DTYPE``).
        """
        self.sync_edits(prepared)
        self.swap_groups(optimizer, True)
        if show_on_module and _GRAD_DTYPE:
            for p, g in zip(prepared.params, prepared.master_grads):
                p.grad = g
        prepared.master_versions = [g._version for g in prepared.master_grads]
        prepared.entered = True

    def exit(self, optimizer: Optimizer, prepared: PreparedGrads, stepped: bool) -> None:
        """Give ``optimizer`` its parameters back and refresh the half weights from the masters.

        The half gradients show what was stepped (clipped values included). After a step (``stepped``) each master
        keeps the fp32 gradient it was stepped with until :meth:`drop_stepped_grads`: the plugin drops them when the
        next forward starts, so they never add to the activation peak.
        """
        self.swap_groups(optimizer, False)
        for p, m, g, mg, v in zip(
            prepared.params, prepared.masters, prepared.half_grads, prepared.master_grads, prepared.master_versions
        ):
            if p.grad is mg:
                p.grad = g
            if mg._version != v:  # clipped or edited while entered
                g.copy_(mg)
            if not stepped:
                m.grad = None
        if stepped:
            self._stepped.append(prepared)
        _write_halves(prepared.params, prepared.masters)
        prepared.entered = False

    def drop_stepped_grads(self) -> None:
        """Release the fp32 gradients that the masters kept from the last step(s)."""
        for prepared in self._stepped:
            MasterWeights.release(prepared, clear_grads=False)
        self._stepped.clear()

    @staticmethod
    def release(prepared: PreparedGrads, clear_grads: bool) -> None:
        """Drop the fp32 master gradients; with ``clear_grads`` also the parameters' own gradients."""
        for m in prepared.masters:
            m.grad = None
        if clear_grads:
            for p in prepared.all_params():
                p.grad = None


class _MasterStateDictHook:
    """``state_dict`` hook of one module: its converted parameters are saved as their fp32 masters."""

    def __init__(self, owner: MasterWeights, names: list[str]) -> None:
        self.owner, self.names = owner, names

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name in self.names:
            key, p = prefix + name, module._parameters.get(name)
            value = state_dict.get(key)
            if p is None or value is None or isinstance(value, nn.Parameter):  # keep_vars=True: leave the objects
                continue
            master = self.owner._masters.get(p)
            if master is not None:
                state_dict[key] = master.detach()
            elif p in self.owner._converted:
                state_dict[key] = value.float()

    def __deepcopy__(self, memo: dict) -> _MasterStateDictHook:
        # a deep copy of the module (e.g. an averaged model) shares the hook; its own parameters are not ours
        return self


class _MasterLoadHook:
    """``load_state_dict`` pre-hook of one module: loaded values go into the masters exactly."""

    def __init__(self, owner: MasterWeights, names: list[str]) -> None:
        self.owner, self.names = owner, names

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name in self.names:
            p, value = module._parameters.get(name), state_dict.get(prefix + name)
            master = self.owner._masters.get(p) if p is not None else None
            if master is not None and isinstance(value, Tensor) and value.shape == master.shape:
                with torch.no_grad():
                    master.copy_(value)

    def __deepcopy__(self, memo: dict) -> _MasterLoadHook:
        return self


def _write_halves(params: list[Tensor], masters: list[Tensor]) -> None:
    """Round the masters into their half parameters, in one foreach copy."""
    if params:
        with torch.no_grad():
            torch._foreach_copy_(params, masters)


def _castable(p: Tensor) -> bool:
    return p.dtype == torch.float32 or p.dtype in HALF_DTYPES


def _cast_inputs_to_weight(module: nn.Module, args: tuple) -> tuple:
    return _cast_floating(args, next(module.parameters()).dtype)


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, tuple):
        return tuple(_cast_floating(v, dtype) for v in x)
    return x


def _point(p: Tensor, data: Tensor, grad: Optional[Tensor]) -> None:
    """Make parameter ``p`` hold ``data`` (possibly of another dtype) and ``grad``, keeping its identity."""
    p.grad = None
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
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, torch.full((), inv_scale, device=dev))
        found = found_inf if found is None else found + found_inf.to(found.device)
    return found
