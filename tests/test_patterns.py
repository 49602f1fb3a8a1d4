"""Lightning training patterns that real projects use, each checked against an independent reference (a
"32-true" run, a hand computation, torch itself): manual optimization through ``self.optimizers()``, several
steps per batch, tied weights, several optimizers, optimizers that ignore the closure, optimizer state built at
construction, clipping with a non-finite norm, modules autocast does not cover, weights edited in place, bad
arguments. Every test here failed before the fix it guards (issue 10), except activation checkpointing, which held
when first tried and is kept as a guard."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from models import InjectInf, TinyMLP, check_fp32_accumulation, quiet_trainer, regression_data
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import DEFAULT_KEEP_FP32, DynamicLossScaler, MPTPrecision, NonFiniteGradientError
from lightning_mpt._compat import GRAD_DTYPE

PRECISIONS = ["fp16", "bf16"]


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((after[n] - before[n]).double().pow(2).sum()) for n in before))


# ------------------------------------------------------------------------ 1. manual optimization, documented wrapper


class ManualClip(L.LightningModule):
    """The manual-optimization recipe of Lightning's docs: ``self.optimizers()``, ``manual_backward``,
    ``clip_gradients`` on the wrapper, ``opt.step()``."""

    def __init__(self, clip: float, algorithm: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.clip, self.algorithm = clip, algorithm
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm=self.algorithm)
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_manual_clip_gradients_through_the_wrapper_clips_the_step(precision, algorithm):
    def run(clip: float, **kwargs: Any) -> float:
        torch.manual_seed(0)
        model = ManualClip(clip, algorithm)
        start = snapshot(model)
        quiet_trainer(max_steps=3, **kwargs).fit(model, regression_data(n=48))
        return moved(start, snapshot(model))

    ref = run(1e-3, precision="32-true")
    got = run(1e-3, plugins=[MPTPrecision(precision)])
    assert ref < run(0.0, precision="32-true") / 10  # clipping acts in the reference
    if algorithm == "norm":
        assert ref <= 3 * 0.1 * 1e-3 * (1 + 1e-3)  # SGD steps of at most lr * clip each
    assert got == pytest.approx(ref, rel=2e-2)


def test_state_keyed_by_optimizer_accepts_the_wrapper():
    """``main_params``/``unscale_gradients`` with ``LightningOptimizer`` mean the raw optimizer."""
    seen: dict[str, Any] = {}

    class Look(ManualClip):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            plugin = self.trainer.precision_plugin
            seen["same"] = [a is b for a, b in zip(plugin.main_params(opt), plugin.main_params(opt.optimizer))]
            super().training_step(batch, batch_idx)

    quiet_trainer(max_steps=1, plugins=[MPTPrecision("fp16")]).fit(Look(1.0, "norm"), regression_data())
    assert seen["same"]
    assert all(seen["same"])


# ------------------------------------------------------------------------ 2. two steps in one training_step


class TwoSteps(L.LightningModule):
    """Two ``opt.step()`` in one ``training_step``; the second loss does not reach ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward((self.a(x) + self.b(x)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
        self.manual_backward(self.a(x).float().pow(2).mean())
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_second_step_leaves_parameters_without_gradients_alone(precision):
    data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=8)

    def run(**kwargs: Any) -> tuple[dict, dict]:
        torch.manual_seed(0)
        model = TwoSteps()
        start = snapshot(model)
        quiet_trainer(max_steps=8, **kwargs).fit(model, data)
        return start, snapshot(model)

    start, ref = run(precision="32-true")
    _, got = run(plugins=[MPTPrecision(precision)])
    b_ref = moved({k: start[k] for k in ("b.weight", "b.bias")}, ref)
    b_got = moved({k: start[k] for k in ("b.weight", "b.bias")}, got)
    assert b_got == pytest.approx(b_ref, rel=2e-2)  # stepped again with a stale gradient it would move twice as far
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=0, atol=2e-2)


# ------------------------------------------------------------------------ 3. tied weights


