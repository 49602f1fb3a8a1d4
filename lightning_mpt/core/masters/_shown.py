"""torch < 2.13, where a half parameter cannot hold an fp32 gradient: what its ``.grad`` shows during a step is a half
copy of its master's fp32 gradient. Version counters say what hooks did to either since it was written: an edit of
the copy (a hook) goes into the master gradient, clipping of the master gradient into the copy, and an untouched copy
stands for the exact gradient it was made from."""

from __future__ import annotations

from torch import Tensor

from lightning_mpt import _compat
from lightning_mpt.core.masters import Gradients


def is_faithful_copy(grads: Gradients, i: int, grad: Tensor) -> bool:
    """Whether ``grad`` is the half copy of master gradient ``i`` shown on its parameter, untouched since it was
    written (so the master gradient holds the same values, unrounded); never on torch >= 2.13.

    Example:
        ```python
        import torch

        grads = Gradients(master_grads=[torch.ones(2)], on_params=[torch.ones(2).half()])
        grads.on_params_versions = [_compat.version(grads.on_params[0])]
        assert is_faithful_copy(grads, 0, grads.on_params[0]) == (not _compat.GRAD_DTYPE)
        ```
    """
    return (
        not _compat.GRAD_DTYPE and grad is grads.on_params[i] and _compat.version(grad) == grads.on_params_versions[i]
    )


def kept_exactly(kept: list[Gradients]) -> dict[int, Tensor]:
    """``id`` of each half copy that the ``kept`` steps left untouched on its parameter -> its exact fp32 gradient
    (a step taken again steps those, unrounded)."""
    return {
        id(g): mg
        for grads in kept
        for i, (g, mg) in enumerate(zip(grads.on_params, grads.master_grads))
        if is_faithful_copy(grads, i, g)
    }


def sync_shown(grads: Gradients) -> None:
    """Make the master gradients what hooks left on the parameters: a half copy edited in place or another gradient
    assigned is copied in; ``None`` drops the master's (the optimizer skips it)."""
    for i, (p, shown, v) in enumerate(zip(grads.params, grads.on_params, grads.on_params_versions)):
        now, master_grad = p.grad, grads.master_grads[i]
        if now is master_grad or (now is shown and _compat.version(shown) == v):
            continue
        if now is None:
            grads.masters[i].grad = None
        else:
            master_grad.copy_(now)
        if now is shown:
            grads.on_params_versions[i] = _compat.version(shown)


def show_clipping(grads: Gradients) -> None:
    """The half copies shown on the parameters learn of clipping done to the master gradients (on torch >= 2.13
    the parameters show the master gradients themselves: nothing to call this for)."""
    for i, (shown, mg, v) in enumerate(zip(grads.on_params, grads.master_grads, grads.master_versions)):
        if _compat.version(mg) != v:
            shown.copy_(mg)
            grads.master_versions[i] = _compat.version(mg)
            grads.on_params_versions[i] = _compat.version(shown)
