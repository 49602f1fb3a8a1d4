"""Counting the bytes of ``torch.distributed`` collectives, for ``examples/memory_breakdown.py --strategy fsdp``.

torch's ``TorchDispatchMode`` (``torch.utils._python_dispatch``, torch >= 1.13) sees every op below autograd, c10d
collectives included. The public ``CommDebugMode`` is one such mode, but it counts calls, not bytes, and its module
tracker fails on a LightningModule sharded with ``fully_shard``.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes this process sends through ``torch.distributed`` collectives while it is active.

    ``sent["all_gather"]``: the input of each all-gather (this rank's shards, as FSDP all-gathers parameters);
    ``sent["reduce_scatter"]``: the input of each reduce-scatter (the unsharded gradients FSDP reduces);
    ``sent["all_reduce"]``, ``sent["broadcast"]``: their tensors. ``calls`` counts the calls of each kind. Counted at
    the c10d ops, below FSDP and ``DTensor``, so whatever path they take is seen (on CPU and CUDA).

    Example:
        ```python
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process, for the example
        try:
            with CollectiveBytes() as comm:
                dist.all_reduce(torch.ones(4))        # 4 fp32 values
                dist.all_reduce(torch.ones(4, dtype=torch.bfloat16))
            assert comm.sent["all_reduce"] == 16 + 8 and comm.calls["all_reduce"] == 2
        finally:
            dist.destroy_process_group()
        ```
    """

    KINDS = {
        "allgather": "all_gather",
        "reduce_scatter": "reduce_scatter",
        "allreduce": "all_reduce",
        "broadcast": "broadcast",
    }

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, int] = dict.fromkeys(self.KINDS.values(), 0)
        self.calls: dict[str, int] = dict.fromkeys(self.KINDS.values(), 0)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn its op into plain ones (and collectives), which come back here
        name = func.name() if hasattr(func, "name") else ""
        if name.startswith("c10d::"):
            kind = next((k for key, k in self.KINDS.items() if key in name), None)
            if kind is not None:
                # all-gather and reduce-scatter take (output, input, ...); all-reduce and broadcast (tensors, ...)
                data = args[1] if kind in ("all_gather", "reduce_scatter") else args[0]
                self.sent[kind] += sum(t.numel() * t.element_size() for t in _tensors(data))
                self.calls[kind] += 1
        return func(*args, **(kwargs or {}))


def _tensors(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []
