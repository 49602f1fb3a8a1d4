"""Setting a module up for fp32 masters: which parameters to cast, the hooks that make its checkpoints hold the
masters, the legacy reparametrizations and the modules autocast does not cover. Used by
:class:`~lightning_mpt.core.masters.copies.CopyMasters` and its subclasses (through :class:`ConvertedMasters`) at
set-up, not during a step."""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrize import ParametrizationList
from torch.optim import Optimizer

from lightning_mpt import _compat
from lightning_mpt.core.masters import HALF_DTYPES


class ConvertedMasters(Protocol):
    """What set-up and the checkpoint hooks need of the masters that convert a module (the copies, chunked or
    stored as remainders): the parameters cast and their masters, and the master's value in and out of a checkpoint."""

    dtype: torch.dtype
    enabled: bool
    keep_fp32: tuple[type[nn.Module], ...]
    names: dict[Tensor, str]
    converted: dict[Tensor, None]
    masters: dict[Tensor, Tensor]

    def add_master(self, param: Tensor, master: Tensor) -> None: ...

    def saved_master(self, param: Tensor) -> Optional[Tensor]: ...

    def load_master(self, param: Tensor, value: Tensor) -> Optional[Tensor]: ...

    def absorb_all_edits(self) -> list[str]: ...


# modules with parameters whose ops torch.autocast does not cover: their floating inputs (positional and keyword)
# are cast to the weights' dtype. Found by running every nn module with half weights under CPU and CUDA autocast.
AUTOCAST_UNCOVERED = (nn.Bilinear, nn.RNNBase, nn.RNNCellBase, nn.EmbeddingBag, nn.AdaptiveLogSoftmaxWithLoss)


def castable(p: Tensor) -> bool:
    return p.dtype == torch.float32 or p.dtype in HALF_DTYPES


