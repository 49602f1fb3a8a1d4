"""``MPTPrecision(overflow_retries=N)``: a batch whose gradients overflowed runs again at the backed-off scale, so no
batch is lost; the retries' side effects are those of running the batch again."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from models import InjectInf, SmallCNN, classification_images, quiet_trainer, regression_data
from torch import nn

from lightning_mpt import DynamicLossScaler, MPTPrecision, SkipPolicy
from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision

STEPS = 4


class Loud(L.LightningModule):
    """Linear layers whose loss is multiplied by 2**12: at the default scale of 2**16 its gradients overflow fp16."""

    def __init__(self, nan_at: int = -1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.nan_at = nan_at
        self.calls = 0  # training_step runs

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y) * 2.0**12
        return loss * math.nan if batch_idx == self.nan_at else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _fit(
    model: L.LightningModule, init_scale: float, retries: int, data: Any = None, **kwargs: Any
) -> tuple[L.LightningModule, MPTPrecision]:
    scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=1000)
    plugin = MPTPrecision("fp16", scaler=scaler, overflow_retries=retries)
    trainer = quiet_trainer(max_steps=STEPS, plugins=[plugin], **kwargs)
    trainer.fit(model, data if data is not None else regression_data(n=64, batch_size=16))
    return model, plugin


def test_an_overflowing_batch_runs_again_at_the_lower_scale_and_no_batch_is_lost() -> None:
    torch.manual_seed(0)
    retried, plugin = _fit(Loud(), 2.0**16, retries=20)
    backoffs = plugin.skipped_steps
    assert backoffs > 0  # it did overflow
    assert retried.calls == STEPS + backoffs  # each overflow ran its batch again
    assert [r.skipped for r in plugin.history] == [True] * backoffs + [False] * STEPS  # every batch was stepped
    # a run that starts at the scale the retries reached steps the same gradients: the same masters (one process,
    # the same arithmetic in the same order)
    torch.manual_seed(0)
    reference, ref_plugin = _fit(Loud(), 2.0**16 / 2**backoffs, retries=0)
    assert ref_plugin.skipped_steps == 0
    for (name, a), b in zip(retried.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    assert plugin.loss_scale == ref_plugin.loss_scale


def test_the_skip_options_in_one_object_act_as_the_single_arguments() -> None:
    """``skips=SkipPolicy(retries=N)`` retries as ``overflow_retries=N`` does: the same batches run again, the same
    masters bitwise (one process, the same operations in the same order)."""
    runs = []
    for kwargs in ({"overflow_retries": 20}, {"skips": SkipPolicy(retries=20)}):
        torch.manual_seed(0)
        model = Loud()
        plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**16, growth_interval=1000), **kwargs)
        quiet_trainer(max_steps=STEPS, plugins=[plugin]).fit(model, regression_data(n=64, batch_size=16))
        runs.append((model, plugin))
    (single, single_plugin), (grouped, plugin) = runs
    assert plugin.skips == single_plugin.skips == SkipPolicy(max_consecutive=50, retries=20, advance_schedulers=True)
    assert grouped.calls == single.calls > STEPS  # the overflowing batches ran again
    for (name, a), b in zip(grouped.state_dict().items(), single.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_skip_options_are_given_once_and_retries_are_the_trainers() -> None:
    for plugin in (MPTPrecision, FabricMPTPrecision):
        grouped = plugin("fp16", skips=SkipPolicy(max_consecutive=3, advance_schedulers=False))
        single = plugin("fp16", max_consecutive_skips=3, skipped_steps_advance_schedulers=False)
        assert grouped.skips == single.skips == SkipPolicy(3, 0, False)
        assert grouped.max_consecutive_skips == 3
        assert grouped.skipped_steps_advance_schedulers is False
        assert plugin("fp16", skips=SkipPolicy(), max_consecutive_skips=50).skips == SkipPolicy()  # a default is fine
        with pytest.raises(ValueError, match=r"max_consecutive_skips=...\): give these options once, in SkipPolicy"):
            plugin("fp16", skips=SkipPolicy(), max_consecutive_skips=3)
        with pytest.raises(TypeError, match="expected a lightning_mpt.SkipPolicy"):
            plugin("fp16", skips={"retries": 2})
        with pytest.raises(ValueError, match="expected an int >= 1"):
            plugin("fp16", skips=SkipPolicy(max_consecutive=0))
    with pytest.raises(ValueError, match="a retry runs the Trainer's training_step again"):
        FabricMPTPrecision("fp16", skips=SkipPolicy(retries=2))
    with pytest.raises(ValueError, match="dynamic loss scale"):
        MPTPrecision("bf16", skips=SkipPolicy(retries=1))


def test_without_retries_the_overflowing_batches_are_lost() -> None:
    torch.manual_seed(0)
    model, plugin = _fit(Loud(), 2.0**16, retries=0)
    assert model.calls == STEPS
    assert plugin.skipped_steps > 0
    assert sum(not r.skipped for r in plugin.history) == STEPS - plugin.skipped_steps


class CountBackward(L.Callback):
    def __init__(self) -> None:
        self.backwards = 0

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.backwards += 1


def test_a_retry_runs_the_batch_again_with_its_side_effects() -> None:
    class LoudCNN(SmallCNN):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch, batch_idx) * 2.0**9

    torch.manual_seed(0)
    counter = CountBackward()
    model, plugin = _fit(LoudCNN(), 2.0**16, 20, classification_images(n=32, batch_size=8), callbacks=[counter])
    assert plugin.skipped_steps > 0
    # BatchNorm's running statistics and the callbacks saw every run of a batch, retries included
    assert counter.backwards == STEPS + plugin.skipped_steps
    assert int(model.features[1].num_batches_tracked) == STEPS + plugin.skipped_steps


def test_retries_are_bounded_and_a_non_finite_loss_is_not_retried() -> None:
    torch.manual_seed(0)
    inject = InjectInf("net.0.weight", batches={1})  # an inf at any scale: every retry overflows again
    model, plugin = _fit(Loud(), 2.0**4, retries=3, callbacks=[inject])
    assert len(inject.injected) == 1 + 3
    assert plugin.skipped_steps == 4
    torch.manual_seed(0)
    model, plugin = _fit(Loud(nan_at=2), 2.0**4, retries=3)
    assert plugin.skipped_steps == 1  # a lower scale cannot make a NaN loss finite
    assert model.calls == STEPS


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"overflow_retries": -1}, "int >= 0"),
        ({"overflow_retries": True}, "int >= 0"),
        ({"overflow_retries": 2, "scaler": 1024.0}, "dynamic loss scale"),
    ],
)
def test_bad_retries_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MPTPrecision("fp16", **kwargs)
    with pytest.raises(ValueError, match="dynamic loss scale"):
        MPTPrecision("bf16", overflow_retries=1)


def test_retries_with_gradient_accumulation_are_refused() -> None:
    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches=2"):
        _fit(Loud(), 2.0**4, retries=1, accumulate_grad_batches=2)


class Logged(Loud):
    """``Loud`` that logs per-epoch values from ``training_step``: a tensor mean, the loss, and torchmetrics objects
    (one logged, one only updated), so that a try's logging can be told from the last try's."""

    def __init__(self) -> None:
        super().__init__()
        self.tries_seen = torchmetrics.SumMetric()  # updated, never logged: its own state counts the tries
        self.batches_seen = torchmetrics.SumMetric()  # updated and logged as an object

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("batch_idx", float(batch_idx), on_epoch=True)  # and on_step, Lightning's default here
        self.log("loss", loss, on_epoch=True, on_step=False)
        self.log("max_idx", float(batch_idx), on_epoch=True, on_step=False, reduce_fx="max")
        self.log("sum_idx", float(batch_idx), on_epoch=True, on_step=False, reduce_fx="sum")
        self.tries_seen.update(1.0)
        self.batches_seen.update(1.0)
        self.log("batches", self.batches_seen, on_epoch=True, on_step=False)
        return loss


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def test_epoch_logging_counts_each_batch_once_its_last_try() -> None:
    torch.manual_seed(0)
    losses = StepLosses()
    model, plugin = _fit(Logged(), 2.0**16, retries=20, callbacks=[losses])
    assert plugin.skipped_steps > 0
    assert model.calls > STEPS
    logged = model.trainer.callback_metrics
    assert float(logged["batch_idx_epoch"]) == pytest.approx(1.5)  # (0 + 1 + 2 + 3) / 4, each batch once
    assert float(logged["batch_idx_step"]) == 3.0
    assert float(logged["max_idx"]) == 3.0
    assert float(logged["sum_idx"]) == 6.0
    assert float(logged["loss"]) == pytest.approx(sum(losses.losses) / STEPS, rel=1e-5)  # the losses stepped
    assert float(logged["batches"]) == STEPS  # a logged torchmetrics object counted each batch once
    # the module's metrics are rolled back too, logged or not (Lightning resets the logged one at the epoch's end)
    assert float(model.tries_seen.compute()) == STEPS
