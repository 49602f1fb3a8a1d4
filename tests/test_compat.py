"""Lightning features that a master-weights plugin can break, each reproduced through a real Trainer (the failure
clusters of a first, straightforward implementation; see docs/compatibility.md)."""

import pickle

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from models import InjectInf, TinyMLP, quiet_trainer, regression_data
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision

# ---------------------------------------------------------------------------------------------------- after fit


def test_after_fit_the_module_is_a_plain_fp32_model_that_pickles():
    model = TinyMLP()
    trainer = quiet_trainer(max_steps=3, plugins=[MPTPrecision("fp16")])
    trainer.fit(model, regression_data())
    x = torch.randn(5, 16)
    assert model(x).dtype == torch.float32  # no autocast needed, no dtype mismatch
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    clone = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(clone(x), model(x))
    pickle.dumps(trainer)  # the trainer, plugin included, pickles too


# -------------------------------------------------------------------------------------------------- hooks and clipping


class CountHooks(TinyMLP):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int, float]] = []

    def on_before_optimizer_step(self, optimizer):
        # the module's gradients are unscaled here; a scaled fp16 gradient would be ~1000x larger
        self.calls.append(("before", self.trainer.global_step, self.net[0].weight.grad.float().abs().max().item()))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.calls.append(("clip", self.trainer.global_step, self.net[0].weight.grad.float().abs().max().item()))
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def test_hooks_and_clipping_run_on_every_step_skipped_ones_included():
    torch.manual_seed(0)
    model = CountHooks()
    plugin = MPTPrecision("fp16", scaler=1024.0)
    trainer = quiet_trainer(
        max_steps=4, gradient_clip_val=1.0, plugins=[plugin], callbacks=[InjectInf("net.3.weight", {1})]
    )
    trainer.fit(model, regression_data())
    assert [(name, step) for name, step, _ in model.calls] == [
        ("before", 0),
        ("clip", 0),
        ("before", 1),
        ("clip", 1),
        ("before", 2),
        ("clip", 2),
        ("before", 3),
        ("clip", 3),
    ]
    assert plugin.skipped_steps == 1
    assert max(v for _, _, v in model.calls) < 10  # true gradients of an MSE loss of order 1, never scaled by 1024


# ---------------------------------------------------------------------------------------------------- closures


class BrokenSGD(torch.optim.SGD):
    def step(self, closure=None):
        return super().step()  # forgets the closure


class Forgetful(TinyMLP):
    def configure_optimizers(self):
        return BrokenSGD(self.parameters(), lr=0.1)


def test_closure_never_called_is_still_detected_without_a_scaler():
    with pytest.raises(MisconfigurationException, match="The closure hasn't been executed"):
        quiet_trainer(max_steps=1, plugins=[MPTPrecision("bf16")]).fit(Forgetful(), regression_data())


class ManualReturns(TinyMLP):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.returned: list = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch

        def closure():
            loss = nn.functional.mse_loss(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        self.returned.append(opt.step(closure=closure))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_optimizer_step_returns_the_optimizers_return_value(precision):
    model = ManualReturns()
    plugin = MPTPrecision(precision, scaler=256.0 if precision == "fp16" else None)
    quiet_trainer(max_steps=3, plugins=[plugin], callbacks=[InjectInf("net.0.weight", {1})]).fit(
        model, regression_data()
    )
    assert plugin.skipped_steps == 1
    assert isinstance(model.returned[0], torch.Tensor)
    assert model.returned[0].ndim == 0
    assert model.returned[1] is None  # a skipped step returns nothing, as GradScaler.step
    assert isinstance(model.returned[2], torch.Tensor)


class NoneOnOdd(TinyMLP):
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


def test_training_step_returning_none_skips_backward_and_step():
    torch.manual_seed(0)
    model = NoneOnOdd()
    plugin = MPTPrecision("fp16", scaler=256.0)
    trainer = quiet_trainer(max_steps=4, plugins=[plugin])
    trainer.fit(model, regression_data(n=64))
    assert len(plugin.history) == 2  # only batches 0 and 2 had a loss to step on


# -------------------------------------------------------------------------------------------------- parameter identity


class TwoHeads(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.frozen_during_a: list[bool] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt_a, opt_b = self.optimizers()
        self.toggle_optimizer(opt_a)
        self.frozen_during_a.append(not any(p.requires_grad for p in self.b.parameters()))
        loss = self.b(self.a(x)).float().pow(2).mean()
        self.manual_backward(loss)
        assert all(p.grad is None for p in self.b.parameters())  # toggled off: no gradient for b
        opt_a.step()
        opt_a.zero_grad()
        self.untoggle_optimizer(opt_a)

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


def test_toggle_optimizer_freezes_the_module_parameters():
    model = TwoHeads()
    b0 = model.b.weight.detach().clone()
    quiet_trainer(max_steps=3, plugins=[MPTPrecision("fp16", scaler=64.0)]).fit(
        model, DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4)
    )
    assert model.frozen_during_a == [True] * 3
    assert all(p.requires_grad for p in model.parameters())  # untoggled
    assert torch.equal(model.b.weight, b0)


class Finetune(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)).float(), y)

    def configure_optimizers(self):
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)


