"""The optimizer's state and the step's gradients as user code sees them between steps.

The masters' state lives in a mirror keyed by the masters during the step and in the optimizer's own dict outside it
(``core/masters/_groups.py``); the step's fp32 gradients are views of one buffer that the next step reuses when
nothing holds it (``core/masters/_flat.py``). These tests read, reset, replace and keep them the ways real code does,
through a real Trainer, and check them against Adam's own algebra and against copies taken at the time."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from models import quiet_trainer, regression_data
from torch import nn

from lightning_mpt import MPTPrecision

BETAS = (0.9, 0.999)


class ManualAdam(L.LightningModule):
    """Manual optimization that reads ``self.optimizers().state`` after each step, and resets one parameter's state
    at one step, the way given by ``reset``: ``"del"`` (``del state[p]``), ``"new"`` (``state[p] = {}``), ``"clear"``
    (``state[p].clear()``) or ``None``."""

    def __init__(self, reset: str | None = None, at: int = 2) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        self.reset, self.at = reset, at
        self.seen: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        if batch_idx == 0:
            self.state_at_start = opt.state  # as code that keeps a reference to the optimizer's state may
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        state, weight = opt.state, self.net[0].weight
        self.seen.append({
            "same_object": state is opt.optimizer.state and state is self.state_at_start,
            "keys_are_params": set(state) <= set(self.parameters()),
            "steps": {n: float(state[p]["step"]) for n, p in self.named_parameters()},
            "ratio": (state[weight]["exp_avg"].pow(2) / state[weight]["exp_avg_sq"]).flatten(),
            "dtype": state[weight]["exp_avg"].dtype,
        })
        if batch_idx == self.at - 1 and self.reset is not None:
            if self.reset == "del":
                del state[weight]
            elif self.reset == "new":
                state[weight] = {}
            else:
                state[weight].clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2, betas=BETAS)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_wrappers_state_is_the_optimizers_own_dict_keyed_by_the_parameters(precision):
    model = ManualAdam()
    quiet_trainer(max_steps=4, plugins=[MPTPrecision(precision)]).fit(model, regression_data())
    # the optimizer's own dict, the one a reference taken before the first step still holds
    assert [s["same_object"] for s in model.seen] == [True] * 4
    assert all(s["keys_are_params"] for s in model.seen)
    assert [set(s["steps"].values()) for s in model.seen] == [{1.0}, {2.0}, {3.0}, {4.0}]
    assert {s["dtype"] for s in model.seen} == {torch.float32}


@pytest.mark.parametrize("reset", ["del", "new", "clear"])
def test_a_state_reset_between_steps_restarts_that_parameter_only(reset):
    model = ManualAdam(reset=reset, at=2)
    quiet_trainer(max_steps=4, plugins=[MPTPrecision("bf16")]).fit(model, regression_data())
    weight_steps = [s["steps"]["net.0.weight"] for s in model.seen]
    other_steps = [s["steps"]["net.2.weight"] for s in model.seen]
    assert weight_steps == [1.0, 2.0, 1.0, 2.0]  # the reset parameter starts again at the step after the reset
    assert other_steps == [1.0, 2.0, 3.0, 4.0]
    # after one step of Adam from zero state: exp_avg = (1 - b1) g and exp_avg_sq = (1 - b2) g^2, whatever g is
    first = model.seen[2]["ratio"]
    expected = torch.full_like(first, (1 - BETAS[0]) ** 2 / (1 - BETAS[1]))
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=0)


class Counting(torch.optim.Optimizer):
    """SGD that replaces each parameter's state entry with a new dict at every step (as some custom optimizers do)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                count = self.state[p].get("count", 0)
                self.state[p] = {"count": count + 1, "dtype": p.dtype}
                p.add_(p.grad, alpha=-group["lr"])
        return loss


class CountingModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 4)
        self.counts: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_train_batch_end(self, *args: Any) -> None:
        state = self.trainer.optimizers[0].state
        self.counts.append([state[p]["count"] for p in self.parameters()])
        assert {state[p]["dtype"] for p in self.parameters()} == {torch.float32}  # it stepped the masters

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return Counting(self.parameters())


def test_state_entries_an_optimizer_replaces_in_its_step_are_the_ones_seen_after_it():
    model = CountingModule()
    quiet_trainer(max_steps=3, plugins=[MPTPrecision("bf16")]).fit(model, regression_data())
    assert model.counts == [[1, 1], [2, 2], [3, 3]]


class KeepsGradients(L.Callback):
    """Keeps, at the first two steps, the gradients that hooks see (the tensors themselves, and a view of one) with
    copies taken then, as a gradient-noise or a logging callback may."""

    def __init__(self) -> None:
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == 0:
            self.kept += [(p.grad, p.grad.clone()) for p in module.parameters()]
        elif trainer.global_step == 1:
            view = next(module.parameters()).grad.view(-1)[:4]
            self.kept.append((view, view.clone()))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gradients_a_callback_keeps_are_never_overwritten_by_later_steps(precision):
    keeps = KeepsGradients()
    quiet_trainer(max_steps=5, callbacks=[keeps], plugins=[MPTPrecision(precision)]).fit(
        Regression(), regression_data()
    )
    assert len(keeps.kept) == 5  # 4 gradients of the first step, a view of one of the second
    for kept, copy in keeps.kept:
        assert torch.equal(kept, copy)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fabric_optimizer_state_is_keyed_by_the_parameters_and_shared_with_its_wrapper(precision):
    from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricMPTPrecision(precision)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2, betas=BETAS))
    for x, y in regression_data():
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    raw = optimizer.optimizer
    assert optimizer.state is raw.state  # the wrapper shares the optimizer's own dict
    assert set(raw.state) == set(model.parameters())
    assert {float(st["step"]) for st in raw.state.values()} == {4.0}  # 64 samples in batches of 16
    assert {st["exp_avg"].dtype for st in raw.state.values()} == {torch.float32}
