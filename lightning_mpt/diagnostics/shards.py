"""Sharded parameters (FSDP2's ``DTensor`` s): this process's part of a tensor, and the processes that share them.

A statistic computed on the local shards is made global by one collective per logging step (see
:meth:`~lightning_mpt.diagnostics.recorder.Recorder.flush`): counts and sums are summed, maxima maxed, and the
fractions derived from the totals equal those of the whole, unsharded tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and gradients), by duck typing so
    that no torch version without ``DTensor`` is needed."""
    return isinstance(t, Tensor) and callable(getattr(t, "to_local", None)) and hasattr(t, "placements")


def local_tensor(t: Tensor) -> Tensor:
    """This process's shard of a ``DTensor`` (the local tensor itself, detached: it sees in-place updates of the
    parameter), or ``t`` detached."""
    if is_dtensor(t):
        with torch.no_grad():
            local: Tensor = t.to_local()  # type: ignore[attr-defined]  # a DTensor method
        return local.detach()
    return t.detach()


class Shards:
    """The processes among which parameters are sharded (FSDP2): what the statistics sum their counts over.

    Every process must take part in the collectives; rank 0 writes.

    Args:
        device: where the local shards live (the collective's device).
        group: the process group; ``None`` for the default (every process).
    """

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group
        self.world_size = torch.distributed.get_world_size(group)
        self.rank = torch.distributed.get_rank(group)
        self.calls = 0  # collectives run, for tests and benchmarks

    @classmethod
    def of(cls, params: Sequence[Tensor]) -> Optional[Shards]:
        """The shards of ``params`` if any is a ``DTensor``, ``None`` for replicated (DDP) or local parameters.

        Raises:
            ValueError: the parameters' device meshes do not span every process (pipeline stages), where a sum over
                all processes would not be the sum over one model's shards.
        """
        sharded = [p for p in params if is_dtensor(p)]
        if not sharded:
            return None
        world = torch.distributed.get_world_size()
        for p in sharded:
            mesh: Any = p.device_mesh  # type: ignore[attr-defined]  # a DTensor attribute
            if mesh.size() != world:
                raise ValueError(
                    f"the diagnostics sum the parameters' shards over all {world} processes, and a parameter is "
                    f"sharded over a device mesh of {mesh.size()}: only meshes that span every process are supported."
                )
        return cls(local_tensor(sharded[0]).device)

    def owns(self, p: Tensor) -> bool:
        """Whether this process counts its local part of ``p``: always for sharded dimensions; for replicated mesh
        dimensions (HSDP, tensor parallel with replicated parameters) only the process at coordinate 0 does, so that
        no value is counted twice."""
        if not is_dtensor(p):
            return self.rank == 0
        placements: Any = p.placements  # type: ignore[attr-defined]
        coordinate = p.device_mesh.get_coordinate()  # type: ignore[attr-defined]
        if coordinate is None:
            return False
        return all(c == 0 for c, place in zip(coordinate, placements) if not place.is_shard())

    def all_reduce(self, tensor: Tensor, op: Literal["sum", "max"]) -> None:
        """``torch.distributed.all_reduce`` of ``tensor`` in place (no host sync)."""
        dist = torch.distributed
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        self.calls += 1

    def reduce_ranges(self, ranges: Tensor) -> Tensor:
        """The global ``(min, max)`` rows of per-process ``(min, max)`` rows
        (:func:`~lightning_mpt.core.numerics.value_ranges`): one collective."""
        both = torch.stack([-ranges[:, 0], ranges[:, 1]], dim=1).to(self.device, torch.float64)
        self.all_reduce(both, "max")
        return torch.stack([-both[:, 0], both[:, 1]], dim=1)

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every process: one collective and one host read."""
        failed = torch.tensor([0.0 if ok else 1.0], device=self.device)
        self.all_reduce(failed, "max")
        return failed.item() == 0
