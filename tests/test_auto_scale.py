"""``DynamicLossScaler(init_scale="auto")`` through a real Trainer and a real Fabric: the first step measures the
gradients' range and is taken; no step is skipped at the start on models whose gradients need a scale of about 2^4,
2^16 or 2^24; afterwards the run is the run of a scaler started at the chosen scale; a resumed run never measures
again. (Under DDP: tests/test_ddp.py.)"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from models import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import DynamicLossScaler, MPTPrecision, NonFiniteGradientError
from lightning_mpt.core.scaler import AUTO_MARGIN
from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision

# loss factors that put the largest safe scale of Ranged's gradients at about 2^4, 2^16 and 2^24 (2^24: max_scale)
FACTORS = {4: 2.0**8, 16: 2.0**-4, 24: 2.0**-13}


def data(n: int = 96) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)), batch_size=16)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


class Ranged(L.LightningModule):
    """An MLP whose loss is multiplied by ``factor``: its gradients, and the scale they need, move with it."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.net, self.factor = net(), factor
        self.masters: list[list[torch.Tensor]] = []  # the fp32 masters after each optimizer step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.factor * nn.functional.mse_loss(self.net(x).float(), y)

    def on_train_batch_end(self, *args: Any) -> None:
        plugin = self.trainer.precision_plugin
        self.masters.append([m.detach().clone() for _, _, m in plugin.named_masters()])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3 / self.factor)


def expected_scale(factor: float) -> float:
    """The scale that the rule picks from the first batch's gradients, computed in fp32 (no fp16 anywhere)."""
    model = net()
    x, y = next(iter(data()))
    (factor * nn.functional.mse_loss(model(x), y)).backward()
    amax = max(p.grad.abs().max().item() for p in model.parameters())
    return min(2.0 ** math.floor(math.log2(65504 / amax)) / AUTO_MARGIN, 2.0**24)


def fit(factor: float, init_scale: Any, steps: int = 6, **kwargs: Any) -> tuple[MPTPrecision, Ranged]:
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=init_scale, growth_interval=2))
    model = Ranged(factor)
    quiet_trainer(max_steps=steps, plugins=[plugin], **kwargs).fit(model, data())
    return plugin, model


@pytest.mark.parametrize("power", sorted(FACTORS))
def test_no_skipped_step_at_the_start_and_then_a_fixed_scaler_at_the_chosen_scale(power: int) -> None:
    auto, auto_model = fit(FACTORS[power], "auto")
    chosen = auto.history[1].scale
    assert chosen == expected_scale(FACTORS[power])
    assert abs(math.log2(chosen) - power) <= 1  # the model needs the scale it was built to need
    assert not any(r.skipped for r in auto.history)
    assert auto.history[0].scale == 1.0  # the measuring step is taken, at scale 1
    # afterwards: step for step the run of DynamicLossScaler(init_scale=chosen) (growth_interval=2: it grows too)
    fixed, fixed_model = fit(FACTORS[power], chosen)
    assert [(r.scale, r.skipped) for r in auto.history][1:] == [(r.scale, r.skipped) for r in fixed.history][1:]
    assert auto.scaler.state_dict() == fixed.scaler.state_dict()
    if power == 4:
        # large gradients: scale 1 loses nothing in fp16, so the measuring step is the fixed run's first step, bit
        # for bit (both runs do the same math in the same order on one process), and so is every later step
        for a, b in zip(auto_model.masters, fixed_model.masters):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    if power == 4:
        plain, _ = fit(FACTORS[power], 2.0**16)
        assert plain.skipped_steps >= 5  # what the auto scale avoids: 2^16 backs off one overflow at a time


def test_a_resumed_run_never_measures_again(tmp_path: Path) -> None:
    path = tmp_path / "two.ckpt"
    trainer = quiet_trainer(max_steps=2, plugins=[MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale="auto"))])
    trainer.fit(Ranged(FACTORS[16]), data())
    trainer.save_checkpoint(path)
    assert "measuring" not in torch.load(path, weights_only=False)["MPTPrecision"]["scaler"]
    chosen = trainer.precision_plugin.loss_scale
    # a model whose gradients would measure another scale: the resumed run keeps the one in the checkpoint
    assert expected_scale(FACTORS[24]) != chosen
    resumed = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale="auto"))
    quiet_trainer(max_steps=4, plugins=[resumed]).fit(Ranged(FACTORS[24]), data(), ckpt_path=str(path))
    assert [r.scale for r in resumed.history] == [chosen, chosen]
    assert resumed.loss_scale == chosen
    assert not resumed.scaler.measuring


class NaNFirst(Ranged):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if batch_idx == 0 else loss


def test_a_measuring_step_with_a_nan_loss_is_reported_and_measured_again() -> None:
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale="auto"))
    with pytest.warns(UserWarning, match=r"measures the loss scale .* was skipped: at scale 1 the loss itself was"):
        quiet_trainer(max_steps=3, plugins=[plugin]).fit(NaNFirst(FACTORS[16]), data())
    assert [(r.scale, r.skipped) for r in plugin.history] == [(1.0, True), (1.0, False), (plugin.loss_scale, False)]
    # the skipped measuring step left no trace in the scaler: it is a fixed scaler at the chosen scale after 2 steps
    fixed = DynamicLossScaler(init_scale=plugin.loss_scale)
    fixed.update(False)
    fixed.update(False)
    assert plugin.scaler.state_dict() == fixed.state_dict()


def test_gradients_that_overflow_at_scale_1_stop_the_run() -> None:
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale="auto"))
    with pytest.raises(NonFiniteGradientError, match="minimum loss scale"):
        quiet_trainer(max_steps=3, plugins=[plugin]).fit(Ranged(1e7), data())
    assert plugin.skipped_steps == 1


def test_fabric_measures_the_first_step() -> None:
    plugin = FabricMPTPrecision("fp16", scaler=DynamicLossScaler(init_scale="auto"))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    for x, y in list(data())[:3]:
        fabric.backward(FACTORS[4] * nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    plugin.restore()
    chosen = expected_scale(FACTORS[4])
    assert [(r.scale, r.skipped) for r in plugin.history] == [(1.0, False), (chosen, False), (chosen, False)]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="init_scale must be a finite number > 0 or 'auto', got 'automatic'"):
        DynamicLossScaler(init_scale="automatic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="init_scale='auto' needs room to choose"):
        DynamicLossScaler(init_scale="auto", min_scale=8.0, max_scale=8.0)
    with pytest.raises(ValueError, match="bf16 has fp32's range and needs no loss scale"):
        MPTPrecision("bf16", scaler=DynamicLossScaler(init_scale="auto"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DynamicLossScaler(init_scale="auto", min_scale=2.0**-4).scale == 1.0  # measures at 1 where it may
        assert DynamicLossScaler(init_scale="auto", min_scale=4.0).scale == 4.0
