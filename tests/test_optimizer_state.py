"""The optimizer's state and the step's gradients as user code sees them between steps.

The masters' state lives in a mirror keyed by the masters during the step and in the optimizer's own dict outside it
(``core/masters/_groups.py``); the step's fp32 gradients are views of one buffer that the next step reuses when
nothing holds it (``core/masters/_flat.py``). These tests read, reset, replace and keep them the ways real code does,
through a real Trainer, and check them against Adam's own algebra and against copies taken at the time."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from models import WHOLE_STEP, quiet_trainer, regression_data
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
    """Keeps, at the first steps, the gradients that hooks see (the tensors themselves, a view of one, the tensor a
    gradient is a view of, a gradient's storage) with copies taken then, as a gradient-noise or a logging callback
    may."""

    def __init__(self) -> None:
        self.kept: list[tuple[Any, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        # the master's: a view of the step's buffer (torch < 2.13 shows half copies on the parameters)
        master_grad = trainer.precision_plugin.main_params(optimizer)[0].grad
        if trainer.global_step == 0:
            self.kept += [(p.grad, p.grad.clone()) for p in module.parameters()]
        elif trainer.global_step == 1:
            view = next(module.parameters()).grad.view(-1)[:4]
            self.kept.append((view, view.clone()))
        elif trainer.global_step == 2:
            self.kept.append((master_grad._base, master_grad._base.clone()))
        elif trainer.global_step == 3:
            storage = master_grad.untyped_storage()
            self.kept.append((storage, _bytes_of(storage)))


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A copy of the bytes of ``storage`` (the tensor made to read them is not kept)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).clone()


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
    """The masters' fp32 gradients at the hooks are the whole step's (bf16's default chunks hold none there)."""
    keeps = KeepsGradients()
    quiet_trainer(max_steps=5, callbacks=[keeps], plugins=[MPTPrecision(precision, **WHOLE_STEP)]).fit(
        Regression(), regression_data()
    )
    # 4 gradients of the first step, a view of one of the second, the buffer of the third, the storage of the fourth
    assert len(keeps.kept) == 7
    for kept, value in keeps.kept:
        assert torch.equal(_bytes_of(kept) if isinstance(kept, torch.UntypedStorage) else kept, value)


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


class ReadsStateInStepHooks(Regression):
    """AdamW with torch's step pre- and post-hooks on its optimizer that read a module parameter's state by the
    parameter, as a hook that closes over the model may (a logger of Adam's moments, an EMA of them)."""

    def on_fit_start(self) -> None:
        optimizer, weight = self.trainer.optimizers[0], self.net[0].weight
        self.before: list[float | None] = []
        self.after: list[float | None] = []
        optimizer.register_step_pre_hook(lambda opt, *_: self.before.append(_step_of(opt.state[weight])))
        optimizer.register_step_post_hook(lambda opt, *_: self.after.append(_step_of(opt.state[weight])))


def _step_of(entry: dict[str, Any]) -> float | None:
    return float(entry["step"]) if "step" in entry else None


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_step_hooks_that_read_the_state_by_parameter_see_the_live_entries(precision):
    """Inside the step the optimizer holds the masters; a parameter used as a key stands for its master, so the hooks
    read what they read under "32-true", and reading never leaves an empty entry that would reset the state."""
    model = ReadsStateInStepHooks()
    plugin = MPTPrecision(precision, scaler=64.0) if precision == "fp16" else MPTPrecision(precision)
    trainer = quiet_trainer(max_steps=4, plugins=[plugin])
    trainer.fit(model, regression_data())
    assert plugin.skipped_steps == 0
    assert model.before == [None, 1.0, 2.0, 3.0]
    assert model.after == [1.0, 2.0, 3.0, 4.0]
    state = trainer.optimizers[0].state
    assert set(state) == set(model.parameters())
    assert {float(entry["step"]) for entry in state.values()} == {4.0}


def test_fabric_step_hooks_that_read_the_state_by_parameter_see_the_live_entries():
    from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricMPTPrecision("bf16")])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen: list[float | None] = []
    weight = model[0].weight
    optimizer.register_step_post_hook(lambda opt, *_: seen.append(_step_of(opt.state[weight])))
    model, optimizer = fabric.setup(model, optimizer)
    for x, y in regression_data():
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
    assert seen == [1.0, 2.0, 3.0, 4.0]
    assert {float(entry["step"]) for entry in optimizer.optimizer.state.values()} == {4.0}


class RoundTripsThroughTheWrapper(Regression):
    """Loads the optimizer's own state dict back through ``self.optimizers()`` (Lightning's ``LightningOptimizer``)
    before steps 2 and 4."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step in (2, 4):
            optimizer = self.optimizers()
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_state_dict_round_trip_through_lightnings_optimizer_wrapper_changes_nothing(precision):
    """The wrapper loads into its own attributes, not the optimizer's (as under any precision): the masters must not
    stay in the optimizer's groups, whose next ``state_dict()`` would fail on them. The run equals the same run
    without the round trip, bitwise (one machine, the same operations in the same order)."""
    results = []
    for make in (Regression, RoundTripsThroughTheWrapper):
        torch.manual_seed(0)
        module = make()  # the same initial weights
        trainer = quiet_trainer(max_steps=6, plugins=[MPTPrecision(precision)])
        trainer.fit(module, regression_data(n=96))
        optimizer = trainer.optimizers[0]
        assert all(p in set(module.parameters()) for p in optimizer.param_groups[0]["params"])
        assert len(optimizer.state_dict()["state"]) == 4
        results.append([p.detach().clone() for p in module.parameters()])
    for plain, round_tripped in zip(*results):
        assert torch.equal(plain, round_tripped)
