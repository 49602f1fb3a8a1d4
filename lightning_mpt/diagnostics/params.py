"""Which parameters the diagnostics measure, and how their gradients and masters are gathered.

Example:
    ```python
    from types import SimpleNamespace

    from torch import nn
    from lightning_mpt.diagnostics.params import ParamTable, group_parameters

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    autocast = SimpleNamespace(precision="bf16-mixed")   # Lightning's MixedPrecision, by duck typing
    assert ParamTable(model, autocast).names == ["0.weight", "0.bias"]   # norm layers stay fp32
    assert [key for key, _ in group_parameters(model.named_parameters(), "module")] == ["0", "1"]
    ```
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor, nn

from lightning_mpt.core.masters import DEFAULT_KEEP_FP32, HALF_DTYPES
from lightning_mpt.diagnostics.plugin import has_masters
from lightning_mpt.diagnostics.shards import Shards, is_dtensor, local_tensor

GroupBy = Literal["parameter", "module"]
GROUPINGS: tuple[GroupBy, ...] = ("parameter", "module")
#: ``(histogram name, [(parameter name, parameter), ...])``: the parameters drawn together
Group = tuple[str, list[tuple[str, Tensor]]]


class ParamTable:
    """The parameters computed in the half format, in ``named_parameters()`` order.

    Under a plugin with masters (``MPTPrecision``) these are the parameters it cast to fp16/bf16 (norm layers stay
    fp32 and are left out). Under Lightning's autocast precisions every parameter is fp32, and the gradients of the
    layers that autocast runs in half precision are formed from half-precision values: all floating-point
    parameters except those of norm layers.

    **FSDP2** (``shards`` given): the parameters are fp32 ``DTensor`` shards, which are the masters; a parameter is in
    the table when its ``fully_shard`` group all-gathers it in the half format. :meth:`grads` and :meth:`masters` then
    give this process's shards (empty where another process counts a replicated shard, see :meth:`Shards.owns`).
    """

    def __init__(self, module: nn.Module, plugin: Any, shards: Optional[Shards] = None) -> None:
        masters = has_masters(plugin)
        kept = {id(p) for m in module.modules() if isinstance(m, DEFAULT_KEEP_FP32) for p in m.parameters()}
        compute: dict[str, torch.dtype] = {}
        if shards is not None and masters:
            from lightning_mpt.core.masters.sharded import compute_dtypes

            compute = compute_dtypes(module)
        self.shards = shards
        self.names: list[str] = []
        self.params: list[Tensor] = []
        for name, p in module.named_parameters():
            if shards is not None and masters:
                half = compute.get(name, p.dtype) in HALF_DTYPES
            else:
                half = (p.dtype in HALF_DTYPES) if masters else (p.is_floating_point() and id(p) not in kept)
            if half:
                self.names.append(name)
                self.params.append(p)
        self._owned = [shards is None or shards.owns(p) for p in self.params]

    def __len__(self) -> int:
        return len(self.params)

    def grads(self) -> list[Optional[Tensor]]:
        """Each parameter's gradient as stored (this process's shard under FSDP2), ``None`` where it has none."""
        if self.shards is None:
            return [p.grad for p in self.params]
        return [None if p.grad is None else _owned(p.grad, own) for p, own in zip(self.params, self._owned)]

    def masters(self, plugin: Any) -> list[Optional[Tensor]]:
        """The fp32 tensor the optimizer steps for each parameter, ``None`` where the half tensor is stepped itself
        (``MPTPrecision(master_weights=False)``, ``"16-true"``). Under FSDP2 the fp32 shards."""
        if self.shards is not None:
            return [_owned(p, own) if p.dtype == torch.float32 else None for p, own in zip(self.params, self._owned)]
        if has_masters(plugin):
            return [m if m is not p else None for p, m in ((p, plugin.master_of(p)) for p in self.params)]
        return [p if p.dtype == torch.float32 else None for p in self.params]

    def full_weights(self, module: nn.Module) -> dict[str, Tensor]:
        """The whole fp32 tensors of the sharded (``DTensor``) parameters of ``module`` by name, detached: those of the
        table (the masters FSDP2 steps), then the others (norm layers sharded in fp32) in ``named_parameters()``
        order; empty without sharded parameters. Each is a collective (``DTensor.full_tensor()``, an all-gather):
        every process must call it at the same time with the same module."""
        found = [(n, p) for n, p in zip(self.names, self.params) if is_dtensor(p)]
        named = set(self.names)
        found += [(n, p) for n, p in module.named_parameters() if is_dtensor(p) and n not in named]
        with torch.no_grad():
            return {n: p.full_tensor().detach() for n, p in found}  # type: ignore[attr-defined]  # a DTensor method


def _owned(t: Tensor, own: bool) -> Tensor:
    local = local_tensor(t)
    return local if own else local.new_empty(0)


def module_name(param_name: str) -> str:
    """``"encoder.0.linear.weight"`` -> ``"encoder.0.linear"``; a parameter of the root module -> ``"(root)"``."""
    owner, _, _ = param_name.rpartition(".")
    return owner or "(root)"


def group_key(param_name: str, group_by: GroupBy) -> str:
    """The name of the histogram that draws ``param_name``: the parameter's own, or its module's."""
    return param_name if group_by == "parameter" else module_name(param_name)


def group_parameters(named: Iterable[tuple[str, Tensor]], group_by: GroupBy) -> list[Group]:
    """The parameters drawn together, in order of first appearance: one group per parameter, or per module."""
    groups: dict[str, list[tuple[str, Tensor]]] = {}
    for name, p in named:
        groups.setdefault(group_key(name, group_by), []).append((name, p))
    return list(groups.items())


def true_gradients(plugin: Any, groups: Sequence[Group], shards: Optional[Shards] = None) -> list[list[Tensor]]:
    """The true (unscaled) gradients of each group's parameters after the plugin unscaled them: the masters' fp32
    gradients under ``MPTPrecision`` (with ``chunked_step``, the half gradients unscaled into fp32 here, as the step
    will), ``.grad`` otherwise; this process's shards under FSDP2 (:meth:`Shards.owns`).
    A parameter without one is left out."""
    masters = has_masters(plugin)
    out = []
    for _, members in groups:
        grads = []
        for _, p in members:
            m = plugin.master_of(p) if masters else p
            g = m.grad if m.grad is not None else p.grad
            if g is not None and m is not p and m.grad is None:  # a chunked step: the half gradient, still scaled
                g = g.float() * (1.0 / plugin.backward_scale)
            if g is not None and (shards is None or shards.owns(p)):
                grads.append(local_tensor(g))
        out.append(grads)
    return out


def stored_gradients(groups: Sequence[Group], shards: Optional[Shards] = None) -> list[list[Tensor]]:
    """Each group's gradients as the backward stored them (scaled; this process's shards under FSDP2)."""
    return [
        [local_tensor(p.grad) for _, p in members if p.grad is not None and (shards is None or shards.owns(p))]
        for _, members in groups
    ]
