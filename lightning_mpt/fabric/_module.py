"""The module that Fabric runs for a model converted by the Fabric plugin (one device, DDP): a forward-only wrapper.

Lightning Fabric's ``_FabricModule`` sends a method marked with ``model.mark_forward_method(name)`` through its own
``forward``, hence through the precision plugin's ``forward_context`` (the autocast), only when the module it runs
differs from the user's module (``lightning/fabric/wrappers.py``, ``_FabricModule.__getattr__``), as it does when a
strategy wrapped the module (DDP). On one device the method would run on the half weights without autocast. With
this wrapper as the module Fabric runs, every strategy takes that path; an unmarked method that calls submodules gets
Fabric's own error, which says to mark it, on one device as under DDP, once it returns. From floating-point inputs it
would not return: its first half-precision layer fails on the dtypes outside autocast. :class:`UnmarkedCalls` says
which method to mark there instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module
from torch.utils.hooks import RemovableHandle


class ForwardModule(Module):
    """A module whose ``forward`` calls ``module``; its ``state_dict``, ``load_state_dict`` and the attributes it lacks
    are ``module``'s, so checkpoints keep the module's own names.

    Example:
        ```python
        import torch
        from torch import nn

        linear = nn.Linear(2, 3)
        wrapped = ForwardModule(linear)
        assert wrapped.weight is linear.weight and list(wrapped.state_dict()) == ["weight", "bias"]
        assert wrapped(torch.ones(1, 2)).shape == (1, 3)
        ```
    """

    def __init__(self, module: Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")  # absent while torch builds or unpickles the wrapper
            if not modules or "module" not in modules:
                raise
            return getattr(modules["module"], name)


class UnmarkedCalls:
    """Forward pre-hooks on the layers with half-precision weights of a converted module: a layer called outside the
    plugin's forward and outside autocast, with floating-point inputs of another dtype than its weights (what an
    unmarked method of the model does: it runs the layers directly), raises an error that names the method and says
    to mark it, where torch would fail on the dtypes. Calls that work are left alone: inside the plugin's forward, under
    any autocast, on inputs of the weights' dtype, on weights swapped for fp32 ones.

    Args:
        half: the half-precision format of the weights.

    Example:
        ```python
        import pytest
        from torch import nn

        model = nn.Sequential(nn.Linear(2, 2)).half()
        unmarked = UnmarkedCalls(torch.float16)
        unmarked.watch(model)
        with pytest.raises(RuntimeError, match="mark_forward_method"):
            model(torch.ones(1, 2))
        with unmarked.inside():  # the plugin's forward (under its autocast)
            model(torch.ones(1, 2).half())
        unmarked.close()
        ```
    """

    def __init__(self, half: torch.dtype) -> None:
        self._half = half
        self._depth = 0  # how many of the plugin's forward contexts are open
        self._root: Optional[Module] = None
        self._names: dict[Module, str] = {}
        self._handles: list[RemovableHandle] = []

    def watch(self, module: Module) -> None:
        """Check the calls of ``module``'s layers with half-precision weights, until :meth:`close`."""
        self._root = module
        for name, layer in module.named_modules():
            if any(p.dtype == self._half for p in layer.parameters(recurse=False)):
                self._names[layer] = name
                self._handles.append(layer.register_forward_pre_hook(self._check))

    @contextmanager
    def inside(self) -> Generator[None, None, None]:
        """The plugin's forward (``model(x)``, a marked method, ``fabric.autocast()``): calls are not checked."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def close(self) -> None:
        """Remove the hooks (the module is restored)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._names.clear()
        self._root = None

    def _check(self, layer: Module, args: tuple[Any, ...]) -> None:
        if self._depth:
            return
        weight = next((p for p in layer.parameters(recurse=False) if p.dtype == self._half), None)
        if weight is None or torch.is_autocast_enabled(weight.device.type):
            return
        other = next((a.dtype for a in args if isinstance(a, Tensor) and a.is_floating_point()), weight.dtype)
        if other != weight.dtype:
            raise RuntimeError(self._unmarked(layer, other))

    def _unmarked(self, layer: Module, inputs: torch.dtype) -> str:
        """The error for ``layer`` called outside the plugin's forward on ``inputs`` of another dtype."""
        root = type(self._root).__name__
        method = _calling_method(self._root)
        what = f"`{root}.{method}()` ran" if method else f"A call outside `{root}.forward` ran"
        ran = (
            f"MPTPrecision: {what} the layer `{self._names.get(layer, type(layer).__name__)}` "
            f"({type(layer).__name__}, {self._half} weights) on {inputs} inputs outside autocast. Fabric runs the "
            "model's `forward` and the methods marked with `mark_forward_method` under the precision plugin's autocast"
        )
        if method == "forward":  # the module itself, not what fabric.setup returned
            return f"{ran}: call the model that `fabric.setup()` returned (`model(x)`, not `model.module(x)`)."
        mark = f"model.mark_forward_method({method!r})" if method else "model.mark_forward_method(name)"
        return f"{ran}; mark this one after `fabric.setup()`: `{mark}`, or call it inside `with fabric.autocast():`."


def _calling_method(root: Optional[Module]) -> Optional[str]:
    """The name of the outermost method of ``root`` on the call stack (the one the user called), if any; torch's own
    ``Module.__call__`` machinery is not a method of the user's."""
    found = None
    torchs = inspect.getsourcefile(Module)
    frame = inspect.currentframe()
    while frame is not None:
        if root is not None and frame.f_locals.get("self") is root and frame.f_code.co_filename != torchs:
            found = frame.f_code.co_name
        frame = frame.f_back
    del frame
    return found