class TiedLM(L.LightningModule):
    """A language model whose output head shares the embedding matrix (GPT-2's ``lm_head.weight is wte.weight``)."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.seen: list[dict[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.mix(self.emb(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        plugin = self.trainer.precision_plugin
        self.seen.append({
            "state": {k: v.clone() for k, v in self.state_dict().items()},
            "master": plugin.master_of(self.emb.weight).detach().clone(),
        })

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def lm_data(n: int = 48, seq: int = 6, vocab: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, 1, dims=1)), batch_size=8)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_tied_weights_save_reload_and_resume(tmp_path, precision):
    torch.manual_seed(0)
    model = TiedLM()
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1)
    quiet_trainer(max_epochs=2, plugins=[MPTPrecision(precision)], callbacks=[ckpt], enable_checkpointing=True).fit(
        model, lm_data()
    )
    # during the stage, every state_dict name of the shared weight holds the master
    for seen in model.seen:
        for key in ("emb.weight", "head.weight"):
            assert seen["state"][key].dtype == torch.float32
            assert torch.equal(seen["state"][key], seen["master"]), key
    # the checkpoint written during fit loads into a plain fp32 model with nothing lost
    saved = torch.load(tmp_path / "epoch=0-step=6.ckpt", weights_only=False)["state_dict"]
    assert torch.equal(saved["emb.weight"], saved["head.weight"])
    assert saved["emb.weight"].dtype == torch.float32
    assert torch.equal(saved["emb.weight"], model.seen[5]["master"])
    plain = TiedLM()
    plain.load_state_dict(saved)
    assert plain.head.weight is plain.emb.weight
    assert torch.equal(plain.emb.weight, model.seen[5]["master"])
    # resume from the first epoch's checkpoint: bitwise equal to the uninterrupted run
    torch.manual_seed(0)
    resumed = TiedLM()
    quiet_trainer(max_epochs=2, plugins=[MPTPrecision(precision)]).fit(
        resumed, lm_data(), ckpt_path=tmp_path / "epoch=0-step=6.ckpt"
    )
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert a.dtype == torch.float32, n
        assert torch.equal(a, b), n


# ------------------------------------------------------------------------ 4. guard, several optimizers


class TwoOptimizers(L.LightningModule):
    """Optimizer ``a`` sees NaN gradients at every step, optimizer ``b`` never does."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.steps_a = 0

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        self.manual_backward(self.a(x).float().sum() * math.nan)
        self.steps_a += 1
        opt_a.step()
        opt_b.zero_grad()
        self.manual_backward(self.b(x).float().pow(2).mean())
        opt_b.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_guard_counts_consecutive_skips_per_optimizer(precision):
    model = TwoOptimizers()
    plugin = MPTPrecision(precision, scaler=8.0 if precision == "fp16" else None, max_consecutive_skips=4)
    with pytest.raises(NonFiniteGradientError, match="4 optimizer steps in a row were skipped") as err:
        quiet_trainer(max_steps=100, plugins=[plugin]).fit(model, DataLoader(TensorDataset(torch.randn(400, 4))))
    assert model.steps_a == 4
    assert "a.weight" in str(err.value)
    assert "b.weight" not in str(err.value)


# ------------------------------------------------------------------------ 5. optimizers that ignore the closure


class PlainSGD(torch.optim.Optimizer):
    """A custom optimizer, as found in many projects, whose ``step`` never calls the closure."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class CustomOptimizerMLP(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return PlainSGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize(
    ("precision", "manual"),
    [("fp16", False), ("fp16", True), ("bf16", True)],
    ids=["fp16", "fp16-manual", "bf16-manual"],
)
def test_an_optimizer_that_ignores_the_closure_never_applies_a_non_finite_update(precision, manual):
    def run(**kwargs: Any) -> tuple[L.LightningModule, list[dict]]:
        torch.manual_seed(0)
        model = CustomOptimizerMLP(manual)
        states: list[dict] = []

        class Watch(L.Callback):
            def on_train_batch_end(self, trainer, module, *args):
                states.append(snapshot(module))

        quiet_trainer(max_steps=5, callbacks=[Watch(), *kwargs.pop("callbacks", [])], **kwargs).fit(
            model, regression_data(n=80)
        )
        return model, states

    plugin = MPTPrecision(precision)
    model, states = run(plugins=[plugin], callbacks=[InjectInf("net.2.weight", {2})])
    assert [r.skipped for r in plugin.history] == [False, False, True, False, False]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.equal(states[1][n], states[2][n]) for n in states[1])  # the skipped step changed nothing
    # and the steps taken are the custom optimizer's: within half rounding of "32-true" (which steps 4 of 5 too)
    assert moved(states[0], states[-1]) > 0


def test_bf16_automatic_optimization_with_an_optimizer_that_ignores_the_closure_fails_as_in_lightning():
    """The optimizer never runs the closure, so nothing computes gradients: Lightning says so, under "32-true" as
    under MPTPrecision, and no weight becomes non-finite."""
    for kwargs in ({"precision": "32-true"}, {"plugins": [MPTPrecision("bf16")]}):
        model = CustomOptimizerMLP()
        with pytest.raises(Exception, match="closure hasn't been executed"):
            quiet_trainer(max_steps=2, **kwargs).fit(model, regression_data())
        assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------ 6. optimizer state built at construction


@pytest.mark.parametrize("precision", PRECISIONS)
def test_state_an_optimizer_builds_at_construction_is_exact_fp32(precision):
    seen: dict[str, Any] = {}

    class WithAdagrad(CustomOptimizerMLP):
        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=0.01, initial_accumulator_value=0.1)

        def on_train_start(self):
            opt = self.trainer.optimizers[0]
            seen["sums"] = [opt.state[p]["sum"].clone() for p in self.parameters()]

    quiet_trainer(max_steps=1, plugins=[MPTPrecision(precision)]).fit(WithAdagrad(), regression_data())
    for s in seen["sums"]:
        assert s.dtype == torch.float32
        assert torch.equal(s, torch.full_like(s, 0.1))


# ------------------------------------------------------------------------ 7. culprits come from unclipped gradients


def test_guard_culprits_come_from_the_gradients_before_clipping():
    """A NaN gradient makes the total norm NaN, and norm clipping multiplies every gradient by NaN: the culprit is
    still the one parameter whose gradient was NaN before clipping."""
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=4.0, min_scale=2.0))
    with pytest.raises(NonFiniteGradientError) as err:
        quiet_trainer(
            max_steps=4,
            plugins=[plugin],
            gradient_clip_val=1.0,
            callbacks=[InjectInf("net.3.bias", {0, 1}, value=math.nan)],
        ).fit(TinyMLP(), regression_data())
    assert "parameters with non-finite gradients: net.3.bias\n" in str(err.value)
    assert [r.nonfinite_params for r in plugin.history] == [["net.3.bias"], ["net.3.bias"]]


# ------------------------------------------------------------------------ 8. modules autocast does not cover


class BagModel(L.LightningModule):
    """``nn.EmbeddingBag`` with per-sample weights, and an LSTM called with keyword inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, mode="sum")
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.out = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, w = batch
        pooled = self.bag(idx, per_sample_weights=w)
        h0 = torch.zeros(1, idx.shape[0], 8)
        seq, _ = self.rnn(input=pooled.unsqueeze(1).repeat(1, 3, 1), hx=h0)
        return self.out(seq).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_embedding_bag_per_sample_weights_and_keyword_inputs(precision):
    g = torch.Generator().manual_seed(0)
    data = DataLoader(
        TensorDataset(torch.randint(0, 20, (16, 5), generator=g), torch.rand(16, 5, generator=g)), batch_size=4
    )
    model = BagModel()
    before = snapshot(model)
    plugin = MPTPrecision(precision, scaler=1024.0 if precision == "fp16" else None)
    quiet_trainer(max_steps=3, plugins=[plugin]).fit(model, data)
    assert plugin.skipped_steps == 0
    after = snapshot(model)
    assert all(not torch.equal(before[n], after[n]) for n in ("bag.weight", "rnn.weight_ih_l0", "out.weight"))


# ------------------------------------------------------------------------ 9. weights edited in place


class WGANCritic(L.LightningModule):
    """A critic whose weights are clamped after every step, as WGAN does (``p.data.clamp_``)."""

    def __init__(self, clamp: float = 0.02) -> None:
        super().__init__()
        self.clamp = clamp
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return -self.net(x).float().mean() + self.net(x.flip(0) * 2).float().mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for p in self.net.parameters():
            p.data.clamp_(-self.clamp, self.clamp)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_weight_clamping_in_a_hook_reaches_the_masters(precision):
    data = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=8)

    def run(**kwargs: Any) -> dict:
        torch.manual_seed(0)
        model = WGANCritic()
        quiet_trainer(max_steps=8, **kwargs).fit(model, data)
        return snapshot(model)

    ref = run(precision="32-true")
    got = run(plugins=[MPTPrecision(precision, scaler=256.0 if precision == "fp16" else None)])  # no skipped step
    eps = 2.0**-10 if precision == "fp16" else 2.0**-7
    for n in ref:
        assert got[n].abs().max() <= 0.02 * (1 + eps)  # the clamp held after fit (0.02 rounded to the half format)
        torch.testing.assert_close(got[n], ref[n], rtol=0, atol=4 * eps * 0.02)


