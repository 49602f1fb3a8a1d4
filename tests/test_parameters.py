"""Kinds of parameters: frozen ones (a base with an adapter), frozen then unfrozen (``BackboneFinetuning``), and
parametrized ones (``spectral_norm``, ``orthogonal``, ``weight_norm``, old and new APIs).

A parameter frozen when the model is converted has no master: it costs its half weight only (2 bytes, as under
"16-true"). Unfrozen later, it gets its master at its first step, from its half value. Parametrized tensors stay
fp32 by default (``ParametrizationList`` is in ``DEFAULT_KEEP_FP32``): their parametrizations run ops that autocast
does not cover (``spectral_norm``'s ``mv`` crashed with half weights) or that lose the constraint in half precision
(``orthogonal``'s ``matrix_exp`` skipped 31 of 32 bf16 steps).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from models import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import DEFAULT_KEEP_FP32, MPTPrecision

PRECISIONS = ["fp16", "bf16"]


def data(n: int = 32, d: int = 16, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return DataLoader(TensorDataset(x, x[:, :4].sum(1, keepdim=True)), batch_size=8)


class Adapted(L.LightningModule):
    """A frozen base with a small trainable adapter (the LoRA pattern: the optimizer gets every parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        self.base.requires_grad_(False)
        self.adapter = nn.Linear(16, 1)
        self.seen: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.adapter(self.base(x)).float(), y)

    def on_train_batch_end(self, *args: Any) -> None:
        plugin = self.trainer.precision_plugin
        self.seen["masters"] = {name: m.dtype for name, _, m in plugin.named_masters()}
        self.seen["base"] = {n: p.dtype for n, p in self.base.named_parameters()}
        self.seen["master_of_base"] = plugin.master_of(self.base[0].weight) is self.base[0].weight

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_frozen_base_costs_no_master(precision):
    torch.manual_seed(0)
    model = Adapted()
    original = {n: p.detach().clone() for n, p in model.base.named_parameters()}
    trainer = quiet_trainer(max_epochs=2, plugins=[MPTPrecision(precision)])
    trainer.fit(model, data())
    half = torch.float16 if precision == "fp16" else torch.bfloat16
    assert set(model.seen["masters"]) == {"adapter.weight", "adapter.bias"}  # the old code also kept the base's
    assert set(model.seen["base"].values()) == {half}
    assert model.seen["master_of_base"]
    # after fit: fp32, holding the half values the model computed with (the fp32 originals are not kept)
    for n, p in model.base.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, original[n].to(half).float())
    assert trainer.optimizers[0].state.keys().isdisjoint(set(model.base.parameters()))


