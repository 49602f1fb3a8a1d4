"""An optimizer step taken again with no backward in between, and gradients not zeroed between steps, behave as
under "32-true": the second step uses the same true gradients again (or none after ``zero_grad``), and a backward
accumulates into the gradients the last step left. The references are hand computations with the masters' own
fp32 values (SGD's update is ``w - lr * g``), and "32-true".

Before the fix, the second step divided the gradients by the loss scale a second time (its update was 1/65536 of
the first), and a backward after a step without ``zero_grad`` added scaled gradients to unscaled ones.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import pytest
import torch
from models import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision
from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision

LR = 0.1


def masters(plugin: Any, module: nn.Module) -> list[torch.Tensor]:
    return [plugin.master_of(p).detach().clone() for p in module.parameters()]


def master_grads(plugin: Any, module: nn.Module) -> list[Optional[torch.Tensor]]:
    """The fp32 gradients the last step used: kept on the masters until the next forward or backward (the whole step),
    or made again from the half ones left on the parameters (bf16's chunked step: a copy, no loss scale)."""
    grads = [plugin.master_of(p).grad for p in module.parameters()]
    if plugin.chunked_step and plugin.loss_scale == 1.0:
        grads = [p.grad.float() if g is None and p.grad is not None else g for p, g in zip(module.parameters(), grads)]
    return [None if g is None else g.detach().clone() for g in grads]


def sgd_step(weights: list[torch.Tensor], grads: list[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """What ``torch.optim.SGD(lr=LR)`` does to fp32 weights: ``w.add_(g, alpha=-lr)`` (the same kernel)."""
    return [w if g is None else w.add(g, alpha=-LR) for w, g in zip(weights, grads)]


class StepTwice(L.LightningModule):
    """Manual optimization that steps twice after one backward, maybe with ``zero_grad`` in between."""

    def __init__(self, zero_grad_between: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.zero_grad_between = zero_grad_between
        self.net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
        self.seen: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        plugin = self.trainer.precision_plugin
        opt.zero_grad()
        self.manual_backward(self.net(batch[0]).float().pow(2).mean())
        before = masters(plugin, self)
        opt.step()
        first = {"before": before, "after": masters(plugin, self), "grads": master_grads(plugin, self)}
        if self.zero_grad_between:
            opt.zero_grad()
        opt.step()
        self.seen.append({**first, "again": masters(plugin, self)})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def batches(n: int = 3) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n * 4, 8, generator=g)), batch_size=4)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("zero_grad_between", [False, True])
def test_trainer_a_second_step_without_a_backward_is_the_same_step_again(precision, zero_grad_between):
    torch.manual_seed(0)
    model = StepTwice(zero_grad_between)
    scaler = 2.0**8 if precision == "fp16" else None  # a scale under which no step overflows: every step moves
    trainer = quiet_trainer(max_epochs=1, plugins=[MPTPrecision(precision, scaler=scaler)])
    trainer.fit(model, batches())
    assert trainer.precision_plugin.skipped_steps == 0
    for seen in model.seen:
        # the first step: w - lr * g, with the unscaled fp32 gradient g
        assert all(torch.equal(a, b) for a, b in zip(seen["after"], sgd_step(seen["before"], seen["grads"])))
        # the second: nothing after zero_grad; otherwise the same g again (the old code divided it by the scale again)
        expected = seen["after"] if zero_grad_between else sgd_step(seen["after"], seen["grads"])
        assert all(torch.equal(a, b) for a, b in zip(seen["again"], expected))


def fabric_setup(precision: str, scaler: Any = None) -> tuple[L.Fabric, Any, nn.Module, Any]:
    torch.manual_seed(0)
    plugin = FabricMPTPrecision(precision, scaler=scaler)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    return fabric, plugin, model, opt


def inputs(seed: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("zero_grad_between", [False, True])
def test_fabric_a_second_step_without_a_backward_is_the_same_step_again(precision, zero_grad_between):
    fabric, plugin, model, opt = fabric_setup(precision, scaler=2.0**8 if precision == "fp16" else None)
    module = model.module
    for seed in range(3):
        opt.zero_grad()
        fabric.backward(model(inputs(seed)).pow(2).mean())
        before = masters(plugin, module)
        opt.step()
        after, grads = masters(plugin, module), master_grads(plugin, module)
        assert all(torch.equal(a, b) for a, b in zip(after, sgd_step(before, grads)))
        if zero_grad_between:
            opt.zero_grad()
        opt.step()
        expected = after if zero_grad_between else sgd_step(after, grads)
        assert all(torch.equal(a, b) for a, b in zip(masters(plugin, module), expected))
    assert plugin.skipped_steps == 0


def test_fabric_a_backward_after_a_step_without_zero_grad_accumulates_as_under_32_true():
    """No ``zero_grad`` after a step: the next step's gradient is the last step's plus the new one, as under
    "32-true" (the old code added the new scaled gradient to the unscaled old one: the old one counted 1/scale)."""
    scale = 2.0**10
    fabric, plugin, model, opt = fabric_setup("fp16", scaler=scale)
    module = model.module
    fabric.backward(model(inputs(0)).pow(2).mean())
    opt.step()
    first = master_grads(plugin, module)
    after_first = masters(plugin, module)
    loss = model(inputs(1)).pow(2).mean()
    # the second batch's own gradient, at the same weights, from a copy of the half model (the plugin's model untouched)
    twin = [p.detach().clone().requires_grad_() for p in module.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        out = torch.func.functional_call(module, dict(zip([n for n, _ in module.named_parameters()], twin)), inputs(1))
    own = torch.autograd.grad(out.float().pow(2).mean(), twin)
    fabric.backward(loss)
    opt.step()
    got = [(a - b) / LR for a, b in zip(after_first, masters(plugin, module))]  # SGD: the gradient stepped
    for g, g1, g2 in zip(got, first, own):
        want = g1 + g2.float()
        # summed in the half format at scale 2^10: a few half ulps of the scaled sum; the old code was off by ~g1
        bound = 4 * 2.0**-10 * (g1.abs() + g2.float().abs()).max() + 1e-6
        assert (g - want).abs().max() <= bound
        assert (g - g2.float()).abs().max() > 10 * bound  # the first step's gradient counted in full
    assert plugin.skipped_steps == 0