class HalvesAfterTheLastSteps(L.LightningModule):
    """Halves ``a.weight`` in place after the next-to-last step and ``b.weight`` after the last one."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.b(torch.relu(self.a(x))).float(), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        edited = {self.steps - 2: self.a.weight, self.steps - 1: self.b.weight}.get(batch_idx)
        if edited is not None:
            edited.data.mul_(0.5)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_an_edit_after_the_last_steps_is_adopted_and_reported(precision):
    """Edits that no later decision sees are still reported by name: one after the last step (found when fit gives
    the module its fp32 weights back) and, under bf16's chunked default, one after the step before (found as the last
    step wakes its chunk). Adopted: the final weight is the edited half value, exactly."""
    steps = 4
    model = HalvesAfterTheLastSteps(steps)
    plugin = MPTPrecision(precision, scaler=256.0 if precision == "fp16" else None)
    data = regression_data(n=8 * steps, d_in=8, d_out=1, batch_size=8)  # one epoch: batch_idx counts the steps
    quiet_trainer(max_steps=steps, plugins=[plugin]).fit(model, data)
    assert plugin._reported_edits == {"a.weight", "b.weight"}
    half = torch.float16 if precision == "fp16" else torch.bfloat16
    assert model.b.weight.dtype == torch.float32
    assert torch.equal(model.b.weight, model.b.weight.to(half).float())  # the master is the edited half weight


class MaxNormEmbedding(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, max_norm=1.0)
        self.out = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        return self.out(self.emb(idx)).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_embedding_max_norm_renormalisation_reaches_the_masters(precision):
    data = DataLoader(
        TensorDataset(torch.randint(0, 16, (64, 4), generator=torch.Generator().manual_seed(0))), batch_size=8
    )

    def run(**kwargs: Any) -> dict:
        torch.manual_seed(0)
        model = MaxNormEmbedding()
        with torch.no_grad():
            model.emb.weight.mul_(4)  # rows well above max_norm: the forward renormalises them in place
        quiet_trainer(max_steps=8, **kwargs).fit(model, data)
        return snapshot(model)

    ref = run(precision="32-true")
    got = run(plugins=[MPTPrecision(precision)])
    eps = 2.0**-10 if precision == "fp16" else 2.0**-7
    torch.testing.assert_close(got["emb.weight"], ref["emb.weight"], rtol=8 * eps, atol=8 * eps)


def test_stochastic_weight_averaging_is_accurate_to_fp32():
    """Lightning's SWA averages the fp32 masters and its result lands in the module exactly (not rounded)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    data = regression_data(n=64)
    masters_per_epoch: list[list[torch.Tensor]] = []

    class Record(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            plugin = trainer.precision_plugin
            masters_per_epoch.append([plugin.master_of(p).detach().clone() for p in module.parameters()])

    torch.manual_seed(0)
    model = TinyMLP(optimizer="sgd", lr=0.05)
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)
    quiet_trainer(max_epochs=5, plugins=[MPTPrecision("fp16")], callbacks=[Record(), swa]).fit(model, data)
    # SWA averages the weights at the start of epochs swa_start..4 (the fp32 masters there), in fp32
    assert swa.n_averaged == 5 - swa.swa_start > 1
    kept = masters_per_epoch[swa.swa_start :]
    expected = [torch.stack([epoch[i] for epoch in kept]) for i in range(len(kept[0]))]
    for p, stack in zip(model.parameters(), expected):
        ref = stack[0].clone()
        for k in range(1, stack.shape[0]):
            ref = ref + (stack[k] - ref) / (k + 1)
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), ref, rtol=1e-6, atol=1e-7)
        assert not torch.equal(p.detach(), p.detach().half().float())  # not rounded to fp16


# ------------------------------------------------------------------------ 11. argument checks


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"master_weights": "no"}, TypeError, r"master_weights='no'\): expected a bool"),
        ({"master_weights": 0}, TypeError, r"expected a bool"),
        ({"max_consecutive_skips": True}, ValueError, r"max_consecutive_skips=True\): expected an int >= 1"),
        ({"max_consecutive_skips": 2.0}, ValueError, "expected an int >= 1"),
        ({"keep_fp32": "LayerNorm"}, TypeError, "a torch.nn.Module subclass or a tuple of them"),
        ({"precision": None}, ValueError, "precision must be one of 'fp16', 'bf16'"),
    ],
)
def test_argument_checks(kwargs, error, message):
    with pytest.raises(error, match=message):
        MPTPrecision(**kwargs)


def test_keep_fp32_accepts_a_single_class():
    plugin = MPTPrecision("bf16", keep_fp32=nn.Linear)
    model = plugin.convert_module(nn.Sequential(nn.Linear(2, 2), nn.Conv1d(2, 2, 1)))
    assert model[0].weight.dtype == torch.float32
    assert model[1].weight.dtype == torch.bfloat16
    plugin.teardown()
    assert plugin.keep_fp32 == (*DEFAULT_KEEP_FP32, nn.Linear)


@pytest.mark.parametrize(
    ("keep", "kept"),
    [
        (nn.Linear, {"linear", "norm"}),  # the user's type, in addition to the default norm layers
        ((nn.Linear, nn.Conv1d), {"linear", "conv", "norm"}),
        ((*DEFAULT_KEEP_FP32, nn.Linear), {"linear", "norm"}),  # the defaults spelled out: the same
        ((nn.LayerNorm,), {"norm"}),  # a tuple that names a default type is the whole list
        ((nn.BatchNorm1d,), set()),
        ((), set()),  # nothing in fp32
    ],
)
def test_keep_fp32_adds_to_the_norm_layers(keep, kept):
    """A type of one's own (``keep_fp32=nn.Linear``) used to replace the default norm layers, which then trained in the
    half format; it is kept in addition to them. A tuple that names a default type itself is taken as the whole list."""
    plugin = MPTPrecision("bf16", keep_fp32=keep)
    model = plugin.convert_module(
        nn.ModuleDict({"linear": nn.Linear(2, 2), "conv": nn.Conv1d(2, 2, 1), "norm": nn.LayerNorm(2)})
    )
    assert {name for name, m in model.items() if m.weight.dtype == torch.float32} == kept
    plugin.teardown()


# ------------------------------------------------------------------------ a backward between clipping and the step


class ClipThenMoreBackward(ManualClip):
    """Clips, then backpropagates a second loss into the clipped gradients, then steps (as "32-true" allows)."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(x).float(), y))
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm=self.algorithm)
        self.manual_backward(nn.functional.mse_loss(self.net(x).float(), y) * 1e-2)
        opt.step()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_backward_after_clipping_accumulates_into_the_clipped_gradients(precision):
    def run(**kwargs: Any) -> dict:
        torch.manual_seed(0)
        model = ClipThenMoreBackward(1e-3, "norm")
        quiet_trainer(max_steps=3, **kwargs).fit(model, regression_data(n=48))
        return snapshot(model)

    ref = run(precision="32-true")
    got = run(plugins=[MPTPrecision(precision, scaler=2.0**12 if precision == "fp16" else None)])
    torch.manual_seed(0)
    start = snapshot(ClipThenMoreBackward(1e-3, "norm"))
    assert moved(start, got) == pytest.approx(moved(start, ref), rel=2e-2)


# ------------------------------------------------------------------------ fp32 gradient accumulation (issue 12)


class TinyGrads(L.LightningModule):
    """Per-micro-batch gradients small next to their sum: fp16 accumulation rounds each addition away."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(16, 1, bias=False)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.w(x).float().mean() * 2.0**-10

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append(self.trainer.precision_plugin.master_of(self.w.weight).grad.double().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.skipif(not GRAD_DTYPE, reason="needs torch >= 2.13 (Tensor.grad_dtype)")
def test_accumulate_fp32_sums_micro_batches_in_fp32():
    def grad(x: torch.Tensor, **plugin_kwargs: Any) -> torch.Tensor:
        torch.manual_seed(0)
        model = TinyGrads()
        quiet_trainer(
            max_steps=1, accumulate_grad_batches=len(x), plugins=[MPTPrecision("fp16", scaler=2.0**10, **plugin_kwargs)]
        ).fit(model, DataLoader(TensorDataset(x), batch_size=1))
        return model.seen[0]

    check_fp32_accumulation(grad)


def test_accumulate_fp32_is_checked():
    with pytest.raises(TypeError, match=r"accumulate_fp32='yes'\): expected a bool"):
        MPTPrecision("fp16", accumulate_fp32="yes")
    with pytest.raises(ValueError, match="needs master_weights=True"):
        MPTPrecision("fp16", accumulate_fp32=True, master_weights=False)


# ------------------------------------------------------------------------ several stages on one module


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_second_fit_on_the_same_module(precision):
    """Lightning keeps the gradients of the last step on the module after fit: a second fit (resuming, or after the
    LR finder) converts a module that holds fp32 gradients again, and trains as a first fit would."""
    torch.manual_seed(0)
    model = TinyMLP()
    quiet_trainer(max_steps=2, plugins=[MPTPrecision(precision)]).fit(model, regression_data())
    assert model.net[0].weight.grad is not None
    assert model.net[0].weight.grad.dtype == torch.float32
    before = snapshot(model)
    plugin = MPTPrecision(precision)
    quiet_trainer(max_steps=2, plugins=[plugin]).fit(model, regression_data())
    assert moved(before, snapshot(model)) > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.net[0].weight.grad = None
    (model(torch.randn(2, 16)).sum()).backward()  # and the module is a plain fp32 module again
    assert model.net[0].weight.grad.dtype == torch.float32


class AssignsGradients(TinyMLP):
    """SGD whose ``on_before_optimizer_step`` replaces the first weight's gradient with a constant and drops the first
    bias's, recording the masters of both around each step."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd", lr=0.5)
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        weight, bias = self.net[0].weight, self.net[0].bias
        weight.grad = torch.full_like(weight.grad, 0.25)
        bias.grad = None
        masters = self.trainer.precision_plugin.main_params(optimizer)
        self.records.append((masters[0].detach().clone(), masters[1].detach().clone(), masters[0], masters[1]))

    def on_train_batch_end(self, *args: Any) -> None:
        before_w, before_b, master_w, master_b = self.records[-1]
        self.records[-1] = (before_w, before_b, master_w.detach().clone(), master_b.detach().clone())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_gradient_assigned_or_dropped_by_a_hook_is_what_the_optimizer_steps(precision):
    """A hook that assigns a parameter's gradient before the step has the optimizer step with it; one that drops a
    gradient has the optimizer leave that parameter alone. Bitwise: SGD's update of a master is one fp32 operation,
    ``master - lr * grad`` with ``lr * grad = 0.125`` exact, whatever the machine."""
    torch.manual_seed(0)
    model = AssignsGradients()
    plugin = MPTPrecision(precision, scaler=64.0) if precision == "fp16" else MPTPrecision(precision)
    quiet_trainer(max_steps=3, plugins=[plugin]).fit(model, regression_data())
    assert plugin.skipped_steps == 0
    assert len(model.records) == 3
    for before_w, before_b, after_w, after_b in model.records:
        assert torch.equal(after_w, before_w - 0.125)
        assert torch.equal(after_b, before_b)


# ------------------------------------------------------------------------ gradients that are None or zeros


class Branchy(L.LightningModule):
    """A trunk used at every batch and a branch used at the first only. SGD with momentum moves a parameter whose
    gradient is a zero tensor and leaves one whose gradient is ``None``: ``moved`` records, per step, whether the
    branch's weight changed."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch = nn.Linear(8, 4), nn.Linear(8, 4)
        self.moved: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        out = self.trunk(x)
        if batch_idx == 0:
            out = out + self.branch(x)
        return out.float().pow(2).mean()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.before = self.branch.weight.detach().float().clone()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.moved.append(not torch.equal(self.branch.weight.detach().float(), self.before))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class KeepsZeros(Branchy):
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)


