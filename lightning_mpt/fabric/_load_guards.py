"""Optimizer state that loads into the fp32 masters exactly, before the plugin has adopted the optimizer.

torch's ``Optimizer.load_state_dict`` casts the loaded state to the dtype of the parameters it finds in
``param_groups``: outside the step those are the half parameters, so Adam's fp32 moments would be rounded. An adopted
optimizer has hooks that swap the masters in for the load
(:meth:`~lightning_mpt.core.masters.copies.CopyMasters.adopt`); Fabric adopts at the first step, and gives
a precision plugin no hook that sees the optimizers at set-up (``Fabric.setup`` calls ``convert_module(module)`` only).
So :class:`LoadGuards` finds them on the garbage collector's heap at the moments a load can follow: at set-up, when the
model's ``load_state_dict`` runs (``fabric.load`` restores the entries of its state in their order, the model's usually
first), and when the plugin's own state loads.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Optional
from weakref import WeakKeyDictionary, WeakSet

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, dtype
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_mpt import _compat

if TYPE_CHECKING:
    from lightning_mpt.core.masters import Masters

# the module of Fabric's optimizer wrapper, a class made on the fly that subclasses the optimizer's own class
_FABRIC_WRAPPERS = "lightning.fabric.wrappers"


class LoadGuards:
    """Give every optimizer that holds a converted module's parameters the load hooks of an adopted one, until it is.

    Args:
        masters: the masters of the converted module.
        half: their half-precision format.
        before_load: called before such an optimizer loads its state (the plugin moves the masters next to their
            parameters there: Fabric moves the module after converting it).

    Example:
        ```python
        import torch
        from torch import nn
        from lightning_mpt.core.masters.copies import CopyMasters

        model = nn.Linear(4, 4)
        adam = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        adam.step()  # state in fp32
        saved = adam.state_dict()
        masters = CopyMasters(torch.float16)
        masters.convert(model)
        guards = LoadGuards(masters, torch.float16, lambda: None)
        guards.watch(model)  # finds adam
        adam.load_state_dict(saved)
        assert adam.state[model.weight]["exp_avg"].dtype == torch.float32  # not cast to fp16
        guards.close()
        masters.restore()
        ```
    """

    def __init__(self, masters: Masters, half: dtype, before_load: Callable[[], None]) -> None:
        self._masters = masters
        self._half = half
        self._before_load = before_load
        self._guarded: WeakKeyDictionary[Optimizer, list[RemovableHandle]] = WeakKeyDictionary()
        self._released: WeakSet[Optimizer] = WeakSet()  # adopted: they have the hooks of their own
        self._module_hook: Optional[RemovableHandle] = None
        self.active = False

    def __getstate__(self) -> dict[str, Any]:
        """Picklable: Fabric's ``ddp_spawn`` pickles the plugin (before set-up, when nothing is guarded yet) to start
        each process; weak containers cannot be pickled, so they travel as strong ones."""
        state = self.__dict__.copy()
        state["_guarded"], state["_released"] = dict(self._guarded), list(self._released)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._guarded, self._released = WeakKeyDictionary(state["_guarded"]), WeakSet(state["_released"])

    def watch(self, module: Module) -> None:
        """Guard the optimizers that hold ``module``'s parameters now, and again whenever its state loads, until
        :meth:`stop`."""
        self._module_hook = _compat.register_load_state_dict_pre_hook(module, lambda *_: self.scan())
        self.active = True
        self.scan()

    def scan(self) -> None:
        """Guard the optimizers that hold the module's parameters and are neither guarded nor adopted yet.

        One whose state was loaded rounded already is left alone: guarding would cast it back to fp32, and the plugin
        could no longer tell the user at the optimizer's first step.
        """
        if not self.active:
            return
        params = [p for _, p, _ in self._masters.named_masters()]
        for optimizer in optimizers_holding(params):
            if optimizer in self._guarded or optimizer in self._released:
                continue
            if rounded_state(optimizer, self._masters, self._half):
                continue
            self._guarded[optimizer] = [
                optimizer.register_load_state_dict_pre_hook(lambda *_: self._before_load(), prepend=True),
                *self._masters.adopt(optimizer),
            ]

    def stop(self) -> None:
        """Training started: no more scans (a load from now on is mid-run, into adopted optimizers). The optimizers
        guarded so far keep their hooks until adopted."""
        self.active = False

    def release(self, optimizer: Optimizer) -> None:
        """``optimizer`` was adopted: its own hooks take over."""
        self._released.add(optimizer)
        for handle in self._guarded.pop(optimizer, []):
            handle.remove()

    def close(self) -> None:
        """Remove every hook (the module is restored)."""
        for handles in [*self._guarded.values(), [self._module_hook] if self._module_hook else []]:
            for handle in handles:
                handle.remove()
        self._guarded.clear()
        self._released = WeakSet()  # their adoption ended with the module's conversion
        self._module_hook = None
        self.active = False


def optimizers_holding(params: Iterable[Tensor]) -> list[Optimizer]:
    """The torch optimizers alive now whose ``param_groups`` hold any of ``params`` (Fabric's wrappers left out).

    One pass over the objects the garbage collector tracks: about 0.1 s after ``import lightning`` (0.36 M objects)
    and 0.15-0.2 s with 1 M objects on a 2-core VM. Classes are checked with ``type(obj)``, never ``isinstance``,
    which would ask arbitrary objects (proxies, lazy modules) for their ``__class__``.

    Example:
        ```python
        import torch
        from torch import nn

        model = nn.Linear(2, 2)
        adam = torch.optim.Adam(model.parameters())
        other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        assert optimizers_holding([model.weight]) == [adam]
        ```
    """
    wanted = {id(p) for p in params}
    if not wanted:
        return []
    kinds: dict[type, bool] = {}
    found = []
    for obj in gc.get_objects():
        cls = type(obj)
        kind = kinds.get(cls)
        if kind is None:
            kind = kinds[cls] = issubclass(cls, Optimizer) and cls.__module__ != _FABRIC_WRAPPERS
        if kind and _holds(obj, wanted):
            found.append(obj)
    return found


def rounded_state(optimizer: Optimizer, masters: Masters, half: dtype) -> list[str]:
    """Names of the parameters with a master whose state in ``optimizer`` was built by steps (``step`` > 0) and is in
    the ``half`` format: it was loaded while the optimizer had no load hooks, and torch cast it."""
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or masters.master_of(p) is p:
                continue
            step = state.get("step")
            halves = [k for k, v in state.items() if k != "step" and isinstance(v, Tensor) and v.dtype == half]
            if halves and step is not None and float(step) > 0:
                names.append(masters.name_of(p))
    return names


def warn_if_rounded(optimizer: Optimizer, masters: Masters, half: dtype) -> None:
    """Say so when state that steps built was loaded in the ``half`` format (:func:`rounded_state`), and how to load
    it exactly."""
    rounded = rounded_state(optimizer, masters, half)
    if rounded:
        shown = ", ".join(rounded[:5]) + (f" and {len(rounded) - 5} more" if len(rounded) > 5 else "")
        rank_zero_warn(
            f"MPTPrecision: the state of {type(optimizer).__name__} for {shown} is in {half}: it was loaded "
            "(fabric.load) before the plugin could see the optimizer, and torch cast it to the half-precision "
            "parameters' dtype, so the run does not resume exactly. The plugin finds the optimizers at "
            "fabric.setup and when the model's or the plugin's entry of the state loads: put the model before the "
            "optimizer in fabric.load's state, or call `fabric.strategy.precision.adopt(optimizer)` before "
            "`fabric.load`."
        )


def _holds(optimizer: Any, wanted: set[int]) -> bool:
    groups = getattr(optimizer, "__dict__", {}).get("param_groups")
    if not isinstance(groups, list):  # constructed halfway, or an optimizer that keeps its groups elsewhere
        return False
    return any(id(p) in wanted for group in groups if isinstance(group, dict) for p in group.get("params", ()))
