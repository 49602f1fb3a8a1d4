"""fp8 compute through torchao (emulated on CPU): the conversion before the masters, the cast statistics against
hand-computed values and torchao's own cast, training close to bf16, exact resume, DDP, Fabric and the report."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger
from lightning.pytorch.loggers import TensorBoardLogger
from models import TinyMLP, quiet_trainer, regression_data
from tb_events import read_events
from torch import nn

from lightning_mpt import Fp8Options, MPTPrecision
from lightning_mpt.callbacks import Float8Monitor
from lightning_mpt.diagnostics.fp8 import cast_counts, role_values, saturation_bound, tensorwise_scale
from lightning_mpt.report import build_report, format_text

float8 = pytest.importorskip("torchao.float8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from fp8_transformer import TinyGPT, copy_task  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def all_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    ea = read_events(log_dir)
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def fp8(**kwargs) -> MPTPrecision:
    return MPTPrecision("bf16", fp8=kwargs.pop("recipe", True), fp8_emulate=True, **kwargs)


# ------------------------------------------------------------------------------------------ the cast statistics
def test_cast_counts_against_hand_computed_values():
    # scale 1: 470 is beyond 464 (half-way from 448 to the next e4m3 value, 480), inf is non-finite: both saturate;
    # 2**-10 (a tie, rounds to even: 0) and 2**-11 are below half of e4m3's min subnormal 2**-9: flushed;
    # 2**-8 is subnormal (min normal 2**-6); 448, 1 and 2**-6 are normal
    x = torch.tensor([470.0, 448.0, 1.0, 2**-10, 2**-11, 2**-8, 2**-6, 0.0, math.inf])
    assert cast_counts(x, E4M3, torch.tensor(1.0)).tolist() == [2, 2, 1, 7, 9]
    # a scale moves the same values: times 2**-4, 2**-6 becomes 2**-10 (flushed) and 1 becomes 2**-4 (normal)
    assert cast_counts(torch.tensor([1.0, 2**-6]), E4M3, torch.tensor(2.0**-4)).tolist() == [0, 1, 0, 2, 2]
    # e5m2: max 57344, next 61440 would be 65536; min subnormal 2**-16
    assert saturation_bound(E4M3) == 464.0
    assert saturation_bound(E5M2) == 61440.0
    y = torch.tensor([61440.0, 61000.0, 2**-17, 2**-16, 2**-15])
    assert cast_counts(y, E5M2, torch.tensor(1.0)).tolist() == [1, 1, 2, 5, 5]


def test_scale_and_fractions_match_torchao_cast():
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 32, generator=g) * 1e-3).to(torch.bfloat16)
    x[3, 5] = 1e3  # an outlier sets the scale: most values flush
    scale = tensorwise_scale(x, E4M3)
    assert scale.item() == pytest.approx(448 / 1e3, rel=1e-2)
    cast = hp_tensor_to_float8_dynamic(x, E4M3, LinearMMConfig())
    assert torch.equal(cast._scale.reshape(()), scale)
    flushed_by_torchao = ((cast._data.float() == 0) & (x != 0)).sum().item()
    counts = cast_counts(x, E4M3, scale).tolist()
    assert counts[1] == flushed_by_torchao > 1000
    # rowwise: one scale per row, reported as the smallest; the outlier's row alone flushes
    config = float8.Float8LinearConfig.from_recipe_name("rowwise").cast_config_input
    values = role_values(x, config, power_of_2=True).tolist()
    assert values[0] == pytest.approx(1e3, rel=1e-2)
    assert values[1] == 0.25
    assert 0 < values[3] < 32  # at most the outlier row's other 31 values


# ------------------------------------------------------------------------------------------------- the plugin
def test_conversion_before_masters_filter_and_checkpoint_keys(tmp_path):
    model = TinyMLP(d_in=16, hidden=32, d_out=4)  # net.3 is 32 -> 4: not a multiple of 16, stays bf16
    plugin = fp8()
    seen = {}

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen["types"] = {n: type(m).__name__ for n, m in pl_module.net.named_children()}
            seen["dtype"] = pl_module.net[0].weight.dtype
            seen["master"] = plugin.master_of(pl_module.net[0].weight).clone()

    trainer = quiet_trainer(plugins=[plugin], max_steps=2, callbacks=[Look()])
    trainer.fit(model, regression_data(d_in=16, d_out=4))
    assert seen["types"]["0"] == "Float8Linear"
    assert seen["types"]["3"] == "Linear"
    assert seen["dtype"] == torch.bfloat16
    assert seen["master"].dtype == torch.float32
    assert not torch.equal(seen["master"], seen["master"].bfloat16().float())  # stepped in fp32, not a bf16 value
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["state_dict"]
    assert list(state) == list(TinyMLP(d_in=16, hidden=32, d_out=4).state_dict())  # the original keys
    assert state["net.0.weight"].dtype == torch.float32
    assert torch.equal(state["net.0.weight"], seen["master"])

    kept = fp8(fp8_filter=lambda module, fqn: fqn != "net.0")
    model = TinyMLP(d_in=16, hidden=32, d_out=16)
    quiet_trainer(plugins=[kept], max_steps=1).fit(model, regression_data(d_in=16, d_out=16))
    assert [type(m).__name__ for m in (model.net[0], model.net[3])] == ["Linear", "Float8Linear"]
    # the same options in one object
    grouped = MPTPrecision("bf16", fp8=Fp8Options(filter=lambda module, fqn: fqn != "net.0", emulate=True))
    model = TinyMLP(d_in=16, hidden=32, d_out=16)
    quiet_trainer(plugins=[grouped], max_steps=1).fit(model, regression_data(d_in=16, d_out=16))
    assert [type(m).__name__ for m in (model.net[0], model.net[3])] == ["Linear", "Float8Linear"]


def test_bad_inputs_say_what_is_accepted(monkeypatch):
    with pytest.raises(ValueError, match="'bf16' only"):
        MPTPrecision("fp16", fp8=True)
    with pytest.raises(ValueError, match="unknown recipe; accepted: True .*'rowwise_with_gw_hp'"):
        MPTPrecision("bf16", fp8="blockwise")
    with pytest.raises(TypeError, match="Float8LinearConfig"):
        MPTPrecision("bf16", fp8=8)
    with pytest.raises(TypeError, match="fp8_filter=.*expected None or a function"):
        MPTPrecision("bf16", fp8=True, fp8_filter="net.0")
    with pytest.raises(ValueError, match="fp8 compute, which is off"):
        MPTPrecision("bf16", fp8_emulate=True)
    with pytest.raises(ValueError, match=r"fp8_emulate=...\): give these options once, in Fp8Options"):
        MPTPrecision("bf16", fp8=Fp8Options(), fp8_emulate=True)
    with pytest.raises(ValueError, match="unknown recipe"):
        MPTPrecision("bf16", fp8=Fp8Options("blockwise"))
    with pytest.raises(RuntimeError, match="cpu device has no fp8 Tensor Cores.*fp8_emulate=True"):
        quiet_trainer(plugins=[MPTPrecision("bf16", fp8="rowwise")], max_steps=1).fit(
            TinyMLP(d_in=16, hidden=32, d_out=16), regression_data(d_in=16, d_out=16)
        )
    assert MPTPrecision("bf16", fp8=float8.Float8LinearConfig(emulate=True)).fp8_config.emulate
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
    with pytest.raises(ImportError, match=r"pip install 'lightning-mpt\[fp8\]'"):
        MPTPrecision("bf16", fp8=True)


def test_import_does_not_load_torchao():
    import subprocess

    code = "import sys, lightning_mpt, lightning_mpt.fabric; print('torchao' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_no_eligible_layer_trains_and_the_monitor_says_so():
    model = TinyMLP(d_in=10, hidden=24, d_out=3)
    with pytest.warns(UserWarning, match="no fp8 .*Float8Linear. layers"):
        quiet_trainer(plugins=[fp8()], max_steps=1, callbacks=[Float8Monitor()], logger=TensorBoardLogger("/tmp")).fit(
            model, regression_data(d_in=10, d_out=3)
        )
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())


# ------------------------------------------------------------------------------------------------- training
def _fit_gpt(plugin, steps, **kwargs):
    torch.manual_seed(0)
    model = TinyGPT()
    trainer = quiet_trainer(plugins=[plugin], max_steps=steps, **kwargs)
    trainer.fit(model, copy_task(n=48))
    return model, trainer


def test_tiny_transformer_trains_close_to_bf16():
    bf16, _ = _fit_gpt(MPTPrecision("bf16"), 24)
    fp8_model, _ = _fit_gpt(fp8(), 24)
    assert len(fp8_model.losses) == len(bf16.losses) == 24
    assert fp8_model.losses[-1] < 0.8 * fp8_model.losses[0]  # it learns
    # fp8's quantisation error (3 mantissa bits in the forward) is a few percent of the loss at this size
    for a, b in zip(fp8_model.losses, bf16.losses):
        assert abs(a - b) <= 0.05 * b


@pytest.mark.parametrize(
    "storage", [{}, {"master_remainders": True, "chunked_step": 512}], ids=["copies", "remainders"]
)
def test_resume_is_bitwise(tmp_path, storage):
    # the resumed run executes the same operations in the same order as the uninterrupted one (one batch per epoch:
    # the same batch at every step, whatever the loader's position), the emulated fp8 casts are deterministic
    # functions of the bf16 weights and inputs, and the checkpoint holds the exact fp32 masters and Adam state: so
    # bitwise equality is what to expect, not closeness
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = copy_task(n=16)

    def run(steps, callbacks=(), ckpt=None):
        torch.manual_seed(0)
        model = TinyGPT()
        trainer = quiet_trainer(
            plugins=[fp8(**storage)], max_steps=steps, callbacks=list(callbacks), enable_checkpointing=bool(callbacks)
        )
        trainer.fit(model, data, ckpt_path=ckpt)
        return model

    saver = ModelCheckpoint(tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    whole = run(6, [saver])
    resumed = run(6, ckpt=tmp_path / "step=3.ckpt")
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert whole.losses[3:] == resumed.losses
    assert len(resumed.losses) == 3


# ------------------------------------------------------------------------------------------ diagnostics, report
def test_an_outlier_layer_is_named_in_tags_report_and_advice(tmp_path, capsys):
    monitor = Float8Monitor(every_n_steps=2)
    logger = TensorBoardLogger(tmp_path, name="", version="run")
    torch.manual_seed(0)
    model = TinyGPT(outlier=1e4)
    trainer = quiet_trainer(plugins=[fp8()], max_steps=4, callbacks=[monitor], logger=logger)
    trainer.fit(model, copy_task(n=48))
    scalars = all_scalars(tmp_path / "run")
    flush = scalars["mpt/fp8/flush_fraction/blocks.0.fc1/input"]
    assert [s for s, _ in flush] == [0, 2]
    assert all(v > 0.01 for _, v in flush)
    assert all(v == 0 for _, v in scalars["mpt/fp8/flush_fraction/blocks.0.qkv/input"])
    assert {s for s, _ in scalars["mpt/fp8/scale/head/grad_output"]} == {0, 2}
    report = build_report(tmp_path)
    rows = report.runs[0].fp8
    assert (rows[0].layer, rows[0].role) == ("blocks.0.fc1", "input")
    advice = [a for a in report.runs[0].advice if a.rule == "fp8_keep_bf16"]
    named = advice[0].numbers["layers"]
    assert "blocks.0.fc1" in named
    assert not {"blocks.0.qkv", "blocks.0.proj", "head"} & set(named)
    assert "fp8_filter=lambda module, fqn: fqn not in {'blocks.0.fc1'" in advice[0].text
    assert "blocks.0.fc1/input" in format_text(report)


def test_fabric_logger_writes_fp8_tags_with_one_sync_per_step(tmp_path):
    from lightning_mpt.fabric import MixedPrecisionLogger
    from lightning_mpt.fabric import MPTPrecision as FabricMPT

    plugin = FabricMPT("bf16", fp8="tensorwise", fp8_emulate=True)
    fabric = L.Fabric(accelerator="cpu", plugins=[plugin], loggers=FabricTensorBoardLogger(tmp_path, name="f"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    diagnostics = MixedPrecisionLogger(fabric, model, every_n_steps=2, histograms_every_n_steps=0)
    for _ in range(4):
        x = torch.randn(8, 16)
        fabric.backward(model(x).float().pow(2).mean())
        diagnostics.after_backward()
        diagnostics.step(optimizer)
        optimizer.zero_grad()
    diagnostics.finalize()
    assert diagnostics.recorder.syncs == 2  # one host read per logging step (0 and 2), the fp8 statistics included
    assert type(model.module[0]).__name__ == "Float8Linear"
    assert plugin.master_of(model.module[0].weight).dtype == torch.float32
    plugin.restore()
    scalars = all_scalars(next((tmp_path / "f").iterdir()))
    assert [s for s, _ in scalars["mpt/fp8/amax/0/weight"]] == [0, 2]
    assert "mpt/fp8/flush_fraction/2/grad_output" in scalars