def cast_inputs_to_weight(
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


def retype(p: Tensor, data: Tensor, grad: Optional[Tensor]) -> None:
    """Make parameter ``p`` hold ``data`` (possibly of another dtype) and ``grad``, keeping its identity. Its
    ``grad_dtype`` is ``None`` (torch >= 2.13): it holds its fp32 gradient at the step, and a backward accumulates in
    the dtype the gradient has (its half format, computed so; fp32 where ``accumulate_fp32`` put fp32 zeros), so
    nothing switches it from step to step."""
    p.grad = None
    if _compat.GRAD_DTYPE:
        p.grad_dtype = None
    p.data = data
    if grad is not None:
        p.grad = grad


def reparametrized(module: nn.Module) -> list[Tensor]:
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


def trained_frozen(module: nn.Module, kept: set[int], dtype: torch.dtype) -> set[Tensor]:
    """The frozen fp32 parameters of ``module`` (outside ``kept``) whose values ``dtype`` cannot hold: trained before,
    in an earlier part of a resumed run (one host sync)."""
    frozen = list({
        p: None for p in module.parameters() if not p.requires_grad and id(p) not in kept and p.dtype == torch.float32
    })
    if not frozen:
        return set()
    flags = torch.stack([torch.ne(p.detach(), p.detach().to(dtype).float()).any() for p in frozen]).tolist()
    return {p for p, differs in zip(frozen, flags) if differs}


def convert_module(owner: ConvertedMasters, module: nn.Module, restored: bool) -> list[Any]:
    """Cast ``module``'s castable parameters to ``owner``'s half format in place, make their masters (see
    :meth:`CopyMasters.convert`), and register the hooks that save and load the masters; returns their handles."""
    lazy = [name for name, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"MPTPrecision cannot take fp32 masters of parameters that do not exist yet: {', '.join(lazy[:5])} "
            f"{'is an uninitialized parameter' if len(lazy) == 1 else f'are {len(lazy)} uninitialized parameters'} "
            "of a lazy module (nn.LazyLinear, ...). Run one forward pass with an example batch before the model is set "
            "up (in the LightningModule's `__init__` or `setup()`, or before `fabric.setup`), so that they have their "
            "shapes and values."
        )
    kept = {id(p) for m in module.modules() if isinstance(m, owner.keep_fp32) for p in m.parameters()}
    if ParametrizationList in owner.keep_fp32:
        kept |= {id(p) for m in module.modules() for p in reparametrized(m)}
    owner.names = {p: name for name, p in module.named_parameters()}
    trained = trained_frozen(module, kept, owner.dtype) if restored and owner.enabled else set()
    owners: dict[nn.Module, list[str]] = defaultdict(list)
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in kept or not castable(p):
                continue
            owners[mod].append(name)  # every name of a shared parameter: each must save the master
            if p in owner.converted:
                continue
            master = p.data if p.dtype == torch.float32 else p.data.float()
            grad = p.grad
            retype(p, master.to(owner.dtype), None if grad is None else grad.to(owner.dtype))
            owner.converted[p] = None
            if owner.enabled and (p.requires_grad or p in trained):
                owner.add_master(p, master)
    handles = [module.register_state_dict_pre_hook(EditsBeforeSaving(owner))]
    for mod, names in owners.items():
        handles.append(_compat.register_state_dict_post_hook(mod, MasterStateDictHook(owner, names)))
        handles.append(_compat.register_load_state_dict_pre_hook(mod, MasterLoadHook(owner, names)))
        if isinstance(mod, AUTOCAST_UNCOVERED):
            handles.append(mod.register_forward_pre_hook(cast_inputs_to_weight, with_kwargs=True))
    return handles


def restore_module(owner: ConvertedMasters) -> None:
    """Give ``owner``'s converted parameters fp32 tensors again: their masters (a parameter without one, or whose
    data other code replaced, takes its current value in fp32), with their gradients in fp32."""
    for p in owner.converted:
        master = owner.masters.get(p)
        data = p.data
        if master is None or data.dtype != owner.dtype:
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


def exact_state(optimizer: Optimizer, masters: dict[Tensor, Tensor], dtype: torch.dtype) -> None:
    """Make the state ``optimizer`` built at construction for half parameters (Adagrad's accumulator, computed in
    half precision) exact fp32: rebuilt by constructing the same optimizer over the masters."""
    rounded = [
        (p, k)
        for group in optimizer.param_groups
        for p in group["params"]
        if p in masters
        for k, v in optimizer.state.get(p, {}).items()
        if isinstance(v, Tensor) and v.dtype == dtype
    ]
    if rounded:
        fresh = rebuild_over_masters(optimizer, masters)
        for p, k in rounded:
            exact = None if fresh is None else fresh.state.get(masters[p], {}).get(k)
            optimizer.state[p][k] = exact if isinstance(exact, Tensor) else optimizer.state[p][k].float()


def rebuild_over_masters(optimizer: Optimizer, masters: dict[Tensor, Tensor]) -> Optional[Optimizer]:
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


class MasterStateDictHook:
    """``state_dict`` post-hook of one module: its converted parameters are saved as their fp32 masters."""

    def __init__(self, owner: ConvertedMasters, names: list[str]) -> None:
        self.owner, self.names = owner, names

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name in self.names:
            key = prefix + name
            value = state_dict.get(key)
            if value is None or isinstance(value, nn.Parameter):  # keep_vars=True: leave the objects
                continue
            p = module.get_parameter(name)
            master = self.owner.saved_master(p)
            if master is not None:
                state_dict[key] = master.detach()
            elif p in self.owner.converted:
                state_dict[key] = value.float()

    def __deepcopy__(self, memo: dict[int, Any]) -> MasterStateDictHook:
        # a deep copy of the module (e.g. an averaged model) shares the hook; its own parameters are not ours
        return self


class MasterLoadHook:
    """``load_state_dict`` pre-hook of one module: loaded values go into the masters exactly.

    A parameter without a master (frozen at conversion) gets one when the loaded value is not a half-precision
    value: the checkpoint was saved after it was unfrozen, and resuming must continue from its exact master.
    """

    def __init__(self, owner: ConvertedMasters, names: list[str]) -> None:
        self.owner, self.names = owner, names

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        owner = self.owner
        for name in self.names:
            value = state_dict.get(prefix + name)
            p = module.get_parameter(name)
            if not isinstance(value, Tensor) or value.shape != p.shape:
                continue  # load_state_dict reports the mismatch
            with torch.no_grad():
                if p in owner.masters:
                    half = owner.load_master(p, value)
                    if half is not None:  # the half weight the master's storage rests on, for the module to load
                        state_dict[prefix + name] = half
                elif (
                    owner.enabled
                    and value.dtype == torch.float32
                    and p in owner.converted
                    and not torch.equal(value, value.to(owner.dtype).float())
                ):
                    owner.add_master(p, value.to(p.device, copy=True))

    def __deepcopy__(self, memo: dict[int, Any]) -> MasterLoadHook:
        return self


class EditsBeforeSaving:
    """``state_dict`` pre-hook of the converted module: edits of its half weights go into the masters first, so a
    checkpoint written after a hook clamped the weights holds the clamped values."""

    def __init__(self, owner: ConvertedMasters) -> None:
        self.owner = owner

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not keep_vars:
            self.owner.absorb_all_edits()

    def __deepcopy__(self, memo: dict[int, Any]) -> EditsBeforeSaving:
        return self
