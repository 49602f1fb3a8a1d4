"""The one place where lightning-mpt touches private (``_``-prefixed) torch and Lightning symbols.

Each entry says why it is needed and from which versions it exists; tests/test_compat.py checks that no other module
uses a private foreign symbol. When torch or Lightning moves one of these, this file is the only one to change.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

# --- core: the optimizer step -----------------------------------------------------------------------------------------

# torch >= 2.13: a parameter may hold a gradient of another dtype once ``grad_dtype`` is set to None (public attribute;
# feature-tested, not version-tested). The plugin then hands hooks and clipping the fp32 gradients on the module's own
# parameters and frees the half ones at the step.
GRAD_DTYPE = hasattr(Tensor, "grad_dtype")


def unscale_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and set ``found_inf`` if any value is non-finite: the fused kernel
    behind ``torch.amp.GradScaler.unscale_`` (torch >= 1.10), one launch per device and dtype, no host sync."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def foreach_copy_(dst: list[Tensor], src: list[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i in one fused launch, casting as needed (torch >= 2.1)."""
    torch._foreach_copy_(dst, src)


def foreach_sub_(dst: list[Tensor], src: list[Tensor]) -> None:
    """``dst[i] -= src[i]`` in one fused launch (torch >= 1.7)."""
    torch._foreach_sub_(dst, src)


def foreach_max_abs(tensors: list[Tensor]) -> list[Tensor]:
    """``[t.abs().max() for t in tensors]`` in one fused launch, as 0-dim tensors on the device (torch >= 1.11);
    inf/NaN propagate, so it also flags non-finite values."""
    return list(torch._foreach_norm(tensors, ord=float("inf")))


def version(t: Tensor) -> int:
    """The in-place version counter of ``t`` (bumped by every in-place op on it or its views; all torch 2.x). Used
    to notice hooks that edited a gradient in place."""
    return t._version


def mark_optimizer_stepped(optimizer: Optimizer) -> None:
    """Tell torch's LR schedulers that ``optimizer.step()`` ran, for a step the plugin skipped (as
    ``torch.amp.GradScaler`` does, the optimizer is not called at all): otherwise a run whose first steps overflow gets
    torch's "lr_scheduler.step() before optimizer.step()" warning. torch >= 2.0 reads ``optimizer._opt_called``."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def after_closure(plugin: Any, model: Any, optimizer: Any) -> None:
    """Lightning's ``Precision._after_closure`` (lightning >= 2.0): the ``on_before_optimizer_step`` hooks, then
    gradient clipping, in Lightning's own order. The plugin calls it rather than copying its body."""
    from lightning.pytorch.plugins.precision import Precision

    Precision._after_closure(plugin, model, optimizer)


def lr_scheduler_base() -> Optional[type]:
    """torch's LR scheduler base class (public name ``LRScheduler`` since torch 2.0)."""
    return getattr(torch.optim.lr_scheduler, "LRScheduler", None)


# --- FSDP2 (torch.distributed.fsdp.fully_shard) -----------------------------------------------------------------------


def fsdp_mp_policy(module: Any) -> Optional[Any]:
    """The ``MixedPrecisionPolicy`` that ``fully_shard(module, mp_policy=...)`` was given, or ``None`` if it cannot be
    read. FSDP2 has no public getter: the policy lives on the module's FSDP state as ``_mp_policy`` (torch 2.4 to
    2.13 at least; ``fully_shard.state(module)`` is the state accessor that torch's ``contract`` decorator documents).
    The plugin reads it once at set-up, to check that the model all-gathers in the plugin's half format."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    return getattr(state, "_mp_policy", None) if state is not None else None


def dispatch_mode() -> type:
    """torch's ``TorchDispatchMode`` (``torch.utils._python_dispatch``, torch >= 1.13): the base of a mode that sees
    every op below autograd, c10d collectives included. :class:`~lightning_mpt.fsdp.CollectiveBytes` counts the bytes
    of FSDP's collectives with it. (The public ``CommDebugMode`` is one such mode, but it counts calls, not bytes, and
    its module tracker fails on a LightningModule sharded with ``fully_shard``.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode
