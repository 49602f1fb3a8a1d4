"""Lightning's ``WeightAveraging``/``EMAWeightAveraging`` under ``MPTPrecision``: the average is fed the fp32 masters,
is swapped with them exactly around every validation and copied into them at the end of fit, so it stays the exact
fp32 average whatever the validation frequency. Checked against an EMA computed by hand from the masters, a "32-true"
run and Lightning's fp16 AMP (issue 18, review failure 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from models import TinyMLP, quiet_trainer, regression_data
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_avg_fn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision

callbacks = pytest.importorskip("lightning.pytorch.callbacks")
if not hasattr(callbacks, "EMAWeightAveraging"):  # lightning >= 2.6
    pytest.skip("Lightning's WeightAveraging callbacks need lightning >= 2.6", allow_module_level=True)
EMAWeightAveraging = callbacks.EMAWeightAveraging

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
# the methods the plugin points at the masters on a callback object while a stage runs
ADAPTED = {
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_train_end",
    "update_parameters",
    "transfer_weights",
}


class EdgeNet(L.LightningModule):
    """Tiny token model with the cases the average must line up with: a head tied to the embedding (one parameter,
    listed once), a frozen parameter, a LayerNorm (fp32, its own master) and a BatchNorm1d (fp32 running buffers and
    an int64 batch count)."""

    def __init__(self, vocab: int = 12, d: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.proj.bias.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.bn(self.norm(torch.relu(self.proj(self.emb(x))))))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def token_pairs(n: int = 64, vocab: int = 12, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (n,), generator=g)
    return DataLoader(TensorDataset(x, (x + 1) % vocab), batch_size=batch_size, shuffle=False)


class HandEMA(L.Callback):
    """An independent EMA of the fp32 masters (and of the buffers, as ``use_buffers=True``) after every optimizer step,
    with torch's EMA formula, held in the dtypes of Lightning's average (fp32 for floating values).

    It also checks at every validation that the module holds the average there (the masters exactly, the half
    weights rounded from them) and the current weights again afterwards: place it after the averaging callback. A
    parameter without a master (frozen at set-up, kept in the half format only) holds the average in that format
    during validation, so its average is rounded there; being frozen, it does not change.
    """

    def __init__(self, decay: float) -> None:
        self.avg_fn = get_ema_avg_fn(decay)
        self.average: Optional[list[Tensor]] = None
        self.current: list[Tensor] = []
        self.validations = 0

    def state_dict(self) -> dict[str, Any]:
        return {"average": self.average}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.average = state_dict["average"]

    @staticmethod
    def state(trainer: L.Trainer, module: L.LightningModule) -> list[Tensor]:
        plugin = trainer.precision_plugin
        return [plugin.master_of(p).detach() for p in module.parameters()] + [b.detach() for b in module.buffers()]

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.current = [t.clone() for t in self.state(trainer, module)]
        if self.average is None:
            self.average = [t.to(torch.float32 if t.is_floating_point() else t.dtype, copy=True) for t in self.current]
        else:
            for a, t in zip(self.average, self.current):
                a.copy_(self.avg_fn(a, t, None))

    def on_validation_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert self.average is not None
        self.validations += 1
        for expected, held, p in zip(self.average, self.state(trainer, module), module.parameters()):
            if held.dtype == torch.float32:
                assert torch.equal(held, expected)  # the average is in the masters, exactly
                assert torch.equal(p.detach(), held.to(p.dtype))  # and validation sees it rounded

    def on_validation_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert self.average is not None
        for average, expected, held in zip(self.average, self.current, self.state(trainer, module)):
            assert torch.equal(held, expected)  # the current weights are back, exactly
            if held.dtype in HALF.values():  # no master (frozen): the module held the average in the half format
                average.copy_(average.to(held.dtype))


def fp16_representable(t: Tensor) -> bool:
    return torch.equal(t, t.half().float())


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_ema_is_the_exact_fp32_ema_of_the_masters_across_validations(precision):
    torch.manual_seed(0)
    model, data = EdgeNet(), token_pairs()
    ema, hand = EMAWeightAveraging(decay=0.9), HandEMA(decay=0.9)
    has_master: list[bool] = []

    class Masters(L.Callback):
        def on_train_end(self, trainer, module):
            has_master.extend(trainer.precision_plugin.master_of(p).dtype == torch.float32 for p in module.parameters())

    trainer = quiet_trainer(
        max_epochs=2, val_check_interval=2, plugins=[MPTPrecision(precision)], callbacks=[ema, hand, Masters()]
    )
    trainer.fit(model, data, data)
    assert hand.validations == 8
    assert trainer.global_step == 16
    assert not ADAPTED & set(vars(ema))  # the adaptation ends with the stage

    # after fit the module holds the average, in fp32
    assert hand.average is not None
    params = list(model.parameters())
    assert model.head.weight is model.emb.weight
    assert len(params) == 7  # the tied weight is listed once
    for p, expected, exact in zip(params, hand.average, has_master):
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), expected if exact else expected.to(HALF[precision]).float())
    for b, expected in zip(model.buffers(), hand.average[len(params) :]):
        assert torch.equal(b, expected)
    assert not fp16_representable(model.proj.weight.detach())  # an fp32 average, not a rounded one


def test_ema_with_frequent_validation_tracks_the_fp32_ema_as_closely_as_fp16_amp():
    """The EMA's distance to the "32-true" EMA, relative to how far that EMA moved, is no larger than under Lightning's
    fp16 AMP (it is 20x larger when every validation rounds the average to fp16)."""
    from lightning.pytorch.plugins import MixedPrecision

    data = regression_data(n=256)

    def ema_after(**kwargs: Any) -> tuple[Tensor, Tensor]:
        torch.manual_seed(0)
        model = TinyMLP(optimizer="sgd", lr=0.05)
        start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        trainer = quiet_trainer(
            max_steps=160,
            val_check_interval=5,
            check_val_every_n_epoch=None,
            callbacks=[EMAWeightAveraging()],
            **kwargs,
        )
        trainer.fit(model, data, data)
        return start, torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])

    start, reference = ema_after(precision="32-true")
    moved = float((reference - start).norm())

    def error(**kwargs: Any) -> float:
        return float((ema_after(**kwargs)[1] - reference).norm()) / moved

    amp = error(plugins=[MixedPrecision("16-mixed", "cpu")])
    mpt = error(plugins=[MPTPrecision("fp16")])
    assert 0 < mpt <= 1.25 * amp, (mpt, amp)


class Clamped(TinyMLP):
    """Clamps its first layer's weight in place after every batch (a WGAN critic's clamp), on the half weights."""

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            self.net[0].weight.clamp_(-0.05, 0.05)


def test_an_edit_of_the_half_weights_right_before_validation_is_kept():
    limits: list[float] = []

    class Check(L.Callback):
        def on_validation_epoch_end(self, trainer, module):
            limits.append(float(trainer.precision_plugin.master_of(module.net[0].weight).abs().max()))

    torch.manual_seed(0)
    model = Clamped(optimizer="sgd", lr=0.05)
    assert float(model.net[0].weight.detach().abs().max()) > 0.1
    ema = EMAWeightAveraging(decay=0.9)
    trainer = quiet_trainer(max_steps=6, val_check_interval=2, plugins=[MPTPrecision("fp16")], callbacks=[ema, Check()])
    trainer.fit(model, regression_data(), regression_data())
    assert len(limits) == 3
    assert max(limits) <= 0.05  # the clamp made after the step reached the masters before the swap


class ClampsInOptimizerStep(TinyMLP):
    """Lightning's WGAN recipe: ``optimizer_step`` overridden to clamp the critic's weight after each step, before the
    callbacks' ``on_train_batch_end`` (where the average is updated)."""

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        with torch.no_grad():
            self.net[0].weight.clamp_(-0.05, 0.05)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_an_edit_after_the_step_reaches_the_average_as_under_32_true(precision):
    """The average is updated from the masters after the edit: an average of clamped weights, within the clamp, as
    "32-true" computes it (not of the masters the step left, which fp32 copies adopt the clamp into only at the next
    step's check)."""

    def run(**kwargs: Any) -> Tensor:
        torch.manual_seed(0)
        model = ClampsInOptimizerStep(optimizer="sgd", lr=0.05)
        quiet_trainer(max_steps=6, callbacks=[EMAWeightAveraging(decay=0.5)], **kwargs).fit(model, regression_data())
        return model.net[0].weight.detach().float()

    reference = run(precision="32-true")
    got = run(plugins=[MPTPrecision(precision)])
    assert float(got.abs().max()) <= 0.05 * (1 + 2.0**-7)  # the clamp, rounded to the half format
    if precision == "fp16":  # bf16's compute moves the run as far as "bf16-mixed" does (4.5e-3 here)
        torch.testing.assert_close(got, reference, rtol=0, atol=2e-4)


def test_swa_averages_the_weights_a_batch_end_clamp_left_as_under_32_true():
    """SWA updates its average at the epoch's end, after the module's ``on_train_batch_end`` clamped the last batch's
    weights: it averages the clamped ones, as "32-true" does (fp32 copies took that clamp only at the next step)."""

    def run(**kwargs: Any) -> Tensor:
        torch.manual_seed(0)
        model = Clamped(optimizer="sgd", lr=0.05)
        swa = L.pytorch.callbacks.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        quiet_trainer(max_epochs=4, callbacks=[swa], **kwargs).fit(model, regression_data())
        return model.net[0].weight.detach().float()

    torch.testing.assert_close(run(plugins=[MPTPrecision("fp16")]), run(precision="32-true"), rtol=0, atol=2e-4)


def test_checkpoint_holds_fp32_average_and_masters_and_resume_continues_the_ema_exactly(tmp_path: Path):
    data = token_pairs()
    param_names = [n for n, _ in EdgeNet().named_parameters()]  # the tied weight once, under its first name
    state_names = param_names + [n for n, _ in EdgeNet().named_buffers()]

    class Record(L.Callback):
        """The hand EMA and the masters when each epoch's checkpoint is written; the masters at the end of training."""

        def __init__(self, hand: HandEMA) -> None:
            self.hand = hand
            self.at_epoch_end: list[tuple[dict[str, Tensor], list[Tensor]]] = []
            self.final_masters: list[Tensor] = []

        def on_train_epoch_end(self, trainer, module):
            assert self.hand.average is not None
            average = dict(zip(state_names, (t.clone() for t in self.hand.average)))
            average["head.weight"] = average["emb.weight"]
            self.at_epoch_end.append((average, [t.clone() for t in HandEMA.state(trainer, module)]))

        def on_train_end(self, trainer, module):
            self.final_masters = [t.clone() for t in HandEMA.state(trainer, module)]

    def run(name: str, ckpt_path: Optional[Path] = None) -> tuple[L.LightningModule, Record]:
        torch.manual_seed(0)
        model, hand = EdgeNet(), HandEMA(decay=0.9)
        record = Record(hand)
        ckpt = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path / name, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True
        )
        trainer = quiet_trainer(
            max_epochs=3,
            val_check_interval=3,
            plugins=[MPTPrecision("fp16")],
            callbacks=[EMAWeightAveraging(decay=0.9), hand, record, ckpt],
            enable_checkpointing=True,
        )
        trainer.fit(model, data, data, ckpt_path=ckpt_path)
        assert trainer.global_step == 24
        return model, record

    straight, straight_record = run("straight")
    saved = tmp_path / "straight" / "epoch=0-step=8.ckpt"
    checkpoint = torch.load(saved, weights_only=False)
    average, masters = straight_record.at_epoch_end[0]
    # "state_dict" holds the average (the exact fp32 EMA of the masters), "current_model_state" the fp32 masters
    assert set(checkpoint["state_dict"]) == set(average)
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(value, average[key]), key
    current = checkpoint["current_model_state"]
    for key, expected in zip(param_names, masters):
        assert current[key].dtype == torch.float32, key
        assert torch.equal(current[key], expected), key
    assert not fp16_representable(checkpoint["state_dict"]["proj.weight"])
    assert not fp16_representable(current["proj.weight"])

    resumed, resumed_record = run("resumed", ckpt_path=saved)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name  # the average, after fit
    for a, b in zip(straight_record.final_masters, resumed_record.final_masters):
        assert torch.equal(a, b)  # the current weights at the end of training


class OverridingEMA(EMAWeightAveraging):
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_epoch_start(trainer, pl_module)


class OverridingSwap(EMAWeightAveraging):
    def _swap_models(self, pl_module: L.LightningModule) -> None:
        super()._swap_models(pl_module)


class OverridingSWA(L.pytorch.callbacks.StochasticWeightAveraging):
    @staticmethod
    def update_parameters(*args: Any) -> None:
        L.pytorch.callbacks.StochasticWeightAveraging.update_parameters(*args)


@pytest.mark.parametrize(
    ("callback", "message"),
    [
        (OverridingEMA(), "OverridingEMA overrides on_validation_epoch_start, so it is not adapted"),
        (OverridingSwap(), "OverridingSwap overrides _swap_models, so it is not adapted"),
        (
            OverridingSWA(swa_lrs=0.01, swa_epoch_start=1),
            "OverridingSWA overrides update_parameters, so it is not adapted",
        ),
    ],
)
def test_a_subclass_that_overrides_an_adapted_method_is_left_alone_with_a_warning(callback, message):
    instance_methods: list[str] = []

    class Probe(L.Callback):
        def on_train_start(self, trainer, module):
            instance_methods.extend(name for name in vars(callback) if name in ADAPTED)

    trainer = quiet_trainer(
        max_steps=2, val_check_interval=1, plugins=[MPTPrecision("fp16")], callbacks=[callback, Probe()]
    )
    with pytest.warns(UserWarning, match=message):
        trainer.fit(TinyMLP(), regression_data(n=32), regression_data(n=32))
    assert instance_methods == []  # its own methods run, on the half-precision weights
