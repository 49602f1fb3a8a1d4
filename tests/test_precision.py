"""MPTPrecision through real Lightning Trainers: dtypes and masters, one weight update, skipped steps, clipping,
accumulation, manual optimization, the guard, fused/foreach optimizers, bad input."""

import math
import warnings
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed.fsdp
from models import (
    InjectInf,
    SmallCNN,
    TinyMLP,
    TinyTransformer,
    classification_images,
    quiet_trainer,
    regression_data,
    token_data,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import DynamicLossScaler, MPTPrecision, NonFiniteGradientError
from lightning_mpt._compat import GRAD_DTYPE


class Probe(L.Callback):
    """Records what a user's callback can see at each hook (clones, so later steps cannot change them)."""

    def __init__(self) -> None:
        self.before: list[dict[str, Any]] = []
        self.after: list[dict[str, Any]] = []

    @staticmethod
    def snapshot(trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
        opt = trainer.optimizers[0]
        plugin = trainer.precision_plugin
        return {
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "masters": [m.detach().clone() for m in plugin.main_params(opt)],
            "state": {
                k: {s: v.clone() if torch.is_tensor(v) else v for s, v in st.items()}
                for k, st in enumerate(opt.state.values())
            },
            "scale": plugin.loss_scale,
        }

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before.append(self.snapshot(trainer, module))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after.append(self.snapshot(trainer, module))


# ---------------------------------------------------------------------------------------------------- dtypes, masters


class DtypeModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.ln = nn.LayerNorm(2)
        self.seen: dict[str, Any] = {}

    def forward(self, x):
        return self.ln(self.fc(self.bn(self.conv(x)).mean((2, 3))))

    def training_step(self, batch, batch_idx):
        self.seen["param_dtypes"] = {n: p.dtype for n, p in self.named_parameters()}
        self.seen["buffer_dtypes"] = {n: b.dtype for n, b in self.named_buffers() if b.is_floating_point()}
        return self(batch[0]).float().pow(2).mean()

    def on_before_optimizer_step(self, optimizer):
        plugin = self.trainer.precision_plugin
        self.seen["grad_dtypes"] = {n: p.grad.dtype for n, p in self.named_parameters()}
        self.seen["master_grads_fp32"] = all(m.grad.dtype == torch.float32 for m in plugin.main_params(optimizer))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        opt = self.trainer.optimizers[0]
        plugin = self.trainer.precision_plugin
        masters = plugin.main_params(opt)
        self.seen["master_dtypes"] = {m.dtype for m in masters}
        self.seen["masters_are_separate"] = {
            n: all(m is not p for m in masters) for n, p in self.named_parameters() if p.dtype == torch.float16
        }
        self.seen["state_dtypes"] = {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"}
        self.seen["masters_at_end"] = [m.detach().clone() for m in masters]

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_half_model_fp32_norms_masters_and_optimizer_state():
    model = DtypeModel()
    data = DataLoader(TensorDataset(torch.randn(8, 3, 6, 6)), batch_size=4)
    plugin = MPTPrecision("fp16", scaler=1024.0)
    quiet_trainer(max_steps=3, plugins=[plugin]).fit(model, data)
    half = torch.float16
    assert model.seen["param_dtypes"] == {
        "conv.weight": half,
        "conv.bias": half,
        "bn.weight": torch.float32,
        "bn.bias": torch.float32,
        "fc.weight": half,
        "fc.bias": half,
        "ln.weight": torch.float32,
        "ln.bias": torch.float32,
    }
    assert model.seen["buffer_dtypes"] == {"bn.running_mean": torch.float32, "bn.running_var": torch.float32}
    # at the step the module's half parameters carry their fp32 gradients where torch allows it (>= 2.13)
    step_grad = torch.float32 if GRAD_DTYPE else half
    assert model.seen["grad_dtypes"]["fc.weight"] == step_grad
    assert model.seen["grad_dtypes"]["bn.weight"] == torch.float32
    assert model.seen["master_grads_fp32"]
    assert model.seen["master_dtypes"] == {torch.float32}
    assert all(model.seen["masters_are_separate"].values())
    assert model.seen["state_dtypes"] == {torch.float32}
    # after fit: a plain fp32 module whose weights are the masters, bit for bit
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for p, m in zip(model.parameters(), model.seen["masters_at_end"]):
        assert torch.equal(p.detach(), m)


def test_masters_are_taken_before_the_cast():
    torch.manual_seed(1)
    model = TinyMLP()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    plugin = MPTPrecision("fp16")
    seen = {}

    class Grab(L.Callback):
        def on_train_start(self, trainer, module):
            seen.update({name: master.clone() for name, _, master in trainer.precision_plugin.named_masters()})

    quiet_trainer(max_steps=1, plugins=[plugin], callbacks=[Grab()]).fit(model, regression_data())
    assert seen.keys() == {"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"}
    for name, master in seen.items():
        assert torch.equal(master, original[name])  # the exact fp32 value, never a rounded half one
        assert not torch.equal(master, original[name].half().float())


# ---------------------------------------------------------------------------------------------- one weight update


class OneWeight(L.LightningModule):
    """One weight update worked out (docs/concepts.md): one weight w=0.5 with a constant gradient 0.003."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5]))

    def training_step(self, batch, batch_idx):
        return (self.w.float() * 0.003).sum()  # an fp32 loss, as autocast gives for real losses

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def ones(n: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.ones(n, 1)), batch_size=1)


@pytest.mark.parametrize("master_weights", [True, False])
def test_example_1_master_weights_keep_tiny_updates(master_weights):
    model = OneWeight()
    plugin = MPTPrecision("fp16", master_weights=master_weights)
    quiet_trainer(max_steps=100, plugins=[plugin]).fit(model, ones(100))
    assert plugin.skipped_steps == 0
    w = model.w.item()
    if master_weights:
        # 100 fp32 updates of 1e-4 * 0.003 = 3e-7 each, every one rounded to the fp32 grid near 0.5 (2^-25)
        assert w == pytest.approx(0.5 - 100 * 3e-7, abs=100 * 2.0**-25)
        # exactly the fp32 recurrence: gradient stored in fp16 at scale 2^16, unscaled in fp32, SGD in fp32
        g = torch.tensor(0.003 * 2**16, dtype=torch.float16).float() * torch.tensor(2.0**-16)
        ref = torch.tensor(0.5)
        for _ in range(100):
            ref = ref - 1e-4 * g
        assert w == ref.item()
    else:
        assert w == 0.5  # each update is below half the fp16 spacing at 0.5 (2^-12): all lost


# ---------------------------------------------------------------------------------------------------- skipped steps


def test_injected_overflow_skips_exactly_those_steps():
    torch.manual_seed(0)
    model = TinyMLP(lr=1e-2)

    def configure_optimizers():
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]

    model.configure_optimizers = configure_optimizers
    probe = Probe()
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=1024.0))
    injected = {0, 3, 4}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(max_steps=7, plugins=[plugin], callbacks=[probe, InjectInf("net.3.weight", injected)]).fit(
            model, regression_data(n=112)
        )
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert plugin.skipped_steps == len(injected)
    assert [r.skipped for r in plugin.history] == [i in injected for i in range(7)]
    assert [r.nonfinite_params for r in plugin.history if r.skipped] == [["net.3.weight"]] * 3
    for i, (before, after) in enumerate(zip(probe.before, probe.after)):
        same_params = all(torch.equal(before["params"][n], after["params"][n]) for n in before["params"])
        same_masters = all(torch.equal(a, b) for a, b in zip(before["masters"], after["masters"]))
        same_state = all(
            all(torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k] for k in sa)
            for sa, sb in zip(before["state"].values(), after["state"].values())
        ) and len(before["state"]) == len(after["state"])
        assert same_params == same_masters == same_state == (i in injected), i
    # Adam's step count only counts the steps taken
    assert after["state"][0]["step"].item() == 7 - len(injected)
    # the scale backed off once per skipped step
    assert [r.scale for r in plugin.history] == [1024.0, 512.0, 512.0, 512.0, 256.0, 128.0, 128.0]
    assert plugin.loss_scale == 128.0
    assert plugin.last_step_skipped is False


def test_bf16_skips_non_finite_steps_without_scaling():
    model = TinyMLP()
    plugin = MPTPrecision("bf16")
    assert plugin.scaler is None
    assert plugin.loss_scale == 1.0
    quiet_trainer(max_steps=4, plugins=[plugin], callbacks=[InjectInf("net.0.bias", {2})]).fit(model, regression_data())
    assert plugin.skipped_steps == 1
    assert [r.skipped for r in plugin.history] == [False, False, True, False]
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- clipping


def train_weights(precision_kwargs: dict, steps: int = 5, **trainer_kwargs: Any) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = TinyMLP(lr=0.1, optimizer="sgd")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    quiet_trainer(max_steps=steps, **precision_kwargs, **trainer_kwargs).fit(model, regression_data(n=16 * steps))
    return start, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_norm_clipping_acts_on_unscaled_gradients(precision):
    start, ref = train_weights({"precision": "32-true"}, gradient_clip_val=0.05)
    _, got = train_weights({"plugins": [MPTPrecision(precision)]}, gradient_clip_val=0.05)
    _, unclipped = train_weights({"precision": "32-true"})
    for n in start:
        d_ref, d_got = (ref[n] - start[n]).flatten(), (got[n] - start[n]).flatten()
        # with the scaled gradients clipped (clipping before unscaling) the update would be 65536x smaller
        assert torch.nn.functional.cosine_similarity(d_ref, d_got, dim=0) > 0.99, n
        assert d_got.norm() == pytest.approx(d_ref.norm().item(), rel=0.05), n
    # and clipping did act: the unclipped run moves further
    total = lambda w: sum((w[n] - start[n]).norm() ** 2 for n in start) ** 0.5
    assert total(unclipped) > 2 * total(ref)


def test_value_clipping_acts_on_unscaled_gradients():
    start, ref = train_weights(
        {"precision": "32-true"}, steps=1, gradient_clip_val=1e-3, gradient_clip_algorithm="value"
    )
    _, got = train_weights(
        {"plugins": [MPTPrecision("fp16")]}, steps=1, gradient_clip_val=1e-3, gradient_clip_algorithm="value"
    )
    # SGD, every gradient clipped to +-1e-3: each weight moves by lr * 1e-3 = 1e-4, in fp32 as in fp16 with masters
    for n in start:
        moved = (got[n] - start[n]).abs()
        expected = (ref[n] - start[n]).abs()
        big = expected > 0.99e-4
        assert big.float().mean() > 0.5
        torch.testing.assert_close(moved[big], expected[big], rtol=1e-3, atol=1e-9)


def test_clipping_hooks_see_true_gradients():
    seen = {}

    class Watch(TinyMLP):
        def on_before_optimizer_step(self, optimizer):
            from lightning.pytorch.utilities import grad_norm

            seen["half"] = grad_norm(self, norm_type=2)["grad_2.0_norm_total"]
            seen["half_dtype"] = self.net[0].weight.grad.dtype

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            seen["fp32"] = torch.norm(torch.stack([p.grad.norm() for p in self.parameters()])).item()
            seen["fp32_dtype"] = self.net[0].weight.grad.dtype

    torch.manual_seed(0)
    ref_model = TinyMLP()
    torch.manual_seed(0)
    model = Watch()
    quiet_trainer(max_steps=1, precision="32-true", callbacks=[]).fit(ref_model, regression_data())
    quiet_trainer(max_steps=1, plugins=[MPTPrecision("fp16")]).fit(model, regression_data())
    ref_grad_norm = torch.norm(torch.stack([p.grad.norm() for p in ref_model.parameters()])).item()
    step_grad = torch.float32 if GRAD_DTYPE else torch.float16  # fp32 where torch lets a half parameter hold it
    assert seen["half_dtype"] == step_grad
    assert seen["fp32_dtype"] == step_grad
    assert seen["half"] == pytest.approx(ref_grad_norm, rel=0.02)
    assert seen["fp32"] == pytest.approx(ref_grad_norm, rel=0.02)


def test_gradient_edits_in_on_before_optimizer_step_take_effect():
    class ZeroFirst(TinyMLP):
        def on_before_optimizer_step(self, optimizer):
            self.net[0].weight.grad.zero_()

    torch.manual_seed(0)
    model = ZeroFirst(optimizer="sgd")
    before = model.net[0].weight.detach().clone()
    quiet_trainer(max_steps=3, plugins=[MPTPrecision("fp16")]).fit(model, regression_data())
    assert torch.equal(model.net[0].weight, before)
    assert not torch.equal(model.net[3].weight.half(), model.net[3].weight)  # the rest trained


# ------------------------------------------------------------------------------------------------- accumulation, manual


def test_accumulation_overflow_in_one_micro_batch_skips_the_step_once():
    torch.manual_seed(0)
    model = TinyMLP()
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2048.0, growth_interval=100))
    probe = Probe()
    trainer = quiet_trainer(
        max_steps=4, accumulate_grad_batches=4, plugins=[plugin], callbacks=[probe, InjectInf("net.0.weight", {6})]
    )
    trainer.fit(model, regression_data(n=256))
    assert trainer.global_step == 4
    assert [r.skipped for r in plugin.history] == [False, True, False, False]  # batch 6 is in the second window
    assert [r.scale for r in plugin.history] == [2048.0, 2048.0, 1024.0, 1024.0]
    # the weights did not move during the skipped window (batches 4..7), and did in the others
    assert all(
        torch.equal(probe.before[4]["params"][n], probe.after[7]["params"][n]) for n in probe.before[4]["params"]
    )
    assert not torch.equal(probe.before[8]["params"]["net.0.weight"], probe.after[11]["params"]["net.0.weight"])


class GAN(L.LightningModule):
    def __init__(self, clip: float = 0.01):
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.disc = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 1))
        self.clip = clip
        self.norms: list[tuple[float, float]] = []

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        plugin = self.trainer.precision_plugin
        # generator
        self.toggle_optimizer(opt_g)
        fake = self.gen(torch.randn_like(real))
        loss_g = nn.functional.softplus(-self.disc(fake)).mean()
        self.manual_backward(loss_g)
        self.clip_gradients(opt_g, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        clipped = torch.norm(torch.stack([m.grad.norm() for m in plugin.main_params(opt_g)])).item()
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        # discriminator
        self.toggle_optimizer(opt_d)
        loss_d = (nn.functional.softplus(-self.disc(real)) + nn.functional.softplus(self.disc(fake.detach()))).mean()
        self.manual_backward(loss_d)
        disc_norm = lambda: torch.norm(torch.stack([p.grad.float().norm() for p in self.disc.parameters()])).item()
        scaled = disc_norm()  # as with Lightning's AMP, manual_backward leaves scaled gradients
        opt_d.step()
        stepped = disc_norm()  # the step unscaled them
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.norms.append((clipped, scaled, stepped))

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), lr=1e-3), torch.optim.Adam(self.disc.parameters(), lr=1e-3)


def test_manual_optimization_two_optimizers_and_clip_gradients():
    torch.manual_seed(0)
    model = GAN()
    gen0 = [p.detach().clone() for p in model.gen.parameters()]
    disc0 = [p.detach().clone() for p in model.disc.parameters()]
    plugin = MPTPrecision("fp16", scaler=256.0)
    quiet_trainer(max_epochs=1, plugins=[plugin]).fit(
        model, DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    )
    assert plugin.skipped_steps == 0
    assert len(plugin.history) == 8
    for clipped, scaled, stepped in model.norms:
        assert clipped <= model.clip * 1.0001  # clip_gradients saw unscaled grads (scaled ones are 256x larger)
        assert stepped == pytest.approx(scaled / 256, rel=1e-2)
    assert all(not torch.equal(a, b) for a, b in zip(gen0, model.gen.parameters()))
    assert all(not torch.equal(a, b) for a, b in zip(disc0, model.disc.parameters()))


# ---------------------------------------------------------------------------------------------------- guard


class NaNLoss(TinyMLP):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * math.nan


def test_guard_stops_a_run_whose_loss_is_nan():
    plugin = MPTPrecision("bf16", max_consecutive_skips=5)
    trainer = quiet_trainer(max_steps=50, plugins=[plugin])
    with pytest.raises(NonFiniteGradientError) as err:
        trainer.fit(NaNLoss(), regression_data(n=800))
    assert trainer.global_step <= 5
    assert plugin.skipped_steps == 5
    message = str(err.value)
    assert "5 optimizer steps in a row were skipped" in message
    assert "NON-FINITE" in message  # the loss itself
    assert "net.0.weight" in message  # a parameter is named
    assert "hint" in message
    assert "bf16" in message


def test_guard_fp16_reaches_min_scale_then_stops():
    plugin = MPTPrecision("fp16")  # init 2^16, min 1: the scale halves 16 times, then overflows at the floor
    trainer = quiet_trainer(max_steps=100, plugins=[plugin])
    with pytest.raises(NonFiniteGradientError, match=r"overflow happened at the minimum loss scale \(1\)") as err:
        trainer.fit(NaNLoss(), regression_data(n=1600))
    assert plugin.skipped_steps == 17
    assert [r.scale for r in plugin.history] == [2.0**k for k in range(16, -1, -1)]
    # the message shows the last 12 scales, each marked skipped
    assert "recent loss scales (* = skipped): 2048*, 1024*, " in str(err.value)
    assert str(err.value).count("*") == 13


def test_guard_overflow_at_min_scale():
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0, min_scale=1.0))
    with pytest.raises(NonFiniteGradientError) as err:
        quiet_trainer(max_steps=10, plugins=[plugin], callbacks=[InjectInf("net.3.bias", {0, 1})]).fit(
            TinyMLP(), regression_data()
        )
    assert "minimum loss scale (1)" in str(err.value)
    assert "net.3.bias" in str(err.value)
    assert "the loss itself was finite" in str(err.value)
    assert "recent loss scales (* = skipped): 2*, 1*" in str(err.value)


def test_a_static_scale_skips_but_only_the_consecutive_guard_stops_it():
    # skips that are not in a row (0, 1, 3, 4) never trip a guard of 3, and a static scale has no minimum to reach
    plugin = MPTPrecision("fp16", scaler=4.0, max_consecutive_skips=3)
    trainer = quiet_trainer(max_steps=6, plugins=[plugin], callbacks=[InjectInf("net.0.weight", {0, 1, 3, 4})])
    trainer.fit(TinyMLP(), regression_data(n=96))
    assert plugin.skipped_steps == 4
    assert plugin.loss_scale == 4.0
    assert trainer.global_step == 6
    # three in a row (2, 3, 4) do, at the third
    plugin = MPTPrecision("fp16", scaler=4.0, max_consecutive_skips=3)
    trainer = quiet_trainer(max_steps=8, plugins=[plugin], callbacks=[InjectInf("net.0.weight", {2, 3, 4})])
    with pytest.raises(NonFiniteGradientError, match="3 optimizer steps in a row were skipped"):
        trainer.fit(TinyMLP(), regression_data(n=128))
    assert plugin.skipped_steps == 3
    assert [r.skipped for r in plugin.history] == [False, False, True, True, True]


def test_a_failed_run_leaves_an_fp32_model_and_its_last_checkpoint(tmp_path):
    model = NaNLoss()
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
    plugin = MPTPrecision("bf16", max_consecutive_skips=3)
    trainer = quiet_trainer(max_steps=20, plugins=[plugin], callbacks=[ckpt], enable_checkpointing=True)
    with pytest.raises(NonFiniteGradientError):
        trainer.fit(model, regression_data(n=320))
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert all(v.dtype == torch.float32 for v in saved["state_dict"].values())


# ---------------------------------------------------------------------------------------------------- model families


FAMILIES = {
    "mlp": (lambda: TinyMLP(lr=1e-2), lambda: regression_data(n=128), 40),
    "cnn_bn": (lambda: SmallCNN(lr=0.05), lambda: classification_images(n=64), 24),
    "transformer": (lambda: TinyTransformer(lr=1e-2), lambda: token_data(n=64), 60),
}


def train_losses(family: str, **trainer_kwargs: Any) -> list[float]:
    make_model, make_data, steps = FAMILIES[family]
    torch.manual_seed(0)
    model = make_model()
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    epochs = math.ceil(steps / len(make_data()))
    quiet_trainer(max_steps=steps, max_epochs=epochs, callbacks=[Record()], **trainer_kwargs).fit(model, make_data())
    return losses


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_models_train_and_track_fp32(family, precision):
    ref = train_losses(family, precision="32-true")
    plugin = MPTPrecision(precision)
    got = train_losses(family, plugins=[plugin])
    clean = [loss for loss, rec in zip(got, plugin.history) if not rec.skipped]
    assert math.isfinite(got[-1])
    assert plugin.skipped_steps <= 6
    window = 4
    first, last = sum(clean[:window]) / window, sum(got[-window:]) / window
    ref_first, ref_last = sum(ref[:window]) / window, sum(ref[-window:]) / window
    assert last < 0.8 * first  # it learns
    # and tracks fp32: the final loss within 15% of the fp32 run's (plus the steps fp16 skipped at the start)
    assert abs(last - ref_last) <= 0.15 * ref_first


def test_modules_autocast_does_not_cover_get_matching_inputs():
    class BilinearModel(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.bil = nn.Bilinear(4, 4, 2)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.bil(x, x).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = BilinearModel()
    plugin = MPTPrecision("bf16")
    quiet_trainer(max_steps=2, plugins=[plugin]).fit(model, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    assert plugin.skipped_steps == 0
    assert model.bil.weight.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    ],
    ids=["adamw_fused", "adam_foreach", "sgd_foreach", "adagrad"],
)
def test_optimizers_step_the_masters_exactly(make_opt):
    """Replay the fp32 master gradients through the same optimizer on plain fp32 copies of the masters."""
    grads: list[list[torch.Tensor]] = []

    class Record(TinyMLP):
        def configure_optimizers(self):
            return make_opt(self.parameters())

        def configure_gradient_clipping(self, optimizer, *args, **kwargs):  # runs with the masters swapped in
            grads.append([p.grad.detach().clone() for p in self.trainer.precision_plugin.main_params(optimizer)])

    torch.manual_seed(0)
    model = Record()
    start = [p.detach().clone() for p in model.parameters()]
    plugin = MPTPrecision("fp16", scaler=64.0)
    quiet_trainer(max_steps=5, plugins=[plugin]).fit(model, regression_data(n=80))
    assert plugin.skipped_steps == 0
    assert len(grads) == 5

    replica = [nn.Parameter(t.clone()) for t in start]
    opt = make_opt(replica)
    for step_grads in grads:
        for p, g in zip(replica, step_grads):
            p.grad = g
        opt.step()
    for p, r in zip(model.parameters(), replica):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0)


def test_lbfgs_runs_with_bf16_and_is_refused_with_a_scaler():
    class WithLBFGS(TinyMLP):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)

    torch.manual_seed(0)
    model = WithLBFGS()
    before = model.net[0].weight.detach().clone()
    quiet_trainer(max_steps=2, plugins=[MPTPrecision("bf16")]).fit(model, regression_data())
    assert not torch.equal(before, model.net[0].weight)
    with pytest.raises(Exception, match="does not support torch.optim.LBFGS"):
        quiet_trainer(max_steps=2, plugins=[MPTPrecision("fp16")]).fit(WithLBFGS(), regression_data())


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"precision": "fp8"}, ValueError, "precision must be one of 'fp16', 'bf16'"),
        ({"precision": "16-mixed"}, ValueError, "precision must be one of 'fp16', 'bf16'"),
        ({"scaler": -1.0}, ValueError, "a static scale must be a finite number > 0"),
        ({"scaler": 0}, ValueError, "a static scale must be a finite number > 0"),
        ({"scaler": "dynamic"}, TypeError, "expected None, a DynamicLossScaler or a number"),
        ({"keep_fp32": (nn.LayerNorm, "BatchNorm")}, TypeError, "expected a torch.nn.Module subclass or a tuple"),
        ({"max_consecutive_skips": 0}, ValueError, "expected an int >= 1"),
    ],
)
def test_bad_plugin_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        MPTPrecision(**kwargs)


def test_unsupported_strategies_are_refused():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from lightning_mpt.precision import check_strategy

    with pytest.raises(ValueError, match=r"does not support the FSDPStrategy strategy. Supported: a single device"):
        check_strategy(FSDPStrategy())

    class Parallel(TinyMLP):
        def configure_model(self):  # ModelParallelStrategy insists on it
            pass

    trainer = quiet_trainer(max_steps=1, strategy=ModelParallelStrategy(), plugins=[MPTPrecision("bf16")])
    if not hasattr(torch.distributed.fsdp, "fully_shard"):  # FSDP2 is public from torch 2.6
        with pytest.raises(ImportError, match=r"needs torch >= 2.6 \(FSDP2\)"):
            trainer.fit(Parallel(), regression_data())
        return
    # supported with FSDP2 (tests/test_fsdp.py); a configure_model that shards nothing is refused
    try:
        with pytest.raises(ValueError, match=r"configure_model did not shard anything(.|\n)*supports one device, the"):
            trainer.fit(Parallel(), regression_data())
    finally:  # the strategy's one-process group would stay for the next test in this process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_module_without_an_optimizer_fits(precision):
    """``configure_optimizers`` returning ``None``: Lightning steps a mock optimizer of its own (defined next to its
    optimizer wrapper), which the plugin must not take for the wrapper."""

    class NoOptimizer(TinyMLP):
        def configure_optimizers(self):
            return None

    trainer = quiet_trainer(max_steps=2, plugins=[MPTPrecision(precision)])
    with pytest.warns(UserWarning, match="`LightningModule.configure_optimizers` returned `None`"):
        trainer.fit(NoOptimizer(), regression_data())
    assert trainer.global_step == 2


class ReadsItsStateInValidation(TinyMLP):
    """Takes its state_dict and reads a master inside the validation loop (under ``torch.inference_mode``), as
    Lightning's own restore test does: the plugin's first edit check then runs there."""

    def on_validation_start(self) -> None:
        self.state_dict()
        self.trainer.precision_plugin.master_of(self.net[0].weight)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_validation_before_training_leaves_trainable_weights(precision):
    """What the plugin lays out or wakes during a validation loop outlives it: no inference tensor may be among it, or
    the teardown's check and the next fit's steps fail ("Inplace update to inference tensor outside InferenceMode")."""
    torch.manual_seed(0)
    model = ReadsItsStateInValidation()
    plugin = MPTPrecision(precision)
    quiet_trainer(plugins=[plugin]).validate(model, regression_data())
    assert not any(p.is_inference() for p in model.parameters())
    before = [p.detach().float().clone() for p in model.parameters()]
    quiet_trainer(max_steps=2, plugins=[MPTPrecision(precision)]).fit(model, regression_data(), regression_data())
    assert all(not torch.equal(b, p.detach().float()) for b, p in zip(before, model.parameters()))
