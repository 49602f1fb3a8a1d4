"""Checkpoints hold the fp32 masters and the plugin's state; resuming continues exactly; a killed run resumes;
evaluation after fit runs under the plugin and on the masters."""

import csv
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import InjectInf, SmallCNN, TinyMLP, classification_images, quiet_trainer, regression_data

from lightning_mpt import DynamicLossScaler, MPTPrecision

HERE = Path(__file__).parent


class SaveMasters(L.Callback):
    """Clones the masters when a checkpoint is saved, to compare with what the file holds."""

    def __init__(self) -> None:
        self.at_save: dict[str, torch.Tensor] = {}

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self.at_save = {name: m.detach().clone() for name, _, m in trainer.precision_plugin.named_masters()}


def test_checkpoint_state_dict_holds_the_fp32_masters_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN()
    grab = SaveMasters()
    plugin = MPTPrecision("fp16", scaler=512.0)
    trainer = quiet_trainer(max_steps=3, plugins=[plugin], callbacks=[grab])
    trainer.fit(model, classification_images())
    trainer.save_checkpoint(tmp_path / "end.ckpt")  # after fit: masters are the module's weights
    ckpt_mid = tmp_path / "mid.ckpt"

    class SaveMid(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            if trainer.global_step == 2:
                trainer.save_checkpoint(ckpt_mid)

    torch.manual_seed(0)
    model = SmallCNN()
    quiet_trainer(max_steps=3, plugins=[MPTPrecision("fp16", scaler=512.0)], callbacks=[grab, SaveMid()]).fit(
        model, classification_images()
    )
    saved = torch.load(ckpt_mid, weights_only=False)
    assert grab.at_save.keys() == {"features.0.weight", "features.0.bias", "head.weight", "head.bias"}
    for name, master in grab.at_save.items():
        assert saved["state_dict"][name].dtype == torch.float32
        assert torch.equal(saved["state_dict"][name], master)
        assert not torch.equal(master, master.half().float())  # a real fp32 value, not a rounded half one
    # norm layers and buffers are fp32 too
    assert all(v.dtype == torch.float32 for k, v in saved["state_dict"].items() if v.is_floating_point())
    assert saved["MPTPrecision"]["scaler"]["scale"] == 512.0
    # a plain fp32 module, no plugin, loads it with no loss
    plain = SmallCNN()
    plain.load_state_dict(saved["state_dict"])
    for name, master in grab.at_save.items():
        assert torch.equal(plain.state_dict()[name], master)
    assert torch.equal(SmallCNN.load_from_checkpoint(ckpt_mid).head.weight, grab.at_save["head.weight"])


def test_weights_only_checkpoint_holds_masters(tmp_path):
    torch.manual_seed(0)
    grab = SaveMasters()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_weights_only=True, every_n_train_steps=2, save_top_k=-1)
    trainer = quiet_trainer(
        max_steps=2, plugins=[MPTPrecision("bf16")], callbacks=[grab, ckpt], enable_checkpointing=True
    )
    trainer.fit(TinyMLP(), regression_data())
    (path,) = tmp_path.glob("*.ckpt")
    saved = torch.load(path, weights_only=False)
    assert "MPTPrecision" not in saved  # weights only
    for name, master in grab.at_save.items():
        assert torch.equal(saved["state_dict"][name], master)


# ---------------------------------------------------------------------------------------------------- exact resume


def make_plugin() -> MPTPrecision:
    return MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2))


def run(
    tmp_path: Path, epochs: int, ckpt_path=None, inject=frozenset({1, 4, 5})
) -> tuple[L.Trainer, TinyMLP, MPTPrecision]:
    torch.manual_seed(0)
    model = TinyMLP(lr=1e-2)
    plugin = make_plugin()
    trainer = quiet_trainer(
        max_epochs=epochs,
        plugins=[plugin],
        callbacks=[InjectInf("net.0.weight", steps=set(inject))],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, regression_data(n=96), ckpt_path=ckpt_path)  # 6 steps per epoch
    return trainer, model, plugin


