"""Where an optimizer's parameters with masters sit in its ``param_groups``, and the swap that hands it the masters
for its step (and the parameters back after it). Swapped in place, because optimizers such as LBFGS keep a reference
to a group's list; the optimizer's state follows its keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpt.core.masters._flat import FlatLayouts


@dataclass
class GroupPlan:
    key: tuple[tuple[int, int], ...]  # (id, length) of each group's parameter list when the plan was made
    own: list[Tensor] = field(default_factory=list)  # parameters that are their own master
    frozen: list[Tensor] = field(default_factory=list)  # those of them that are half: frozen when converted
    device: Optional[torch.device] = None  # the one device all of them live on, if there is one
    # per group: (its parameter list, its entries as parameters, its entries as masters), for one-call swaps
    groups: list[tuple[list[Tensor], list[Tensor], list[Tensor]]] = field(default_factory=list)
    pairs: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (parameter, master) of every slot


class GroupSwap:
    """The :class:`GroupPlan` of each optimizer (rebuilt when its groups change) and the swap of its entries.

    Args:
        masters: parameter -> fp32 master, kept up to date by the owner (:meth:`invalidate` after a change).
        converted: the parameters given a half tensor (those without a master are frozen ones).

    Example:
        ```python
        w, m = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)), torch.zeros(2)
        opt = torch.optim.SGD([w], lr=0.1)
        swap = GroupSwap({w: m}, {w: None})
        swap.swap(opt, to_masters=True)
        assert opt.param_groups[0]["params"][0] is m
        swap.swap(opt, to_masters=False)
        assert opt.param_groups[0]["params"][0] is w
        ```
    """

    def __init__(self, masters: dict[Tensor, Tensor], converted: dict[Tensor, None]) -> None:
        self.masters = masters
        self.converted = converted
        self._plans: dict[Optimizer, GroupPlan] = {}
        self._param_of: dict[Tensor, Tensor] = {}  # master -> parameter: the groups may hold the masters right now
        self.layouts = FlatLayouts()  # of the masters' fp32 gradients, one per range of an optimizer's masters

    def invalidate(self) -> None:
        """The masters changed (made, moved, dropped): plans are rebuilt at their next use."""
        self._plans.clear()
        self.layouts.clear()  # it keeps the masters it was made for
        self._param_of = {m: p for p, m in self.masters.items()}

    def swap(self, optimizer: Optimizer, to_masters: bool) -> None:
        """Put the masters (or back the parameters) into ``optimizer.param_groups``, in place, with their state.

        In place, because optimizers such as LBFGS keep a reference to the group's list.
        """
        plan = self.plan(optimizer)
        for params, mine, masters in plan.groups:
            params[:] = masters if to_masters else mine  # one slice assignment per group
        state, pop = optimizer.state, optimizer.state.pop
        for p, m in plan.pairs:  # one hash each way: Tensor.__hash__ is a Python call
            x, y = (p, m) if to_masters else (m, p)
            moved = pop(x, None)
            if moved is not None:
                state[y] = moved

    def plan(self, optimizer: Optimizer) -> GroupPlan:
        """Where ``optimizer``'s parameters with masters sit in its groups; rebuilt when the groups change."""
        key = tuple([(id(g["params"]), len(g["params"])) for g in optimizer.param_groups])
        plan = self._plans.get(optimizer)
        if plan is None or plan.key != key:
            plan = GroupPlan(key)
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
            plan.frozen = [p for p in plan.own if p in self.converted]  # half, without a master
            devices = {p.device for p in plan.own} | {m.device for _, m in plan.pairs}
            plan.device = devices.pop() if len(devices) == 1 else None
            self._plans[optimizer] = plan
        return plan