class Finetuned(L.LightningModule):
    """``BackboneFinetuning``'s recipe: the optimizer starts with the head; the backbone joins at an epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)
        self.trained: dict[int, set[str]] = {}
        self.at_start: dict[str, torch.Tensor] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)).float(), y)

    def on_train_start(self) -> None:
        plugin = self.trainer.precision_plugin
        self.at_start = {name: m.detach().clone() for name, _, m in plugin.named_masters()}

    def on_train_epoch_end(self) -> None:
        plugin = self.trainer.precision_plugin
        self.trained[self.current_epoch] = {name for name, _, _ in plugin.named_masters()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_backbone_finetuning_makes_masters_when_the_backbone_is_unfrozen_and_resumes_them_exactly(tmp_path, precision):
    def fit(ckpt_path: Any = None) -> tuple[Finetuned, L.Trainer]:
        torch.manual_seed(0)
        model = Finetuned()
        ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=2, backbone_initial_ratio_lr=0.5), ckpt]
        trainer = quiet_trainer(
            max_epochs=5, plugins=[MPTPrecision(precision)], callbacks=callbacks, enable_checkpointing=True
        )
        trainer.fit(model, data(), ckpt_path=ckpt_path)
        return model, trainer

    head, backbone = {"head.weight", "head.bias"}, {"backbone.0.weight", "backbone.0.bias"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, trainer = fit()
        assert model.trained[0] == model.trained[1] == head  # the frozen backbone has no master
        assert model.trained[4] == head | backbone  # made when it was unfrozen
        assert trainer.precision_plugin.skipped_steps < 3
        saved = torch.load(tmp_path / "epoch=3.ckpt", weights_only=False)["state_dict"]
        assert not torch.equal(saved["backbone.0.weight"], saved["backbone.0.weight"].half().float())  # trained fp32
        # resume after the unfreezing: the backbone is frozen again when the module is converted (BackboneFinetuning
        # unfreezes it at on_fit_start), yet its masters are the checkpoint's exact values, not rounded half ones
        resumed, _ = fit(ckpt_path=tmp_path / "epoch=3.ckpt")
    assert set(resumed.at_start) == head | backbone
    assert all(torch.equal(resumed.at_start[name], saved[name]) for name in head | backbone)
    assert resumed.trained[4] == head | backbone


# ------------------------------------------------------------------------ parametrizations

PARAMETRIZATIONS: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "spectral_norm": lambda m: nn.utils.parametrizations.spectral_norm(m),
    "legacy_spectral_norm": lambda m: nn.utils.spectral_norm(m),
    "orthogonal": lambda m: nn.utils.parametrizations.orthogonal(m),
    "weight_norm": lambda m: nn.utils.parametrizations.weight_norm(m),
    "legacy_weight_norm": lambda m: nn.utils.weight_norm(m),
}


class Parametrized(L.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the legacy APIs are deprecated
            self.layer = PARAMETRIZATIONS[kind](nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.layer(x))).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", sorted(PARAMETRIZATIONS))
def test_parametrized_weights_train_in_fp32(kind, precision):
    torch.manual_seed(0)
    model = Parametrized(kind)
    plugin = MPTPrecision(precision, scaler=2.0**8 if precision == "fp16" else None)
    trainer = quiet_trainer(max_epochs=4, plugins=[plugin])
    trainer.fit(model, data())  # the old code: "addmv input tensors must have the same dtype" (spectral_norm)
    assert plugin.skipped_steps == 0  # the old code skipped 31 of 32 bf16 steps with orthogonal
    weight = model.layer.weight.detach()
    if kind == "orthogonal":  # the constraint holds to fp32 accuracy
        torch.testing.assert_close(weight.T @ weight, torch.eye(16), atol=1e-5, rtol=0)
    if kind.endswith("spectral_norm"):
        assert torch.linalg.matrix_norm(weight, ord=2) == pytest.approx(1.0, abs=0.05)


def test_parametrizations_are_kept_fp32_by_default_and_can_be_cast():
    """``keep_fp32`` without ``ParametrizationList`` casts a parametrized tensor like any other (the user's choice:
    weight_norm computes in the half format then)."""
    assert nn.utils.parametrize.ParametrizationList in DEFAULT_KEEP_FP32
    for keep, dtype in [(DEFAULT_KEEP_FP32, torch.float32), ((nn.LayerNorm,), torch.bfloat16)]:
        model = Parametrized("weight_norm")
        plugin = MPTPrecision("bf16", keep_fp32=keep)
        trainer = quiet_trainer(max_epochs=1, plugins=[plugin])
        seen = []
        model.on_train_batch_end = lambda *a: seen.append(model.layer.parametrizations.weight.original0.dtype)
        trainer.fit(model, data())
        assert set(seen) == {dtype}


class LazyNet(L.LightningModule):
    """``nn.LazyLinear``: its weight has no shape until a forward; ``dry_run`` runs one in ``setup()``."""

    def __init__(self, dry_run: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 4))
        self.dry_run = dry_run

    def setup(self, stage: str) -> None:
        if self.dry_run:
            self.net(torch.zeros(1, 16))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_a_lazy_module_is_refused_until_a_forward_gave_it_shapes() -> None:
    data = DataLoader(TensorDataset(torch.randn(16, 16), torch.randn(16, 4)), batch_size=8)
    with pytest.raises(ValueError, match=r"net\.0\.weight, net\.0\.bias are 2 uninitialized parameters.*setup\(\)"):
        quiet_trainer(max_steps=2, plugins=[MPTPrecision("bf16")]).fit(LazyNet(dry_run=False), data)
    model = LazyNet(dry_run=True)
    quiet_trainer(max_steps=2, plugins=[MPTPrecision("bf16")]).fit(model, data)
    assert model.net[0].weight.shape == (8, 16)
    assert model.net[0].weight.dtype == torch.float32


class ChannelsLastCNN(L.LightningModule):
    """A convolution, a norm and a head, converted to ``channels_last`` before fit (as vision projects do for Tensor
    Cores); records whether the half weight the forward uses is still ``channels_last`` at each step."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)
        self.kept: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x.to(memory_format=torch.channels_last)).float(), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.kept.append(self.features[0].weight.is_contiguous(memory_format=torch.channels_last))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_channels_last_weight_stays_channels_last_and_trains_like_fp32(precision: str) -> None:
    """The half weights lie in one flat buffer, each a view with its own strides: a ``channels_last`` convolution
    weight keeps its memory format at every step and after fit, and the run ends near a "32-true" run of the same
    model: within a tenth of how far the weight moved (the half-precision activations make the difference)."""
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 4, (32,), generator=g)), 8)
    torch.manual_seed(0)
    model = ChannelsLastCNN().to(memory_format=torch.channels_last)
    reference = ChannelsLastCNN().to(memory_format=torch.channels_last)
    reference.load_state_dict(model.state_dict())
    start = model.features[0].weight.detach().clone()
    quiet_trainer(max_steps=4, plugins=[MPTPrecision(precision)]).fit(model, data)
    quiet_trainer(max_steps=4).fit(reference, data)
    weight = model.features[0].weight
    assert model.kept == [True] * 4
    assert reference.kept == [True] * 4
    assert weight.dtype == torch.float32
    assert weight.is_contiguous(memory_format=torch.channels_last)
    # a weight laid out wrongly (its strides lost) would train another function: a difference of the size of the move
    moved = (reference.features[0].weight - start).abs().max()
    assert moved > 1e-2
    assert (weight - reference.features[0].weight).abs().max() < 0.1 * moved
