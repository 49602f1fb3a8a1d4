"""The fp32 re-run of a batch with the master weights, leaving every state as it was: the fp32 reference.

The re-run swaps fp32 weights in with ``torch.func.functional_call`` (the parameters, their gradients and DDP's hooks
are never touched), restores buffers and torchmetrics states, and replays the random state the real step started
from, so that dropout draws the same masks.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_mpt._compat import fsdp_forward_hooks_suspended, metric_private_state
from lightning_mpt.core.masters import HALF_DTYPES
from lightning_mpt.diagnostics.params import ParamTable


def reference_gradients(
    module: nn.Module,
    table: ParamTable,
    plugin: Any,
    run: Callable[..., Any],
    args: tuple[Any, ...] = (),
    rng: Optional[dict[str, Any]] = None,
    divisor: float = 1.0,
) -> Optional[list[Optional[Tensor]]]:
    """fp32 gradients of a loss for ``table``'s parameters, computed with the fp32 masters, leaving every state as
    it was.

    ``run`` runs with ``module``'s parameters replaced by fp32 weights (the masters; other half parameters cast to
    fp32), autocast off and the floating-point tensors of ``args`` cast to fp32; buffers and torchmetrics states it
    updates are restored. Under FSDP2 (``table.shards`` given) the whole fp32 weights are gathered first (a collective
    that every process enters before any of ``run``'s code) and ``run`` goes with ``fully_shard``'s hooks suspended:
    each process differentiates its own batch with respect to the whole weights, as under DDP.

    Args:
        module: the model.
        table: its parameters computed in the half format.
        plugin: the precision plugin that holds the masters.
        run: ``run(module, *args)`` returns the loss (a tensor, or a mapping with ``"loss"``).
        args: the arguments of ``run`` after the module.
        rng: a :func:`rng_state` taken before the real forward: the re-run draws the same random numbers (dropout
            masks), and the random state continues afterwards where it was.
        divisor: divides the loss (gradient accumulation).

    Returns:
        One fp32 gradient per parameter of ``table`` (``None`` where unused); ``None`` when ``run`` returned nothing
        to differentiate.

    Example:
        ```python
        import torch
        from torch import nn
        from lightning_mpt.diagnostics.params import ParamTable
        from lightning_mpt.diagnostics.replay import reference_gradients
        from lightning_mpt.fabric import MPTPrecision

        plugin = MPTPrecision("fp16")
        model = plugin.convert_module(nn.Linear(4, 2))       # half weights, fp32 masters
        x = torch.randn(8, 4)
        grads = reference_gradients(model, ParamTable(model, plugin), plugin, lambda m, x: m(x).pow(2).mean(), (x,))
        master = plugin.master_of(model.weight).detach().requires_grad_()
        (expected,) = torch.autograd.grad((x @ master.T + plugin.master_of(model.bias)).pow(2).mean(), [master])
        assert grads[0].dtype == torch.float32 and torch.allclose(grads[0], expected)
        plugin.restore()
        ```
    """
    # FSDP2: the parameters are fp32 shards (the masters), gathered whole first, before any user code runs
    whole = table.full_weights(module)
    masters = table.masters(plugin) if table.shards is None else [None] * len(table)
    # a master not yet next to its parameter (a plugin moves them at the first forward) is copied there
    weights = {
        n: (
            whole[n].float() if n in whole else m.detach().to(p.device) if m is not None else p.detach().float()
        ).requires_grad_(p.requires_grad)
        for n, p, m in zip(table.names, table.params, masters)
    }
    # the other sharded parameters (fp32 norm layers) whole, other half parameters ("16-true" norm layers) in fp32
    weights.update({n: w.float() for n, w in whole.items() if n not in weights})
    weights.update({
        n: p.detach().float() for n, p in module.named_parameters() if p.dtype in HALF_DTYPES and n not in weights
    })
    inputs = apply_to_collection(args, Tensor, lambda t: t.float() if t.is_floating_point() else t)
    device = next((w.device for w in weights.values()), torch.device("cpu"))
    with ExitStack() as stack:
        if whole:  # nothing of FSDP2 runs: no all-gather of the half copy, no reduce-scatter into the gradients
            stack.enter_context(fsdp_forward_hooks_suspended(module))
        stack.enter_context(restored_state(module))
        if rng is not None:
            stack.enter_context(replayed_rng(rng))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autocast(device.type, enabled=False))
        out = torch.func.functional_call(
            _LossModule(module, run), {f"module.{n}": w for n, w in weights.items()}, tuple(inputs), strict=False
        )
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            return None
        if divisor != 1.0:
            loss = loss / divisor
        wanted = [i for i, p in enumerate(table.params) if p.requires_grad]
        found = torch.autograd.grad(loss, [weights[table.names[i]] for i in wanted], allow_unused=True)
    grads: list[Optional[Tensor]] = [None] * len(table)
    for i, g in zip(wanted, found):
        grads[i] = g
    return grads


class _LossModule(nn.Module):
    """``run(module, *args)`` as a forward, so that ``torch.func.functional_call`` can swap ``module``'s weights."""

    def __init__(self, module: nn.Module, run: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self.run = run

    def forward(self, *args: Any) -> Any:
        return self.run(self.module, *args)


@contextmanager
def restored_state(module: nn.Module) -> Iterator[None]:
    """Restore buffers (BatchNorm running statistics) and torchmetrics states that code run inside may update."""
    buffers = [(m, name, b, b.clone()) for m in module.modules() for name, b in m.named_buffers(recurse=False)]
    metrics = [(m, metric_state(m)) for m in module.modules() if isinstance(m, Metric)]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, copy in buffers:
                if getattr(m, name) is not b:
                    setattr(m, name, b)  # the re-run rebound it: put the original back (Module.__setattr__)
                b.copy_(copy)
        for m, state in metrics:
            for k, v in state.items():
                setattr(m, k, v)


def metric_state(m: Metric) -> dict[str, Any]:
    """A copy of everything ``update``, ``forward`` and ``compute`` change in the torchmetrics ``Metric`` ``m``: its
    declared states (tensors cloned, lists copied) and the caches outside them; ``setattr`` each item to restore it.

    Args:
        m: the metric.

    Example:
        ```python
        import torch
        from torchmetrics import SumMetric

        total = SumMetric()
        saved = metric_state(total)
        total.update(torch.tensor(3.0))
        for name, value in saved.items():
            setattr(total, name, value)
        assert float(total.compute()) == 0.0
        ```
    """
    state = {k: (v.clone() if isinstance(v, Tensor) else list(v)) for k, v in m.metric_state.items()}
    state.update(metric_private_state(m))
    return state


def rng_state() -> dict[str, Any]:
    """The random state of torch (CPU and, once initialised, CUDA), Python and NumPy (if imported)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a state of :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


@contextmanager
def replayed_rng(state: dict[str, Any]) -> Iterator[None]:
    """Run with the random state ``state`` (same dropout masks as the real step), then continue where it was."""
    now = rng_state()
    set_rng_state(state)
    try:
        yield
    finally:
        set_rng_state(now)
