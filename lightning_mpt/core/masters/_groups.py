"""Where an optimizer's parameters with masters sit in its ``param_groups``, and the swap that hands it the masters
for its step (and the parameters back after it). Swapped in place, because optimizers such as LBFGS keep a reference
to a group's list; the optimizer's state follows its keys."""

from __future__ import annotations

import copy
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

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
    params: list[Tensor] = field(default_factory=list)  # the pairs' parameters
    masters: list[Tensor] = field(default_factory=list)  # and their masters
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # budget -> index ranges of ``params``


class _ByMasters(defaultdict):  # type: ignore[type-arg]
    """An optimizer's state keyed by the masters, for its step. A module parameter used as a key stands for its master
    (a step hook that closes over the model's parameters addresses the state so, as it would without masters): it
    reads, writes, deletes and finds the master's entry, and reading it never leaves an empty entry under its name.

    Args:
        default_factory: as :class:`~collections.defaultdict`'s (torch's optimizers: ``dict``).
        masters: parameter -> master.

    Example:
        ```python
        p, m = torch.zeros(1), torch.zeros(1)
        state = _ByMasters(dict, {p: m})
        state[m]["step"] = 1
        assert state[p] is state[m] and p in state and len(state) == 1
        ```
    """

    def __init__(self, default_factory: Any = None, masters: Optional[dict[Tensor, Tensor]] = None) -> None:
        super().__init__(default_factory)
        self.masters = {} if masters is None else masters

    def __missing__(self, key: Any) -> Any:
        master = self.masters.get(key)
        return self[master] if master is not None else super().__missing__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(self.masters.get(key, key), value)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(self.masters.get(key, key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(self.masters.get(key, key))  # type: ignore[call-overload]

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self.masters.get(key, key), default)


@dataclass
class _StateMirror:
    """An optimizer's state twice: its own dict keyed by the parameters, and ours keyed by the masters, holding the
    same entries (each parameter's state dict object), so that a swap is one attribute assignment."""

    by_params: defaultdict[Tensor, Any]  # the optimizer's own object: code may keep a reference to it
    masters: dict[Tensor, Tensor]
    by_masters: defaultdict[Tensor, Any] = field(init=False)

    def __post_init__(self) -> None:
        # of the same kind: optimizers create their entries by reading a missing key
        if type(self.by_params) is defaultdict:  # torch's: parameters stand for their masters as keys
            self.by_masters = _ByMasters(self.by_params.default_factory, self.masters)
        else:
            self.by_masters = copy.copy(self.by_params)
            self.by_masters.clear()


def _same_entries(a: dict[Tensor, Any], b: dict[Tensor, Any]) -> bool:
    """Whether two state dicts hold the same entry objects in the same order (a C-level pass, no tensor hashing): then
    one is the other with its keys renamed, as built by :meth:`GroupSwap._rename`."""
    return len(a) == len(b) and all(map(operator.is_, a.values(), b.values()))


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
        self._masters_params: Optional[dict[Tensor, Tensor]] = {}  # master -> parameter, made when first needed
        self._mirrors: dict[Optimizer, _StateMirror] = {}
        self.layouts = FlatLayouts()  # of the masters' fp32 gradients, one per range of an optimizer's masters

    def invalidate(self) -> None:
        """The masters changed (made, moved, dropped): plans are rebuilt at their next use."""
        self._plans.clear()
        self.layouts.clear()  # it keeps the masters it was made for
        self._masters_params = None  # made again at its next use: a conversion adds the masters one by one
        # mirrors keyed by the old masters go; one whose optimizer is stepping now is swapped back first
        self._mirrors = {o: m for o, m in self._mirrors.items() if o.state is m.by_masters}

    @property
    def _param_of(self) -> dict[Tensor, Tensor]:
        """Master -> parameter (the groups may hold the masters right now)."""
        if self._masters_params is None:
            self._masters_params = {m: p for p, m in self.masters.items()}
        return self._masters_params

    def swap(self, optimizer: Optimizer, to_masters: bool) -> None:
        """Put the masters (or back the parameters) into ``optimizer.param_groups``, in place, with their state.

        In place, because optimizers such as LBFGS keep a reference to the group's list. The state moves by swapping
        ``optimizer.state`` between its own dict and a mirror keyed by the masters (one assignment, where moving each
        entry costs two tensor hashes); the mirror is renamed again only when the entries changed (the optimizer's
        first step, a reset, a loaded checkpoint).
        """
        plan = self.plan(optimizer)
        for params, mine, masters in plan.groups:
            params[:] = masters if to_masters else mine  # one slice assignment per group
        state = optimizer.state
        mirror = self._mirrors.get(optimizer)
        if to_masters:
            if mirror is None or state is not mirror.by_params:  # first step, or the state was replaced
                mirror = self._mirrors[optimizer] = _StateMirror(state, self.masters)
            if not _same_entries(state, mirror.by_masters):
                self._rename(state, mirror.by_masters, self.masters)
            optimizer.state = mirror.by_masters
        elif mirror is not None and state is mirror.by_masters:
            if not _same_entries(state, mirror.by_params):  # the step made (or replaced) entries
                self._rename(state, mirror.by_params, self._param_of)
            optimizer.state = mirror.by_params
        else:  # a state loaded while the groups held the masters: its keys are renamed in place, and it is kept
            self._mirrors.pop(optimizer, None)
            self._rename(state, state, self._param_of)

    @staticmethod
    def _rename(source: dict[Tensor, Any], target: dict[Tensor, Any], names: dict[Tensor, Tensor]) -> None:
        """Make ``target`` (in place: others may hold it; it may be ``source``) the entries of ``source`` in its
        order, keyed by ``names``."""
        renamed = [(names.get(k, k), v) for k, v in source.items()]
        target.clear()
        target.update(renamed)

    def plan(self, optimizer: Optimizer) -> GroupPlan:
        """Where ``optimizer``'s parameters with masters sit in its groups; rebuilt when the groups change."""
        key_parts = []  # a loop, not a comprehension: this runs three times a step
        for g in optimizer.param_groups:
            params = g["params"]
            key_parts.append((id(params), len(params)))
        key = tuple(key_parts)
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
            plan.params, plan.masters = [p for p, _ in plan.pairs], [m for _, m in plan.pairs]
            devices = {p.device for p in plan.own} | {m.device for _, m in plan.pairs}
            plan.device = devices.pop() if len(devices) == 1 else None
            self._plans[optimizer] = plan
        return plan
