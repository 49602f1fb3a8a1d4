"""The module that Fabric runs for a model converted by the Fabric plugin (one device, DDP): a forward-only wrapper.

Lightning Fabric's ``_FabricModule`` sends a method marked with ``model.mark_forward_method(name)`` through its own
``forward``, hence through the precision plugin's ``forward_context`` (the autocast), only when the module it runs
differs from the user's module (``lightning/fabric/wrappers.py``, ``_FabricModule.__getattr__``), as it does when a
strategy wrapped the module (DDP). On one device the method would run on the half weights without autocast. With
this wrapper as the module Fabric runs, every strategy takes that path; an unmarked method that calls submodules gets
Fabric's own error, which says to mark it, on one device as under DDP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.nn import Module


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
