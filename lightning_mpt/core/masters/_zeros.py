"""Zero gradients that stand for none: given to parameters so that something can accumulate into them (fp32
accumulation over micro-batches, ``zero_grad(set_to_none=False)`` after a skipped step), and taken back at the step
where nothing did, so that the optimizer leaves those parameters alone, as under "32-true"."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_mpt import _compat


class StandInZeros:
    """The zero gradients given to parameters that stand for no gradient until something writes into them.

    A backward's accumulation into zeros given for it is seen by a post-accumulate hook; zeros left by a skipped step
    count as written once their version counter moves (``zero_grad(set_to_none=False)``, a backward).

    Example:
        ```python
        w = torch.nn.Parameter(torch.ones(2))
        zeros = StandInZeros()
        zeros.give(w, torch.zeros(2), track_version=True)
        zeros.take_back_unused()
        assert w.grad is None  # nothing wrote into them
        ```
    """

    def __init__(self) -> None:
        # parameter -> zeros given to it as its gradient: their version then, or None where only a backward's
        # accumulation counts (:meth:`accumulate_in_fp32`); read by the step to skip these calls when empty
        self.given: dict[Tensor, tuple[Tensor, Optional[int]]] = {}
        self._hooks: dict[Tensor, RemovableHandle] = {}  # the hooks that see a backward accumulate into a parameter

    def give(self, param: Tensor, zeros: Tensor, track_version: bool) -> None:
        """Make ``zeros`` ``param``'s gradient, standing for none until written into: until its version counter
        moves (``track_version``), else until a backward accumulates into it."""
        param.grad = zeros
        self.given[param] = (zeros, _compat.version(zeros) if track_version else None)
        if not track_version and param not in self._hooks:
            self._hooks[param] = param.register_post_accumulate_grad_hook(self._accumulated_into)

    def _accumulated_into(self, param: Tensor) -> None:
        """A backward accumulated into ``param``'s gradient: zeros given to it are a sum of gradients now."""
        self.given.pop(param, None)

    def take_back_unused(self) -> None:
        """Take back the zeros that nothing wrote into (the parameter's gradient is ``None`` again)."""
        for p, (zeros, version) in self.given.items():
            if p.grad is zeros and (version is None or _compat.version(zeros) == version):
                p.grad = None
        self.given.clear()

    def forget_replaced(self) -> None:
        """Forget the zeros that are no longer their parameter's gradient."""
        if self.given:
            self.given = {p: (z, v) for p, (z, v) in self.given.items() if p.grad is z}

    def accumulate_in_fp32(self, masters: dict[Tensor, Tensor], sync: bool, zeros: bool = True) -> None:
        """Before a backward: give the half parameters of ``masters`` fp32 gradients for autograd to accumulate into
        (``zeros``: zeros at the start of a window; else a parameter without a gradient keeps none, and one that a
        backward makes is a single micro-batch's, exact in the half format), so micro-batches are summed in fp32, not
        in the half format (torch >= 2.13).

        ``sync``: the backward reduces gradients across processes (DDP's last micro-batch); the reducer insists on
        the parameter's dtype, so the fp32 sum so far goes back to the half format, rounded once.

        A parameter that no backward gives a gradient (unused, or frozen) has none at the step, as under "32-true",
        so the optimizer leaves it alone: zeros nothing was accumulated into are taken back
        (:meth:`take_back_unused`).
        """
        if sync:
            self.take_back_unused()
        for p, m in masters.items():
            if not p.requires_grad:
                continue
            g = p.grad
            if sync:
                p.grad = None if g is None else g.to(p.dtype)
            elif g is None and zeros:
                # a backward's accumulation into them takes them off the list; nothing else does (a clip that
                # multiplies every gradient in place leaves them zeros nothing was accumulated into)
                self.give(p, torch.zeros_like(m), track_version=False)
            elif g is not None and g.dtype != torch.float32:
                p.grad = g.float()

    def reset(self) -> None:
        """Forget every zero and remove the hooks."""
        self.given.clear()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
