"""LR schedules that skipped steps do not advance (``skipped_steps_advance_schedulers=False``), through a real Trainer
and a real Fabric, against LR sequences computed by hand. Each model makes its loss non-finite at chosen batches, so
exactly those optimizer steps are skipped."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import DynamicLossScaler, MPTPrecision
from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision


def data(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=2)


class Scheduled(L.LightningModule):
    """A Linear(4, 1) with SGD and a StepLR that halves the LR at each of its steps; the loss is NaN at the
    ``(epoch, batch)`` pairs in ``bad``. ``lrs`` holds the LR each optimizer step ran with."""

    def __init__(self, bad: set[tuple[int, int]], interval: str = "step") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.bad, self.interval = bad, interval
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x).float(), y)
        return loss * math.nan if (self.current_epoch, batch_idx) in self.bad else loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": self.interval}}


def plugin(advance: bool) -> MPTPrecision:
    return MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=1024.0), skipped_steps_advance_schedulers=advance)


@pytest.mark.parametrize("advance", [True, False])
def test_step_schedule_with_gradient_accumulation(advance: bool) -> None:
    # 4 optimizer steps of 2 micro-batches; a NaN in micro-batch 3 (step 1) and 4 (step 2) skips steps 1 and 2
    model, mpt = Scheduled(bad={(0, 3), (0, 4)}), plugin(advance)
    quiet_trainer(max_steps=4, accumulate_grad_batches=2, plugins=[mpt]).fit(model, data(16))
    assert [r.skipped for r in mpt.history] == [False, True, True, False]
    # Lightning: every step halves the LR; Megatron: only the steps taken (0 and 3) do
    assert model.lrs == ([1.0, 0.5, 0.25, 0.125] if advance else [1.0, 0.5, 0.5, 0.5])
    scheduler = model.lr_schedulers()
    assert scheduler.get_last_lr() == ([0.0625] if advance else [0.25])
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR  # the plugin gave the scheduler its class back


def test_epoch_schedule_resumes_mid_epoch_as_the_uninterrupted_run(tmp_path: Path) -> None:
    # 4 batches an epoch. Epoch 0: every step skipped, so its end does not advance the schedule. Epoch 1: steps 0, 1
    # and 3 skipped, step 2 taken, so its end does. The checkpoint after step 2 of epoch 1 must carry that step 2 ran.
    bad = {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 3)}
    full = Scheduled(bad, interval="epoch")
    quiet_trainer(max_epochs=3, plugins=[plugin(False)]).fit(full, data(8))
    assert full.lrs == [1.0] * 8 + [0.5] * 4

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=7, save_top_k=-1)
    first = Scheduled(bad, interval="epoch")
    quiet_trainer(max_steps=7, plugins=[plugin(False)], callbacks=[ckpt], enable_checkpointing=True).fit(first, data(8))
    resumed = Scheduled(bad, interval="epoch")
    path = tmp_path / "epoch=1-step=7.ckpt"
    quiet_trainer(max_epochs=3, plugins=[plugin(False)]).fit(resumed, data(8), ckpt_path=str(path))
    assert first.lrs + resumed.lrs == full.lrs


class TwoOptimizers(L.LightningModule):
    """Manual optimization: two Linear layers, each with its SGD and a StepLR stepped after each of its steps; the
    first layer's loss is NaN at the batches in ``bad``."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 1)
        self.automatic_optimization = False
        self.bad = bad
        self.skipped: list[tuple[bool, bool]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        for opt, sch, layer, bad in zip(self.optimizers(), self.lr_schedulers(), (self.a, self.b), (True, False)):
            loss = nn.functional.mse_loss(layer(x).float(), y)
            opt.zero_grad()
            self.manual_backward(loss * math.nan if bad and batch_idx in self.bad else loss)
            opt.step()
            sch.step()
        plugin = self.trainer.precision_plugin
        self.skipped.append(tuple(plugin.last_step_skipped_for(opt) for opt in self.optimizers()))

    def configure_optimizers(self) -> Any:
        opts = [torch.optim.SGD(layer.parameters(), lr=1.0) for layer in (self.a, self.b)]
        return opts, [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in opts]


def test_several_optimizers_each_schedule_follows_its_own_steps() -> None:
    model, mpt = TwoOptimizers(bad={1, 2}), plugin(False)
    quiet_trainer(max_steps=8, plugins=[mpt]).fit(model, data(8))
    assert model.skipped == [(False, False), (True, False), (True, False), (False, False)]
    sch_a, sch_b = model.lr_schedulers()
    assert sch_a.get_last_lr() == [0.5**2]  # 2 of its 4 steps were taken
    assert sch_b.get_last_lr() == [0.5**4]


def fabric_lrs(advance: bool, bad: set[int], steps: int = 5) -> tuple[list[float], list[bool]]:
    """A Fabric loop with a StepLR stepped after every ``optimizer.step()``: the LR of each step, and which were
    skipped (``last_step_skipped_for``)."""
    mpt = FabricMPTPrecision(
        "fp16", scaler=DynamicLossScaler(init_scale=1024.0), skipped_steps_advance_schedulers=advance
    )
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mpt])
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    mpt.setup_schedulers(scheduler)
    lrs, skipped = [], []
    for i, (x, y) in enumerate(data(2 * steps)):
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss * math.nan if i in bad else loss)
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        skipped.append(mpt.last_step_skipped_for(optimizer))
    mpt.restore()
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR
    return lrs, skipped


@pytest.mark.parametrize("advance", [True, False])
def test_fabric_schedule(advance: bool) -> None:
    lrs, skipped = fabric_lrs(advance, bad={0, 2, 3})
    assert skipped == [True, False, True, True, False]
    assert lrs == ([1.0, 0.5, 0.25, 0.125, 0.0625] if advance else [1.0, 1.0, 0.5, 0.5, 0.5])


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="skipped_steps_advance_schedulers='no'.*expected a bool"):
        MPTPrecision("fp16", skipped_steps_advance_schedulers="no")  # type: ignore[arg-type]
    mpt = FabricMPTPrecision("bf16", skipped_steps_advance_schedulers=False)
    with pytest.raises(TypeError, match="object has no torch optimizer"):
        mpt.setup_schedulers(object())