def test_backbone_finetuning_adds_param_groups_that_train_on_masters():
    torch.manual_seed(0)
    model = Finetune()
    backbone0 = model.backbone[0].weight.detach().clone()
    seen = {}

    class Inspect(L.Callback):
        def on_train_epoch_end(self, trainer, module):
            opt = trainer.optimizers[0]
            seen[trainer.current_epoch] = (
                len(opt.param_groups),
                {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"},
            )

    data = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=8)
    finetune = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1, verbose=False)
    quiet_trainer(max_epochs=3, plugins=[MPTPrecision("bf16")], callbacks=[finetune, Inspect()]).fit(model, data)
    assert seen[0][0] == 1
    assert seen[2][0] == 2
    assert seen[2][1] == {torch.float32}  # its Adam state is fp32 too
    assert not torch.equal(model.backbone[0].weight, backbone0)
    assert model.backbone[0].weight.dtype == torch.float32


def test_adagrad_state_created_at_construction_is_fp32():
    class WithAdagrad(TinyMLP):
        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=0.1, initial_accumulator_value=0.1)

    model = WithAdagrad()
    trainer = quiet_trainer(max_steps=2, plugins=[MPTPrecision("fp16")])
    trainer.fit(model, regression_data())
    assert {st["sum"].dtype for st in trainer.optimizers[0].state.values()} == {torch.float32}


def test_lr_finder_runs_and_restores_the_model(tmp_path):
    torch.manual_seed(0)
    model = TinyMLP(lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = quiet_trainer(max_epochs=1, plugins=[MPTPrecision("bf16")], default_root_dir=tmp_path)
    finder = Tuner(trainer).lr_find(model, regression_data(n=256), num_training=20, min_lr=1e-5, max_lr=1.0)
    assert finder is not None
    assert len(finder.results["lr"]) > 5
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], before[k]) for k in before)


def test_after_the_lr_finder_the_fit_logs_every_step_of_its_own(tmp_path):
    """lr_find restores the plugin's state to where it started (step 0): its own steps are not the fit's last steps,
    so the loss-scale monitor logs every step of the fit, and no step is said skipped before the fit took one."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tb_events import read_events, series

    from lightning_mpt.callbacks import LossScaleMonitor

    torch.manual_seed(0)
    model = TinyMLP(lr=1e-3)
    plugin = MPTPrecision("fp16")
    trainer = quiet_trainer(
        max_steps=6,
        plugins=[plugin],
        callbacks=[LossScaleMonitor()],
        logger=TensorBoardLogger(tmp_path, name="run"),
        log_every_n_steps=1,
    )
    Tuner(trainer).lr_find(model, regression_data(n=256), num_training=10, min_lr=1e-5, max_lr=1e-2)
    assert plugin.last_step is None
    assert not plugin.last_step_skipped
    model.lr = 1e-3
    trainer.fit(model, regression_data(n=96))
    logged = series(read_events(trainer.logger.log_dir), "mpt/loss_scale")
    assert [step for step, _ in logged] == list(range(6))
    assert [r.step for r in plugin.history] == list(range(6))
