"""A Hugging Face ``transformers`` model trained under the plugin: ``save_pretrained`` during training writes the fp32
masters, and its ``config.json`` says ``float32``, so ``from_pretrained`` reloads the masters exactly (as after
``"bf16-mixed"``), under the Trainer and under Fabric.

A tiny GPT-2 (one layer, width 16, tied embeddings); ``pip install -e .[dev]`` installs transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from models import quiet_trainer, token_data
from torch import nn

from lightning_mpt import MPTPrecision
from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision


def gpt2() -> nn.Module:
    try:
        import transformers
    except Exception as err:  # absent, or not importable with this torch (the floor's)
        pytest.skip(f"transformers is not usable here: {type(err).__name__}: {err}")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=16, n_positions=8)
    return transformers.GPT2LMHeadModel(config)


def reloaded(directory: Path) -> nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(directory)


class LanguageModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, _ = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SavePretrained(L.Callback):
    """``save_pretrained`` after the second step, and the masters at that moment."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.masters: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2:
            module.model.save_pretrained(self.directory)
            plugin = trainer.precision_plugin
            self.masters = {n: plugin.master_of(p).detach().clone() for n, p in module.model.named_parameters()}


def assert_reloads_the_masters(directory: Path, masters: dict[str, torch.Tensor]) -> None:
    config = json.loads((directory / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"  # transformers >= 5, 4.x
    model = reloaded(directory)
    assert model.dtype == torch.float32
    names = [n for n, _ in model.named_parameters()]
    assert names == list(masters)
    for name, p in model.named_parameters():
        assert torch.equal(p, masters[name]), name  # the fp32 masters, saved and loaded without a cast


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_save_pretrained_during_training_reloads_the_fp32_masters(tmp_path: Path, precision: str) -> None:
    module = LanguageModel()
    save = SavePretrained(tmp_path / "pretrained")
    plugin = MPTPrecision(precision)
    quiet_trainer(max_steps=3, plugins=[plugin], callbacks=[save]).fit(module, token_data(vocab=16))
    assert any(not torch.equal(m, m.to(plugin.half_dtype).float()) for m in save.masters.values())  # not half values
    assert_reloads_the_masters(tmp_path / "pretrained", save.masters)
    assert "save_pretrained" not in vars(module.model)  # after fit the model's own method again (an fp32 model)


def test_save_pretrained_in_a_fabric_loop_reloads_the_fp32_masters(tmp_path: Path) -> None:
    plugin = FabricMPTPrecision("fp16")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = gpt2()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for tokens, _ in token_data(vocab=16):
        fabric.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(tmp_path / "pretrained")
    assert_reloads_the_masters(
        tmp_path / "pretrained", {n: plugin.master_of(p).detach().clone() for n, p in net.named_parameters()}
    )
    plugin.restore()
    assert "save_pretrained" not in vars(net)


class SaveStateDict(L.Callback):
    """After the second step: ``model.state_dict()`` with its storages, ``safetensors``' ``save_model``, and the
    masters at that moment."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.seen: dict[str, tuple[torch.dtype, int, int]] = {}
        self.masters: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        from safetensors.torch import save_model

        if trainer.global_step != 2:
            return
        state = module.model.state_dict()
        self.seen = {n: (t.dtype, t.untyped_storage().nbytes(), t.numel() * t.element_size()) for n, t in state.items()}
        save_model(module.model, str(self.directory / "mid.safetensors"))
        module.model.save_pretrained(self.directory / "mid")
        plugin = trainer.precision_plugin
        self.masters = {n: plugin.master_of(p).detach().clone() for n, p in module.model.named_parameters()}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_state_dict_has_a_storage_per_tensor_during_and_after_fit(tmp_path: Path, precision: str) -> None:
    """The half weights may lie in one flat buffer (bf16's default), yet ``model.state_dict()`` holds each tensor in
    a storage of its own, of its own size, during fit and after: ``safetensors``' ``save_model`` (which refuses
    tensors that share memory unless they are the same tensor) and ``save_pretrained`` save it as it is."""
    from safetensors.torch import load_file, save_model

    module = LanguageModel()
    save = SaveStateDict(tmp_path)
    quiet_trainer(max_steps=3, plugins=[MPTPrecision(precision)], callbacks=[save]).fit(module, token_data(vocab=16))
    assert save.seen
    assert all(held == own for _, held, own in save.seen.values()), save.seen
    assert {dtype for dtype, _, _ in save.seen.values()} == {torch.float32}  # the masters, as a checkpoint has them
    mid = load_file(str(tmp_path / "mid.safetensors"))
    for name, master in save.masters.items():
        if name in mid:  # a tied weight is saved once, under one of its names
            assert torch.equal(mid[name], master), name
    assert_reloads_the_masters(tmp_path / "mid", save.masters)
    after = module.model.state_dict()  # after fit: the module's own fp32 tensors again
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in after.values())
    save_model(module.model, str(tmp_path / "after.safetensors"))
    final = load_file(str(tmp_path / "after.safetensors"))
    assert all(torch.equal(final[n], after[n]) for n in final)
    module.model.save_pretrained(tmp_path / "after")
    assert_reloads_the_masters(tmp_path / "after", {n: p.detach() for n, p in module.model.named_parameters()})