def keeps_zeros_on_the_object() -> Branchy:
    """``zero_grad(set_to_none=False)`` given to the module object, not its class (Lightning looks hooks up there)."""
    model = Branchy()
    model.optimizer_zero_grad = lambda epoch, batch_idx, optimizer: optimizer.zero_grad(set_to_none=False)  # type: ignore[method-assign]
    return model


class ClipsAfterBackward(Branchy):
    """Clips in ``on_after_backward`` with a bound never reached: every gradient is multiplied in place by 1."""

    def on_after_backward(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1e9)


@pytest.mark.parametrize(
    ("module", "plugin_kwargs", "expected"),
    [
        # zero_grad(set_to_none=False): the branch keeps a zero gradient, which momentum acts on, as under "32-true";
        # after the skipped step 1 too (the skip leaves zeros, as GradScaler's inf gradients zeroed by zero_grad)
        (KeepsZeros, {}, [True, False, True, True]),
        (keeps_zeros_on_the_object, {}, [True, False, True, True]),
        # accumulate_fp32 gives each parameter fp32 zeros to accumulate into: the unused branch's are taken back
        pytest.param(
            Branchy,
            {"accumulate_fp32": True},
            [True, False, False, False],
            marks=pytest.mark.skipif(not GRAD_DTYPE, reason="accumulate_fp32 needs torch >= 2.13"),
        ),
        # ... also when a clip multiplied those zeros in place: only a backward's accumulation makes them a gradient
        pytest.param(
            ClipsAfterBackward,
            {"accumulate_fp32": True},
            [True, False, False, False],
            marks=pytest.mark.skipif(not GRAD_DTYPE, reason="accumulate_fp32 needs torch >= 2.13"),
        ),
    ],
)
def test_a_parameter_without_gradient_is_stepped_as_under_lightnings_own_precision(module, plugin_kwargs, expected):
    from lightning.pytorch.plugins.precision import MixedPrecision

    def run(plugin: Any) -> Branchy:
        torch.manual_seed(0)
        model = module()
        quiet_trainer(max_steps=4, plugins=[plugin], callbacks=[InjectInf("trunk.weight", steps={1})]).fit(
            model, DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=8)
        )
        return model

    reference = run(MixedPrecision("16-mixed", "cpu"))  # GradScaler skips step 1 too
    assert reference.moved == expected
    ours = run(MPTPrecision("fp16", **plugin_kwargs))
    assert ours.moved == expected
    assert torch.allclose(ours.branch.weight, reference.branch.weight, rtol=1e-3, atol=1e-4)