def plugin_state(plugin: MPTPrecision) -> tuple:
    s = plugin.scaler
    return (plugin.loss_scale, plugin.skipped_steps, s.growth_tracker, s.hysteresis_tracker, plugin.state_dict())


@pytest.mark.parametrize(
    ("inject", "what"),
    [({1, 5}, "right after a skipped step, hysteresis pending"), ({1, 3}, "in the middle of a growth interval")],
)
def test_resume_is_bitwise_identical_to_the_uninterrupted_run(tmp_path, inject, what):
    straight_trainer, straight, straight_plugin = run(tmp_path / "straight", epochs=2, inject=inject)

    first_trainer, _, first_plugin = run(tmp_path / "first", epochs=1, inject=inject)
    ckpt = tmp_path / "first.ckpt"
    first_trainer.save_checkpoint(ckpt)
    s = first_plugin.scaler
    if 5 in inject:
        assert first_plugin.last_step_skipped
        assert s.hysteresis_tracker == 1
    else:
        assert 0 < s.growth_tracker < s.growth_interval

    resumed_trainer, resumed, resumed_plugin = run(tmp_path / "resumed", epochs=2, ckpt_path=ckpt, inject=inject)
    assert resumed_trainer.global_step == straight_trainer.global_step == 12
    for (n, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
    opt_a, opt_b = straight_trainer.optimizers[0].state_dict(), resumed_trainer.optimizers[0].state_dict()
    for k in opt_a["state"]:
        for name, v in opt_a["state"][k].items():
            assert torch.equal(v, opt_b["state"][k][name]), (k, name)
    assert plugin_state(straight_plugin) == plugin_state(resumed_plugin)


# ---------------------------------------------------------------------------------------------------- SIGKILL

KILL_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import TinyMLP, regression_data, quiet_trainer
from lightning_mpt import MPTPrecision

class Slow(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 7 and {slow}:  # ModelCheckpoint (run last) saved step 6
            print("READY", flush=True)
            time.sleep(60)   # the test kills us here

torch.manual_seed(0)
ckpt = ModelCheckpoint(dirpath={ckpt_dir!r}, save_last=True, every_n_train_steps=2)
trainer = quiet_trainer(max_steps=12, plugins=[MPTPrecision("fp16")], callbacks=[ckpt, Slow()],
                        enable_checkpointing=True, logger=L.pytorch.loggers.CSVLogger({log_dir!r}), log_every_n_steps=1)
last = {ckpt_dir!r} + "/last.ckpt"
import os
trainer.fit(TinyMLP(), regression_data(n=400), ckpt_path=last if os.path.exists(last) else None)
print("DONE", trainer.global_step, trainer.precision_plugin.loss_scale, flush=True)
"""


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_last_checkpoint(tmp_path):
    ckpt_dir, log_dir = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(KILL_SCRIPT.format(tests=str(HERE), ckpt_dir=ckpt_dir, log_dir=log_dir, slow=True))
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(120, proc.kill)  # a child that hangs before READY is killed; one that dies ends the read
    watchdog.start()
    try:
        ready = any("READY" in line for line in proc.stdout)
    finally:
        watchdog.cancel()
    assert ready, "the training child exited (or hung) before its checkpoint at step 6"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    last = torch.load(Path(ckpt_dir) / "last.ckpt", weights_only=False)  # readable, not corrupted
    assert last["global_step"] == 6
    assert last["MPTPrecision"]["scaler"]["scale"] > 0
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in last["state_dict"].values())

    script.write_text(
        textwrap.dedent(KILL_SCRIPT.format(tests=str(HERE), ckpt_dir=ckpt_dir, log_dir=log_dir, slow=False))
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DONE 12" in out.stdout
    final = torch.load(Path(ckpt_dir) / "last.ckpt", weights_only=False)
    assert final["global_step"] == 12
    # nothing is corrupted: every checkpoint loads, every metrics file is well-formed CSV
    for path in Path(ckpt_dir).glob("*.ckpt"):
        assert torch.load(path, weights_only=False)["global_step"] in (2, 4, 6, 8, 10, 12)
    metrics = sorted(Path(log_dir).rglob("metrics.csv"))
    assert metrics
    for path in metrics:
        rows = list(csv.DictReader(path.open()))
        assert rows
        assert all(len(r) == len(rows[0]) and None not in r for r in rows)


# ---------------------------------------------------------------------------------------------------- evaluation


class EvalModel(TinyMLP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.eval_dtypes: list[tuple[str, torch.dtype, torch.dtype]] = []

    def _record(self, stage, batch):
        out = self(batch[0])
        self.eval_dtypes.append((stage, self.net[0].weight.dtype, out.dtype))
        return out

    def validation_step(self, batch, batch_idx):
        out = self._record("val", batch)
        self.log("val_loss", torch.nn.functional.mse_loss(out.float(), batch[1]))

    def test_step(self, batch, batch_idx):
        out = self._record("test", batch)
        self.log("test_loss", torch.nn.functional.mse_loss(out.float(), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self._record("predict", batch)


def test_validate_test_predict_after_fit_run_under_the_plugin_on_the_masters(tmp_path):
    torch.manual_seed(0)
    model = EvalModel()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1)
    plugin = MPTPrecision("bf16")
    trainer = quiet_trainer(max_epochs=3, plugins=[plugin], callbacks=[ckpt], enable_checkpointing=True)
    data = regression_data(n=64)
    trainer.fit(model, data, data)
    model.eval_dtypes.clear()
    trainer.validate(model, data)
    trainer.test(model, data)
    preds = trainer.predict(model, data)
    stages = {s for s, _, _ in model.eval_dtypes}
    assert stages == {"val", "test", "predict"}
    assert {(w, o) for _, w, o in model.eval_dtypes} == {(torch.bfloat16, torch.bfloat16)}  # half weights, autocast
    assert preds[0].dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 again after each stage

    # test(ckpt_path="best") evaluates the fp32 masters saved in the best checkpoint
    best = torch.load(ckpt.best_model_path, weights_only=False)["state_dict"]
    model.eval_dtypes.clear()
    result = trainer.test(model, data, ckpt_path="best")[0]
    reference = EvalModel()
    reference.load_state_dict(best)
    for name, value in best.items():
        assert torch.equal(model.state_dict()[name], value)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = sum(torch.nn.functional.mse_loss(reference(x.bfloat16()).float(), y) * len(x) for x, y in data) / 64
    assert result["test_loss"] == pytest.approx(expected.item(), rel=2e-2)
    # and the module works as a plain fp32 model
    x, _ = next(iter(data))
    assert model(x).dtype == torch.float32


class Loud(TinyMLP):
    """Its loss is multiplied by 2**12: at the default scale of 2**16 its gradients overflow fp16."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 2.0**12


def test_a_16_mixed_checkpoint_resumes_at_its_gradscalers_scale(tmp_path, caplog):
    """A run of Lightning's "16-mixed" (a real GradScaler on CPU: ``MixedPrecision("16-mixed", "cpu")``) resumed under
    ``MPTPrecision("fp16")``: the checkpoint holds GradScaler's state under "MixedPrecision" and none of the plugin's.
    Its scale and growth tracker are taken over, so the resumed run goes on where the scale had got to and skips
    nothing, rather than starting again at 2**16 and backing off for as many steps as the first run did."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    amp = MixedPrecision("16-mixed", "cpu")
    torch.manual_seed(0)
    trainer = quiet_trainer(max_steps=16, plugins=[amp])
    trainer.fit(Loud(), regression_data(n=256, batch_size=16))
    saved = amp.scaler.state_dict()
    assert saved["scale"] < 2.0**16  # it backed off
    assert saved["_growth_tracker"] > 0  # then stepped at that scale
    trainer.save_checkpoint(tmp_path / "amp.ckpt")

    plugin = MPTPrecision("fp16")
    torch.manual_seed(0)
    with caplog.at_level("INFO"):
        quiet_trainer(max_steps=32, plugins=[plugin]).fit(
            Loud(), regression_data(n=256, batch_size=16), ckpt_path=tmp_path / "amp.ckpt"
        )
    assert len(plugin.history) == 16
    assert plugin.history[0].scale == saved["scale"]
    assert plugin.skipped_steps == 0
    assert plugin.scaler.growth_tracker == saved["_growth_tracker"] + 16  # the clean steps counted on
    said = "took over the loss scale of the checkpoint's torch.amp.GradScaler (Lightning's '16-mixed'): scale"
    assert f"{said} {saved['scale']:g}, " in caplog.text
    # a static scale has nothing to take over: it says so
    static = MPTPrecision("fp16", scaler=8.0)
    refused = rf"GradScaler .* at scale {saved['scale']:g}; this plugin has a static scale, so it is not taken over"
    with pytest.warns(UserWarning, match=refused):
        quiet_trainer(max_steps=17, plugins=[static]).fit(
            Loud(), regression_data(n=256, batch_size=16), ckpt_path=tmp_path / "amp.ckpt"
        )
    assert static.loss_scale == 8.0


def _f51cb33() -> Any:
    """tests/data/make_f51cb33_checkpoint.py, which wrote the checkpoint (its module and data)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_f51cb33_checkpoint", HERE / "data" / "make_f51cb33_checkpoint.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_checkpoint_written_by_f51cb33_resumes_under_todays_default():
    """``tests/data/f51cb33_bf16.ckpt`` was written by commit f51cb33's ``MPTPrecision("bf16")`` (4-byte masters, the
    whole step) after 4 steps. Today's default (16-bit remainders, a chunked step) resumes it: the masters are the
    checkpoint's fp32 values exactly, the optimizer's state and the counters carry on, and the next steps are those of
    the same checkpoint resumed with 4-byte masters, except where a master lands on a tie (rounded away from zero)."""
    made = _f51cb33()
    path = HERE / "data" / "f51cb33_bf16.ckpt"
    saved = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]

    class AtStart(L.Callback):
        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            plugin = trainer.precision_plugin
            self.masters = {n: plugin.master_of(p).detach().clone() for n, p in module.named_parameters()}
            self.steps = {float(s["step"]) for s in trainer.optimizers[0].state.values()}

    def resume(**options: Any) -> tuple[MPTPrecision, AtStart, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        plugin, start, model = MPTPrecision("bf16", **options), AtStart(), made.Net()
        quiet_trainer(max_steps=8, plugins=[plugin], callbacks=[start]).fit(model, made.data(), ckpt_path=str(path))
        return plugin, start, {n: plugin.master_of(p).detach().clone() for n, p in model.named_parameters()}

    plugin, start, masters = resume()
    assert plugin.master_remainders
    assert plugin.chunked_step
    assert all(torch.equal(start.masters[n], saved[n]) for n in saved), "the checkpoint's masters, exactly"
    assert start.steps == {4.0}  # AdamW's state, loaded into the masters' state
    assert plugin.last_step is not None
    assert plugin.last_step.step == 7
    assert plugin.skipped_steps == 0
    _, _, whole = resume(master_remainders=False, chunked_step=False)
    differ = sum(int((masters[n] != whole[n]).sum()) for n in masters)
    assert differ <= 2, differ  # 4 steps of 321 masters: a tie (1 in 131,072 per value and step) is unlikely
    for n in masters:
        assert torch.allclose(masters[n], whole[n], rtol=2**-6, atol=0), n
