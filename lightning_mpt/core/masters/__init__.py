"""The fp32 master weights of a half-precision model, and what the engine asks of them (:class:`Masters`).

Two implementations: :class:`~lightning_mpt.core.masters.copies.CopyMasters`, an fp32 copy of each half parameter
(one device, DDP), and :class:`~lightning_mpt.core.masters.sharded.ShardedMasters`, FSDP2's own fp32 shards
(torch >= 2.6, imported on demand). One optimizer step, as the engine drives it:

1. :meth:`Masters.prepare` gives the optimizer's parameters fp32 gradients, unscaled by fused kernels, and flags on
   the device whether any was non-finite and whether user code edited a half weight since the last step;
2. after the engine's one host sync, :meth:`Masters.absorb_edits` takes those edits into the masters;
3. :meth:`Masters.enter` hands the masters to the optimizer, :meth:`Masters.exit` takes them back and refreshes the
   half weights; or, for a skipped step, :meth:`Masters.discard` drops the gradients;
4. :meth:`Masters.release` (before the next forward) frees what the step kept, and :meth:`Masters.rescale` scales a
   step's leftover gradients again when a backward is to accumulate into them.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils.parametrize import ParametrizationList
from torch.optim import Optimizer

from lightning_mpt.core.numerics import max_abs

HALF_DTYPES = (torch.float16, torch.bfloat16)

# parameters of these modules stay fp32: normalisation statistics and affine parameters are precision-sensitive
DEFAULT_KEEP_FP32: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
    nn.CrossMapLRN2d,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),  # torch >= 2.4
    # a parametrized tensor (spectral_norm, orthogonal, weight_norm): its parametrization runs ops that autocast does
    # not cover (mv, matrix_exp, QR) and that lose the constraint in half precision; it also covers the legacy
    # hook-based spectral_norm and weight_norm
    ParametrizationList,
)


def distributed() -> bool:
    """Whether this process is one of several in a ``torch.distributed`` group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` was applied to ``module`` or to one of its submodules (``False`` on torch < 2.6,
    which has no public FSDP2).

    Example:
        ```python
        assert not is_fully_sharded(nn.Linear(2, 2))
        ```
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def params_of(optimizer: Optimizer) -> list[Tensor]:
    """The parameters of ``optimizer``, in its groups' order (the same on every process)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


@dataclass
class Gradients:
    """The gradients of one optimizer's step, unscaled into fp32, waiting for the step to be carried out."""

    optimizer: Optional[Optimizer] = None
    params: list[Tensor] = field(default_factory=list)  # module parameters that have a separate master
    masters: list[Tensor] = field(default_factory=list)
    master_grads: list[Tensor] = field(default_factory=list)
    own_params: list[Tensor] = field(default_factory=list)  # parameters that are their own master (fp32)
    found_inf: Optional[Tensor] = None  # 0-dim, > 0 when a gradient was non-finite; None when no gradients
    # whether the half weights were edited since the last step: one flag per entry of ``params``, or a single flag
    # for all of them (on CPU: absorb_edits then finds which); None when not checked
    edited: Optional[Tensor] = None
    edit_flags: Optional[Tensor] = None  # with a single ``edited`` flag: one per entry of ``params``, when one is set
    entered: bool = False  # whether the optimizer holds the masters now
    # torch < 2.13, where a half parameter cannot hold an fp32 gradient: the half copies its ``.grad`` shows hooks,
    # and version counters to notice edits of them (by hooks) and of the master gradients (by clipping)
    on_params: list[Tensor] = field(default_factory=list)
    on_params_versions: list[int] = field(default_factory=list)
    master_versions: list[int] = field(default_factory=list)

    @property
    def left_scale(self) -> float:
        """The scale the gradients this step leaves on the parameters carry: 1.0, they are the true ones."""
        return 1.0

    def all_params(self) -> list[Tensor]:
        return self.params + self.own_params

    def fp32_grads(self) -> list[Tensor]:
        """The unscaled gradients, aligned with :meth:`all_params` (this process's part of each)."""
        return self.master_grads + [p.grad for p in self.own_params if p.grad is not None]

    def nonfinite_mask(self) -> Optional[Tensor]:
        """Per-parameter flags (aligned with :meth:`all_params`) of gradients that are non-finite on any process, on
        the device, no host sync.

        Across processes the flags are all-reduced (max) in the optimizer's parameter order, which every process
        shares: a collective, so every process calls it, as the engine does on a skipped step (decided the same
        everywhere). So every process names the same culprits, also for a gradient non-finite on one process only
        (FSDP2's shards, or a gradient edited after DDP's all-reduce).
        """
        grads = self.fp32_grads()
        local = ~torch.isfinite(max_abs(grads)) if grads else None
        if self.optimizer is None or not distributed():
            return local
        order = {p: i for i, p in enumerate(params_of(self.optimizer))}
        device = local.device if local is not None else next(iter(order)).device
        positions = torch.tensor([order[p] for p in self.all_params()], dtype=torch.long, device=device)
        flags = torch.zeros(len(order), device=device)
        if local is not None:
            flags[positions] = local.float()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags[positions] > 0


class Masters(Protocol):
    """What the engine asks of the fp32 masters of a half-precision model (see the module's docstring)."""

    dtype: torch.dtype  # the half format of the model's weights
    # called with the names of the weights whose in-place edits the masters adopted, wherever they were found
    on_edits: Optional[Callable[[list[str]], None]]

    @property
    def separate(self) -> bool:
        """The optimizer holds the half parameters between steps and the masters are tensors of their own: a step of
        the optimizer outside the engine would update the half weights and bypass the masters."""

    def convert(self, module: nn.Module, restored: bool = False) -> nn.Module:
        """Set the module up: cast it to the half format, or take FSDP2's shards as the masters."""

    def restore(self) -> None:
        """End: the module holds fp32 weights equal to the masters again."""

    def adopt(self, optimizer: Optimizer) -> list[Any]:
        """Take ``optimizer`` over (its state exact fp32, checkpoints loaded into the masters); hook handles."""

    def prepare(self, optimizer: Optimizer, scale: float, check_edits: bool = True) -> Gradients:
        """The step's fp32 gradients, unscaled by ``1/scale``, with their flags on the device."""

    def absorb_edits(self, grads: Gradients, flags: list[float]) -> list[str]:
        """Take the edits that ``flags`` (host values of ``grads.edited``) mark into the masters; their names (also
        handed to :attr:`on_edits`)."""

    def enter(self, optimizer: Optimizer, grads: Gradients) -> None:
        """Hand the masters to ``optimizer`` for its step."""

    def exit(self, optimizer: Optimizer, grads: Gradients, stepped: bool) -> None:
        """Take the masters back; refresh the half weights."""

    def steps(self, optimizer: Optimizer, grads: Gradients) -> Generator[None, None, None]:
        """Hand the masters to ``optimizer`` for the step: the caller steps once per item (once, or per chunk)."""

    def discard(self, grads: Gradients, zero: bool = False) -> None:
        """A skipped step: drop its gradients (``zero``: leave zeros, as ``zero_grad(set_to_none=False)``)."""

    def rescale(self, grads: Gradients, scale: float) -> None:
        """Before a backward: multiply ``grads``' unscaled leftovers by ``scale``, for it to accumulate into."""

    def release(self, drop: bool) -> None:
        """Before a forward: free what the last step kept (``drop``: the module's gradients too)."""

    def accumulate_in_fp32(self, sync: bool, zeros: bool = True) -> None:
        """Before a backward: let it sum micro-batches in fp32 (``sync``: it reduces across processes)."""

    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 tensor the optimizer steps for ``param``."""

    def name_of(self, param: Tensor) -> str:
        """The module's name of ``param``."""

    def named_masters(self) -> Iterator[tuple[str, Tensor, Tensor]]:
        """``(name, parameter, master)`` of each parameter with a master."""

    def storage(self) -> list[Tensor]:
        """The tensors holding the masters now, other than the parameters themselves."""


class _HandsOverMasters(Protocol):
    """What :func:`whole_step` needs of the masters: to hand them to an optimizer and take them back."""

    def enter(self, optimizer: Optimizer, grads: Gradients) -> None: ...

    def exit(self, optimizer: Optimizer, grads: Gradients, stepped: bool) -> None: ...


def whole_step(masters: _HandsOverMasters, optimizer: Optimizer, grads: Gradients) -> Generator[None, None, None]:
    """:meth:`Masters.steps` for one whole step: the masters are entered, the caller steps once, they exit (also when
    the step raised: the generator is closed then, and the exit knows nothing was stepped)."""
    masters.enter(optimizer, grads)
    stepped = False
    try:
        yield
        stepped = True
    finally:
        masters.exit(optimizer, grads, stepped=stepped)