class StepsEveryOtherBatch(L.LightningModule):
    """Lightning's documented override: ``optimizer_step`` runs the closure itself, then steps without it, every other
    batch (the wrapper hands the plugin a closure that does nothing and returns ``None``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()
        if batch_idx % 2 == 0:
            optimizer.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("chunked", [None, False])
def test_a_step_without_the_closure_after_running_it_steps_as_under_32_true(chunked):
    """bf16's chunked default took no step when the closure it was handed returned ``None`` (as fp16's
    ``MixedPrecision`` does, where Lightning's closure returning ``None`` means no backward); "bf16-mixed" lets the
    optimizer step, and so does the plugin now."""

    def run(**kwargs: Any) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = StepsEveryOtherBatch()
        quiet_trainer(max_epochs=1, **kwargs).fit(model, regression_data(n=64))
        return snapshot(model)

    start = run(max_steps=0)
    ref = run(precision="32-true")
    got = run(plugins=[MPTPrecision("bf16", chunked_step=chunked)])
    assert moved(start, ref) > 0
    assert moved(ref, got) < 0.1 * moved(start, ref)  # bf16's rounding and compute aside, the same steps


class ScaledLoss(L.LightningModule):
    """A loss multiplied by ``k``: at the scale of 2**16 each micro-batch's fp16 gradient fits, two summed do not."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.scales: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self.net(x).float() - y).pow(2).mean() * self.k

    def on_train_batch_end(self, *args: Any) -> None:
        self.scales.append(float(self.trainer.precision_plugin.scaler.get_scale()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05 / self.k)


@pytest.mark.skipif(not GRAD_DTYPE, reason="fp32 sums of half gradients need torch >= 2.13 (Tensor.grad_dtype)")
def test_fp16_accumulation_sums_in_fp32_and_skips_only_where_16_mixed_does():
    """fp16's default summed micro-batches in fp16: at the loss scale two gradients that each fit overflowed once
    added, and the step was skipped (the scale halved) where "16-mixed", whose gradients are fp32, took it."""

    def run(steps: int = 6, **kwargs: Any) -> ScaledLoss:
        torch.manual_seed(0)
        model = ScaledLoss(7.0)
        x, y = torch.randn(32, 8, generator=torch.Generator().manual_seed(0)), torch.randn(32, 4)
        quiet_trainer(max_steps=steps, accumulate_grad_batches=2, **kwargs).fit(
            model, DataLoader(TensorDataset(x, y), batch_size=8)
        )
        return model

    start = snapshot(run(0))
    reference = run(plugins=[MixedPrecision("16-mixed", "cpu")])
    ours = run(plugins=[MPTPrecision("fp16")])
    assert ours.scales == reference.scales  # the same steps taken, the same skips
    assert moved(snapshot(reference), snapshot(ours)) < 0.05 * moved(start, snapshot(reference))


class SeesBranchGradients(Branchy):
    """Records, at each step, whether the branch's weight has a gradient (hooks see what "16-mixed" shows)."""

    def __init__(self) -> None:
        super().__init__()
        self.has_grad: list[bool] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.has_grad.append(self.branch.weight.grad is not None)


@pytest.mark.skipif(not GRAD_DTYPE, reason="fp32 sums of half gradients need torch >= 2.13 (Tensor.grad_dtype)")
def test_fp16_accumulation_leaves_a_parameter_unused_in_a_window_without_gradient():
    """fp16's fp32 sums convert the gradients there are at a window's later backwards and give none to a parameter
    without one: the branch, used in the first window only, has no gradient at the second step (hooks see ``None``,
    SGD's momentum leaves it alone), as under "16-mixed"."""

    def run(plugin: Any) -> SeesBranchGradients:
        torch.manual_seed(0)
        model = SeesBranchGradients()
        quiet_trainer(max_steps=2, accumulate_grad_batches=2, plugins=[plugin]).fit(
            model, DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=8)
        )
        return model

    reference = run(MixedPrecision("16-mixed", "cpu"))
    assert reference.moved == [False, True, False, False]  # steps at batches 1 and 3
    assert reference.has_grad == [True, False]
    ours = run(MPTPrecision("fp16"))
    assert ours.moved == reference.moved
    assert ours.has_grad == reference.has_grad
    assert torch.allclose(ours.branch.weight, reference.branch.weight, rtol=1e-3, atol=1e-4)


