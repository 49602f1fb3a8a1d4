"""Counting host syncs on CPU, where torch has no sync-debug mode (``torch.cuda.set_sync_debug_mode`` is CUDA-only).

A host sync is any read of a tensor's values by Python: on a GPU each one waits for the device. The counter wraps
every way torch offers to do that: the conversions (``bool(t)``, ``float(t)``, ``int(t)``, ``operator.index(t)``,
``complex(t)``), ``item``, ``tolist``, ``numpy`` / ``__array__``, ``cpu()``, and the ops whose output size
depends on the values (``nonzero``, ``unique``, ``bincount``, ``masked_select``, ``repeat_interleave``), as methods
and as ``torch.*`` functions. On CPU tensors these calls are counted although they cost nothing there: the count is
what the same code would sync on a GPU.

Not counted: ``t.to(device)``. Code moves tensors to the device they are computed on, which in a CPU-only test is
the CPU too, so a move to the host cannot be told from a move to the tensors' own device (counting them gives
hundreds of false syncs per run). A read to the host goes through ``cpu()`` or one of the reads above.
"""

from __future__ import annotations

from typing import Any

import torch

TENSOR_METHODS = (
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "item",
    "tolist",
    "numpy",
    "__array__",
    "cpu",
    "nonzero",
    "unique",
    "bincount",
    "masked_select",
    "repeat_interleave",
)
TORCH_FUNCTIONS = ("nonzero", "unique", "bincount", "masked_select", "repeat_interleave")


class HostSyncCounter:
    """Context manager: ``count`` is the number of host reads made while it is active.

    Example: ``with HostSyncCounter() as syncs: float(torch.ones(()))`` leaves ``syncs.count == 1``.
    """

    def __init__(self) -> None:
        self.count = 0
        self.by_name: dict[str, int] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0  # a counted call made inside another counted call (unique -> torch.unique) counts once

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))

        def counted(*args: Any, **kwargs: Any) -> Any:
            outer = self._depth == 0
            if outer:
                self.count += 1
                self.by_name[name] = self.by_name.get(name, 0) + 1
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        setattr(owner, name, counted)

    def __enter__(self) -> HostSyncCounter:
        for name in TENSOR_METHODS:
            self._wrap(torch.Tensor, name)
        for name in TORCH_FUNCTIONS:
            self._wrap(torch, name)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