class StepsTheRawOptimizer(L.LightningModule):
    """Manual optimization that steps the torch optimizer itself (``use_pl_optimizer=False``)."""

    def __init__(self, raw: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.raw = raw
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt = self.optimizers(use_pl_optimizer=not self.raw)
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(x).float(), y))
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_stepping_the_torch_optimizer_itself_is_refused(precision):
    """Between steps the torch optimizer holds the half parameters: its own ``step()`` updated them directly,
    bypassing the masters (bf16: as "bf16-true", 1.4x the run's movement off "bf16-mixed" at lr 1e-3), silently. It
    is refused with what to call instead; the wrapper's step trains as before."""
    model = StepsTheRawOptimizer(raw=True)
    match = r"SGD.step\(\) was called on the torch optimizer itself.*self.optimizers\(\)"
    with pytest.raises(RuntimeError, match=match):  # one epoch: the raw steps never count as the Trainer's steps
        quiet_trainer(max_epochs=1, plugins=[MPTPrecision(precision)]).fit(model, regression_data())
    wrapped = StepsTheRawOptimizer(raw=False)
    before = snapshot(wrapped)
    quiet_trainer(max_steps=2, plugins=[MPTPrecision(precision)]).fit(wrapped, regression_data())
    assert moved(before, snapshot(wrapped)) > 0


class FlipsAUnit(L.LightningModule):
    """A tanh hidden unit's sign flipped after a step: its incoming row and bias negated, and its outgoing column (index
    3 of 8: the top values of their 8-byte words in the half weights), the function unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 128)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.b(torch.tanh(self.a(x))).float().pow(2).mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            with torch.no_grad():
                for t in (self.a.weight[3], self.a.bias[3:4], self.b.weight[:, 3]):
                    t.neg_()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ExactEditCheck(L.Callback):
    """Makes every step's edit check round every master (the check before fingerprints)."""

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        trainer.precision_plugin._engine.masters.edits.forget()


def test_a_hidden_units_sign_flip_is_adopted_as_by_the_exact_check():
    """Negating a unit's outgoing column flips the sign of every fourth value of a row of 8 (128 rows, half of them
    positive): the sign flips cancel in sums of whole words. The step after the flip must train from it exactly as
    with every master rounded and compared (the same arithmetic: bitwise); missed, the master kept the old column and
    the next write-back undid the flip (found by a hostile probe)."""
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)

    def run(callbacks: list) -> dict:
        torch.manual_seed(0)
        model = FlipsAUnit()
        with torch.no_grad():  # as many positive values as negative ones in the column
            model.b.weight[:, 3] = model.b.weight[:, 3].abs() * torch.tensor([1.0, -1.0]).repeat(64)
        quiet_trainer(max_steps=4, plugins=[MPTPrecision("fp16", scaler=256.0)], callbacks=callbacks).fit(model, data)
        return snapshot(model)

    got, exact = run([]), run([ExactEditCheck()])
    for n in exact:
        assert torch.equal(got[n], exact[n]), n


# ------------------------------------------------------------------------ activation checkpointing


class Recomputed(TinyMLP):
    """``torch.utils.checkpoint`` around the network (``reentrant``: torch's older implementation; ``None``: no
    checkpoint): the backward runs the forward again, under the autocast state of the first forward."""

    def __init__(self, reentrant: Any) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.net(x)
        # the reentrant implementation needs an input that requires grad to give its output a graph
        return torch.utils.checkpoint.checkpoint(
            self.net, x.requires_grad_(self.reentrant), use_reentrant=self.reentrant
        )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_activation_checkpointing_gives_the_run_without_it(precision: str) -> None:
    """A recomputed forward is the same half-precision forward (autocast's cache, which would give the recomputation
    other casts, is off): the weights after fit are those of the same run without checkpointing, bitwise (the same
    kernels on the same values in the same order; each parameter receives one gradient per step). Also with torch's
    reentrant checkpoint."""
    torch.manual_seed(0)
    initial = Recomputed(None).state_dict()
    weights = {}
    for reentrant in (None, False, True):
        model = Recomputed(reentrant)
        model.load_state_dict(initial)
        quiet_trainer(max_steps=6, plugins=[MPTPrecision(precision)]).fit(model, regression_data())
        weights[reentrant] = snapshot(model)
    for reentrant in (False, True):
        for name, value in weights[None].items():
            assert torch.equal(weights[reentrant][name], value), (reentrant, name)
    start = Recomputed(None)
    start.load_state_dict(initial)
    assert moved(snapshot(start), weights[None]) > 1e-3  # a run that trained
