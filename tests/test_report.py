"""``lightning-mpt report`` on real runs: its numbers against the plugin's history and the event files."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from models import InjectInf, TinyMLP, quiet_trainer, regression_data
from tb_events import read_events, series, texts, write_record
from torch.utils.tensorboard import SummaryWriter

from lightning_mpt import DynamicLossScaler, MPTPrecision, NonFiniteGradientError
from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor
from lightning_mpt.cli import main
from lightning_mpt.core.numerics import BF16, FP16, FloatFormat, exponent_bins, exponent_histograms
from lightning_mpt.report import ExponentHistogram, build_report, format_text
from lightning_mpt.report.plots import write_plots

STEPS = 10
HIST_EVERY = 3  # exponent histograms at steps 0, 3, 6, 9: the last one is an overflow step
INJECTED = {"net.3.weight": {2, 5}, "net.0.bias": {9}}  # skipped steps 2, 5, 9


class ExponentProbe(L.Callback):
    """The exponent histogram of the stored half gradients (after the injections), summed over parameters, at
    ``step``: what the report must decode from ``mpt/grad_exponent/*``."""

    def __init__(self, step: int, fmt: FloatFormat = FP16) -> None:
        self.step, self.fmt = step, fmt
        self.counts: dict[str, int] = {}

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_step == self.step:
            grads = [p.grad for p in module.parameters() if p.dtype == self.fmt.dtype]
            totals = exponent_histograms(grads, self.fmt).sum(0).tolist()
            self.counts = dict(zip(exponent_bins(self.fmt), totals))

    def assert_decoded(self, h: Optional[ExponentHistogram]) -> None:
        assert h is not None
        assert h.step == self.step
        assert h.format == self.fmt.name
        assert (h.zero, h.nonfinite) == (self.counts["zero"], self.counts["nonfinite"])
        assert h.counts == {int(k): v for k, v in self.counts.items() if k not in ("zero", "nonfinite") and v}


class TinyGradients(TinyMLP):
    """Its loss (and so every gradient) times 2^-18: without loss scaling, fp16 flushes a share of the gradients."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * 2.0**-18


@dataclass
class Runs:
    root: Path
    plugin: MPTPrecision  # run a
    scale_monitor: LossScaleMonitor  # run a
    probe: ExponentProbe  # run a


def train(root: Path, name: str, model: L.LightningModule, plugin: MPTPrecision, callbacks: list) -> LossScaleMonitor:
    monitors = [
        LossScaleMonitor(),
        GradientHistogramMonitor(every_n_steps=HIST_EVERY),
        UnderflowMonitor(every_n_steps=1, reference_every_n_steps=2),
    ]
    logger = TensorBoardLogger(str(root), name=name, version=0)
    trainer = quiet_trainer(plugins=[plugin], callbacks=[*callbacks, *monitors], logger=logger, max_steps=STEPS)
    trainer.fit(model, regression_data(n=16 * STEPS))
    return monitors[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Two real runs under one log directory: ``a`` (dynamic scale, injected overflows) and ``b`` (no scaling)."""
    root = tmp_path_factory.mktemp("logs")
    torch.manual_seed(0)
    probe = ExponentProbe(step=9)
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=2))
    injections = [InjectInf(name, steps=steps) for name, steps in INJECTED.items()]
    monitor = train(root, "a", TinyMLP(), plugin, [*injections, probe])
    train(root, "b", TinyGradients(), MPTPrecision("fp16", scaler=1.0), [])
    return Runs(root, plugin, monitor, probe)


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    return series(read_events(log_dir), tag)


def png_size(path: Path) -> tuple[int, int]:
    """Check that ``path`` is a whole PNG (signature, chunk CRCs, IHDR first, IEND last, image data that inflates);
    return its width and height."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, kinds, idat = 8, [], b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in {kind!r}"
        kinds.append(kind)
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    assert kinds[0] == b"IHDR"
    assert kinds[-1] == b"IEND"
    width, height = struct.unpack(">II", data[16:24])
    assert len(zlib.decompress(idat)) > height  # one filter byte per row at least
    return width, height


# ------------------------------------------------------------------------------------------- the numbers
def test_steps_logged_again_by_a_resumed_run_count_once(tmp_path: Path) -> None:
    """A run resumed from its step-4 checkpoint into its own log directory logs steps 4 and 5 again: each counts
    once, with the resumed run's value."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(max_steps: int, ckpt_path: Optional[Path], callbacks: list) -> None:
        logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
        monitors = [LossScaleMonitor(), *callbacks]
        trainer = quiet_trainer(
            plugins=[MPTPrecision("fp16")],
            logger=logger,
            max_steps=max_steps,
            callbacks=monitors,
            enable_checkpointing=True,
        )
        trainer.fit(TinyMLP(), regression_data(n=160), ckpt_path=ckpt_path)

    torch.manual_seed(0)
    fit(6, None, [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)])
    fit(8, tmp_path / "ckpt" / "epoch=0-step=4.ckpt", [])
    (summary,) = build_report(tmp_path).runs
    assert summary.steps == 8
    assert summary.scale is not None
    assert summary.scale.points == 8


@pytest.mark.parametrize(
    ("trained", "monitors"),
    [
        (10, lambda: [LossScaleMonitor(every_n_steps=4)]),  # logs steps 0, 4, 8: the last step logged is not the last
        (0, lambda: [LossScaleMonitor(), GradientHistogramMonitor()]),  # the format marks are written at step 0
    ],
)
def test_the_step_count_is_the_steps_trained(tmp_path: Path, trained: int, monitors: Any) -> None:
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    limit = {"limit_train_batches": 0} if trained == 0 else {}
    trainer = quiet_trainer(plugins=[MPTPrecision("fp16")], callbacks=monitors(), logger=logger, max_steps=10, **limit)
    trainer.fit(TinyMLP(), regression_data(n=160))
    assert trainer.global_step == trained
    (summary,) = build_report(tmp_path).runs
    assert summary.steps == trained


@pytest.mark.parametrize("front", ["trainer", "fabric"])
def test_a_bf16_mixed_run_counts_the_steps_trained(tmp_path: Path, front: str) -> None:
    """Lightning's own "bf16-mixed" has no loss scale to log: the statistics logged every 4 steps end at step 8 of
    10, and the end-of-training record says 10."""
    steps = 10
    if front == "trainer":
        monitors = [LossScaleMonitor(), UnderflowMonitor(every_n_steps=4)]
        logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
        trainer = quiet_trainer(precision="bf16-mixed", callbacks=monitors, logger=logger, max_steps=steps)
        with pytest.warns(UserWarning, match="no loss scaler"):
            trainer.fit(TinyMLP(), regression_data(n=16 * steps))
        assert trainer.global_step == steps
    else:
        from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger

        from lightning_mpt.fabric import MixedPrecisionLogger

        fabric = L.Fabric(
            accelerator="cpu",
            devices=1,
            precision="bf16-mixed",
            loggers=FabricTensorBoardLogger(str(tmp_path), name="run", version=0),
        )
        net = TinyMLP().net
        model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        diagnostics = MixedPrecisionLogger(fabric, model, every_n_steps=4, histograms_every_n_steps=0)
        for x, y in regression_data(n=16 * steps):
            fabric.backward(torch.nn.functional.mse_loss(model(x).float(), y))
            diagnostics.after_backward()
            diagnostics.step(optimizer)
            optimizer.zero_grad()
        diagnostics.finalize()
    (summary,) = build_report(tmp_path).runs
    assert summary.steps == steps
    assert (summary.skipped_steps, summary.format) == (0, "bf16")


def test_summary_equals_plugin_history(runs: Runs) -> None:
    (s,) = build_report(runs.root / "a" / "version_0").runs
    history = list(runs.plugin.history)
    scales = [r.scale for r in history]
    assert s.run == "."
    assert s.format == "fp16"
    assert s.steps == len(history) == STEPS
    assert s.skipped_steps == runs.plugin.skipped_steps == sum(r.skipped for r in history) == 3
    assert s.skipped_share == 3 / STEPS
    assert s.first_overflow_step == next(r.step for r in history if r.skipped) == 2
    assert s.scale is not None
    assert s.scale.points == STEPS
    assert (s.scale.min, s.scale.median, s.scale.max, s.scale.last) == (
        min(scales),
        statistics.median(scales),
        max(scales),
        scales[-1],
    )
    assert s.nonfinite_params == dict(runs.scale_monitor.overflow_counts) == {"net.3.weight": 2, "net.0.bias": 1}
    assert list(s.nonfinite_params) == ["net.3.weight", "net.0.bias"]  # most often first
    assert s.nonfinite_names_complete
    assert s.loss_nonfinite_steps == 0
    assert s.stopped is None


def test_underflow_numbers_equal_event_files(runs: Runs) -> None:
    log_dir = runs.root / "a" / "version_0"
    (s,) = build_report(log_dir).runs
    assert s.underflow_tag == "mpt/grad_underflow_fraction"  # the fp32 reference ran
    half = ["net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"]
    assert sorted(r.name for r in s.worst_underflow) == sorted(half)
    for ranked in s.worst_underflow:
        values = [v for _, v in scalars(log_dir, f"mpt/grad_underflow_fraction/{ranked.name}")]
        assert ranked.stats.points == len(values) == STEPS // 2  # reference every 2 steps
        assert ranked.stats.mean == statistics.fmean(values)
        assert ranked.stats.max == max(values)
    update = scalars(log_dir, "mpt/update_underflow_fraction")
    assert [step for step, _ in update] == [0, 1, 3, 4, 6, 7, 8]  # clean steps only
    assert s.update_underflow is not None
    assert (s.update_underflow.mean, s.update_underflow.last) == (statistics.fmean(v for _, v in update), update[-1][1])
    means = [r.stats.mean for r in s.worst_update_underflow]
    assert means == sorted(means, reverse=True)
    assert len(means) == len(half)


def test_flush_ranks_the_layers_of_an_unscaled_run(runs: Runs) -> None:
    log_dir = runs.root / "b" / "version_0"
    (s,) = build_report(log_dir).runs
    assert s.skipped_steps == 0
    assert s.first_overflow_step is None
    assert s.scale is not None
    assert (s.scale.min, s.scale.max) == (1.0, 1.0)
    assert s.flush is not None
    assert s.flush.max > 0
    means = {r.name: r.stats.mean for r in s.worst_underflow}
    assert list(means.values()) == sorted(means.values(), reverse=True)
    assert max(means.values()) > 0
    for name, mean in means.items():
        assert mean == statistics.fmean(v for _, v in scalars(log_dir, f"mpt/grad_underflow_fraction/{name}"))


def test_exponent_histogram_decoded_from_the_last_logged_step(runs: Runs) -> None:
    (s,) = build_report(runs.root / "a" / "version_0").runs
    h = s.exponents
    runs.probe.assert_decoded(h)
    assert h is not None
    assert h.step == 9
    assert h.nonfinite == 1
    assert h.parameters == ["net.0.bias", "net.0.weight", "net.3.bias", "net.3.weight"]
    assert h.zero + h.nonfinite + sum(h.counts.values()) == 16 * 32 + 32 + 32 * 4 + 4


def test_bf16_run(tmp_path: Path) -> None:
    """bf16: no scaling, the exponent axis spans bf16's range (-133 .. 127); the plots are drawn for it too."""
    probe = ExponentProbe(step=2, fmt=BF16)
    monitors = [probe, LossScaleMonitor(), GradientHistogramMonitor(every_n_steps=1)]
    logger = TensorBoardLogger(str(tmp_path), name="bf16", version=0)
    quiet_trainer(plugins=[MPTPrecision("bf16")], callbacks=monitors, logger=logger, max_steps=3).fit(
        TinyMLP(), regression_data()
    )
    report = build_report(tmp_path)
    (s,) = report.runs
    assert (s.format, s.steps, s.skipped_steps) == ("bf16", 3, 0)
    assert s.scale is not None
    assert (s.scale.min, s.scale.max) == (1.0, 1.0)
    probe.assert_decoded(s.exponents)
    paths = write_plots(report, tmp_path / "plots")
    assert [p.name for p in paths] == ["scale.png", "exponent_histogram.png"]  # no UnderflowMonitor: no heatmap
    assert all(png_size(p) for p in paths)


# ------------------------------------------------------------------------------------------------ the command
def table_row(text: str, label: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.startswith(label + "  ")]
    return [cell for cell in line[len(label) :].split("  ") if cell.strip()]


def test_text_compares_runs_side_by_side(runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(runs.root), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"lightning-mpt report: {runs.root} (2 runs)")
    assert max(r.scale for r in runs.plugin.history) == 2.0**11
    assert out.splitlines()[2].split() == ["a/version_0", "b/version_0"]
    assert [c.strip() for c in table_row(out, "skipped steps")] == ["3 (30%)", "0 (0%)"]
    assert [c.strip() for c in table_row(out, "first overflow at step")] == ["2", "-"]
    assert [c.strip() for c in table_row(out, "loss scale max")] == ["2^11", "1"]
    assert [c.strip() for c in table_row(out, "most often non-finite")] == ["net.3.weight (2)", "-"]
    assert "    net.3.weight: 2\n    net.0.bias: 1" in out


def test_json_and_plots(runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "plots"
    assert main(["report", str(runs.root), "--json", "--out", str(out_dir)]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # stdout is only the JSON
    assert data == build_report(runs.root).to_dict()
    a, b = data["runs"]
    assert (a["run"], a["skipped_steps"], a["first_overflow_step"], a["nonfinite_params"]) == (
        "a/version_0",
        3,
        2,
        {"net.3.weight": 2, "net.0.bias": 1},
    )
    assert a["exponents"]["nonfinite"] == 1
    assert b["scale"]["median"] == 1.0
    pngs = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*.png"))
    per_run = ["exponent_histogram.png", "scale.png", "underflow_heatmap.png"]
    assert pngs == [f"{r}/version_0/{f}" for r in "ab" for f in per_run] + ["scale_comparison.png"]
    for png in pngs:
        width, height = png_size(out_dir / png)
        assert width >= 400
        assert height >= 150
        assert (out_dir / png).stat().st_size < 300_000
        assert str(out_dir / png) in captured.err  # the paths are listed (on stderr: stdout is the JSON)


def test_default_out_is_logdir_report(runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = tmp_path / "run"
    shutil.copytree(runs.root / "b" / "version_0", log_dir)
    assert main(["report", str(log_dir)]) == 0
    assert sorted(p.name for p in (log_dir / "report").iterdir()) == [
        "exponent_histogram.png",
        "scale.png",
        "underflow_heatmap.png",
    ]
    assert f"plots:\n  {log_dir / 'report' / 'scale.png'}" in capsys.readouterr().out
    assert main(["report", str(log_dir), "--no-plots"]) == 0  # the report folder holds no event files: same run


def test_plots_skipped_without_matplotlib(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` now raises ImportError
    assert main(["report", str(runs.root / "a"), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "skipped steps" in out
    note = "plots skipped: matplotlib is not installed (pip install 'lightning-mpt[plots]')"
    assert out.rstrip().splitlines()[-5] == note  # then the dashboard's command and address
    assert not (tmp_path / "plots").exists()


def test_runs_without_mpt_tags_are_named(runs: Runs, tmp_path: Path) -> None:
    shutil.copytree(runs.root / "a", tmp_path / "a")
    with SummaryWriter(str(tmp_path / "plain")) as writer:
        writer.add_scalar("train_loss", 1.0, 0)
    report = build_report(tmp_path)
    assert [r.run for r in report.runs] == ["a/version_0"]
    assert report.ignored == ["plain"]
    assert format_text(report).endswith("no mpt/ tags, not reported: plain")


def event_file(run: Path) -> Path:
    (path,) = run.glob("events.out.tfevents.*")
    return path


def test_a_truncated_event_file_is_named_with_what_is_wrong_and_the_rest_reported(runs: Runs, tmp_path: Path) -> None:
    shutil.copytree(runs.root / "a", tmp_path / "a")
    path = event_file(tmp_path / "a" / "version_0")
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # inside the last record: its event's last byte and checksum are gone
    report = build_report(tmp_path)
    assert [r.run for r in report.runs] == ["a/version_0"]  # the whole records before it are read
    (what,) = report.unreadable.values()
    assert list(report.unreadable) == [str(path.relative_to(tmp_path))]
    assert what.startswith(f"truncated: it ends at byte {len(data) - 5}, inside record ")
    assert "the file was cut short; only the " in what
    assert f"  {path.relative_to(tmp_path)}: truncated: it ends at byte" in format_text(report)
    assert report.to_dict()["unreadable"] == report.unreadable


def test_a_file_that_is_no_event_file_is_named_not_taken_for_a_run_without_tags(runs: Runs, tmp_path: Path) -> None:
    shutil.copytree(runs.root / "a", tmp_path / "a")
    (tmp_path / "broken").mkdir()
    garbage = tmp_path / "broken" / "events.out.tfevents.1700000000.host.1.0"
    garbage.write_bytes(bytes(range(256)) * 4)
    (tmp_path / "a" / "version_0" / "events.out.tfevents.0.host").write_bytes(b"")  # an empty file is whole
    report = build_report(tmp_path)
    assert [r.run for r in report.runs] == ["a/version_0"]
    assert report.ignored == []  # not "no mpt/ tags": it could not be read at all
    assert report.unreadable == {
        "broken/events.out.tfevents.1700000000.host.1.0": "not a TensorBoard event file: its first record's length "
        "checksum does not match (another kind of file, or its first bytes are damaged); nothing in it can be read"
    }


def test_only_damaged_event_files_are_an_error_naming_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "events.out.tfevents.1.host").write_bytes(b"\x00" * 5)
    assert main(["report", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"lightning-mpt report: error: {tmp_path}: nothing to report: unreadable:\n")
    assert (
        "  x/events.out.tfevents.1.host: truncated: it ends at byte 5, inside record 1 (from byte 0); the writing "
        "process stopped mid-record, or the file was cut short; nothing in it can be read"
    ) in error
    assert "no mpt/ tags" not in error


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ("missing", "no such directory; expected a TensorBoard log directory"),
        ("file", "not a directory; expected a TensorBoard log directory"),
        ("empty", "no TensorBoard event files (events.out.tfevents.*) in it or below it"),
        ("no_mpt", "no mpt/ tags in the event files of plain; expected a run trained with lightning_mpt's callbacks"),
    ],
)
def test_errors(layout: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logdir = tmp_path / "logs"
    if layout == "file":
        logdir.write_text("not a log")
    elif layout == "empty":
        (logdir / "version_0").mkdir(parents=True)
    elif layout == "no_mpt":
        with SummaryWriter(str(logdir / "plain")) as writer:
            writer.add_scalar("train_loss", 1.0, 0)
    assert main(["report", str(logdir)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"lightning-mpt report: error: {logdir}: ")
    assert expected in line


def test_console_script(runs: Runs) -> None:
    """The installed ``lightning-mpt`` script (pyproject's [project.scripts]) runs the same command."""
    script = shutil.which("lightning-mpt") or shutil.which("lightning-mpt", path=str(Path(sys.executable).parent))
    assert script, "the lightning-mpt console script is not installed: run `pip install -e .`"
    proc = subprocess.run(
        [script, "report", str(runs.root / "a"), "--json", "--no-plots"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == build_report(runs.root / "a").to_dict()


# ------------------------------------------------------------------------------------------------ the records
class InjectMany(L.Callback):
    """An inf into the gradient of each of ``names`` at ``step``."""

    def __init__(self, names: list[str], step: int) -> None:
        self.names, self.step = names, step

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_step == self.step:
            params = dict(module.named_parameters())
            for name in self.names:
                params[name].grad.view(-1)[0] = float("inf")


def test_names_come_from_the_records_not_the_texts(tmp_path: Path) -> None:
    """The text of a skipped step lists ``max_names`` names; the report still counts every parameter."""
    bad = ["net.0.weight", "net.0.bias", "net.3.weight"]
    logger = TensorBoardLogger(str(tmp_path), name="", version=0)
    callbacks = [InjectMany(bad, step=1), LossScaleMonitor(max_names=1)]
    quiet_trainer(plugins=[MPTPrecision("fp16")], callbacks=callbacks, logger=logger, max_steps=3).fit(
        TinyMLP(), regression_data()
    )
    ((_, text),) = texts(read_events(logger.log_dir), "mpt/nonfinite_params")
    assert "`net.0.weight` and 2 more" in text  # what a text parser would have had to guess from
    (s,) = build_report(tmp_path).runs
    assert s.nonfinite_params == dict.fromkeys(bad, 1)
    assert s.nonfinite_names_complete
    assert (s.skipped_steps, s.first_overflow_step, s.loss_nonfinite_steps) == (1, 1, 0)


def test_a_stop_by_the_guard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**10), max_consecutive_skips=2)
    logger = TensorBoardLogger(str(tmp_path), name="stopped", version=0)
    callbacks = [InjectInf("net.3.bias", steps={3, 4, 5}), LossScaleMonitor(), UnderflowMonitor(every_n_steps=1)]
    trainer = quiet_trainer(plugins=[plugin], callbacks=callbacks, logger=logger, max_steps=STEPS)
    with pytest.raises(NonFiniteGradientError):
        trainer.fit(TinyMLP(), regression_data(n=16 * STEPS))
    (s,) = build_report(tmp_path).runs
    assert s.stopped is not None
    assert (s.stopped["step"], s.stopped["error"]) == (4, "NonFiniteGradientError")
    assert "2 optimizer steps in a row were skipped" in s.stopped["message"]
    assert (s.steps, s.skipped_steps, s.first_overflow_step) == (5, 2, 3)
    assert s.nonfinite_params == {"net.3.bias": 2}
    assert s.nonfinite_names_complete
    assert main(["report", str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert [c.strip() for c in table_row(out, "stopped by the guard at step")] == ["4"]
    assert "  stopped at step 4 by NonFiniteGradientError: MPTPrecision stopped training: 2 optimizer steps" in out


# -------------------------------------------------------------------------------------- bad folders and records
def no_traceback(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``lightning-mpt`` with ``args`` in a process of its own (``kwargs`` for ``subprocess.run``); it must not print a
    traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_mpt.cli", *args], capture_output=True, text=True, timeout=120, **kwargs
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_links_are_followed_once(runs: Runs, tmp_path: Path) -> None:
    """Links back to a parent are not walked round (one run, not 41; two such links do not take minutes), and
    ``latest -> version_0`` is the same run, named by its path without the link."""
    logs = tmp_path / "logs"
    shutil.copytree(runs.root / "a", logs / "a")
    (logs / "a" / "version_0" / "up").symlink_to("../..", target_is_directory=True)
    (logs / "a" / "up").symlink_to("..", target_is_directory=True)
    (logs / "a" / "latest").symlink_to("version_0", target_is_directory=True)
    start = time.monotonic()
    report = build_report(logs)
    assert time.monotonic() - start < 20
    assert [r.run for r in report.runs] == ["a/version_0"]
    assert report.unreadable == {}
    # a link to a run kept elsewhere is followed
    shutil.copytree(runs.root / "b", tmp_path / "elsewhere" / "b")
    (logs / "b").symlink_to(tmp_path / "elsewhere" / "b", target_is_directory=True)
    assert [r.run for r in build_report(logs).runs] == ["a/version_0", "b/version_0"]


def test_a_broken_link_and_a_folder_named_like_an_event_file_are_no_error(runs: Runs, tmp_path: Path) -> None:
    shutil.copytree(runs.root / "a", tmp_path / "a")
    (tmp_path / "gone").symlink_to(tmp_path / "missing")
    (tmp_path / "a" / "version_0" / "events.out.tfevents.0.folder").mkdir()  # a folder where a file is expected
    proc = no_traceback(["report", str(tmp_path), "--no-plots"])
    assert proc.returncode == 0
    assert "lightning-mpt report: " in proc.stdout
    assert f"  gone: a symbolic link to {tmp_path / 'missing'}, which does not exist" in proc.stdout
    assert [r.run for r in build_report(tmp_path).runs] == ["a/version_0"]


def without_dac_override() -> None:
    """In a child process before it runs the report: drop the capabilities by which root reads any folder
    (``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH``) from the bounding set, so that folder modes hold for it too."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_folder_that_cannot_be_listed_is_named_and_the_rest_reported(runs: Runs, tmp_path: Path) -> None:
    shutil.copytree(runs.root / "a", tmp_path / "a")
    shutil.copytree(runs.root / "b", tmp_path / "locked" / "b")
    (tmp_path / "locked").chmod(0o000)
    drop = without_dac_override if os.geteuid() == 0 else None
    try:
        probe = subprocess.run(
            [sys.executable, "-c", f"import os; os.listdir({str(tmp_path / 'locked')!r})"],
            capture_output=True,
            preexec_fn=drop,
            timeout=60,
        )
        if probe.returncode == 0:
            pytest.skip("this process can list a folder of mode 000 (root with its capabilities)")
        proc = no_traceback(["report", str(tmp_path), "--no-plots"], preexec_fn=drop)
    finally:
        (tmp_path / "locked").chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"lightning-mpt report: {tmp_path} (1 run)")
    assert "  locked: the folder cannot be listed (permission denied)" in proc.stdout


def good_and_bad(runs: Runs, root: Path, tag: str, payload: bytes) -> Path:
    """Run ``a`` twice under ``root``: ``good``, and ``bad`` with one more record of ``tag`` holding ``payload``."""
    shutil.copytree(runs.root / "a" / "version_0", root / "good")
    shutil.copytree(runs.root / "a" / "version_0", root / "bad")
    write_record(root / "bad", tag, payload, step=4)
    return root


@pytest.mark.parametrize(
    ("tag", "payload", "what"),
    [
        (
            "mpt/data/skipped_step",
            b'{"schema": 2, "step": 4, "params": ["net.0.weight"]}',
            "schema 2; this lightning-mpt reads schema 1",
        ),
        ("mpt/data/skipped_step", b'{"schema": 1, "step": null, "params": []}', "step is null, expected an integer"),
        ("mpt/data/skipped_step", b'[{"schema": 1, "step": 4}]', "a JSON array, expected an object"),
        (
            "mpt/data/overflow_summary",
            b'{"schema": 1, "step": 10, "skipped_steps": 3, "params": ["net.3.weight"]}',
            "params is a JSON array, expected an object of counts",
        ),
        ("mpt/data/run", b"not JSON {", "not JSON"),
    ],
)
def test_a_record_of_another_schema_or_malformed_names_the_run_and_the_rest_is_reported(
    runs: Runs, tmp_path: Path, tag: str, payload: bytes, what: str
) -> None:
    root = good_and_bad(runs, tmp_path, tag, payload)
    proc = no_traceback(["report", str(root), "--no-plots", "--json"])
    assert proc.returncode == 0
    data = json.loads(proc.stdout)
    good, bad = (next(r for r in data["runs"] if r["run"] == name) for name in ("good", "bad"))
    assert (good["skipped_steps"], good["nonfinite_params"]) == (3, {"net.3.weight": 2, "net.0.bias": 1})
    # the bad run's records are left out whole; its scalars still count the steps and the skips
    assert (bad["steps"], bad["skipped_steps"], bad["first_overflow_step"]) == (STEPS, 3, 2)
    assert bad["nonfinite_params"] == {}
    assert data["unreadable"]["bad"].startswith(
        f"its records are not read, the run is reported from its scalars: {tag} at step 4: {what}"
    )
    text = no_traceback(["report", str(root), "--no-plots"]).stdout
    assert f"  bad: its records are not read, the run is reported from its scalars: {tag} at step 4: {what}" in text


# ------------------------------------------------------------------------------------------------- the text's shape
LONG_RUNS = [
    f"{example}/version_{v}/{precision}"
    for example, v in [("litgpt_fabric", 0), ("bert_finetune", 3), ("vit_static_vs_dynamic", 12)]
    for precision in ("mpt-fp16", "bf16-mixed", "16-mixed", "mpt-bf16", "mpt-fp16-static", "32-true")
][:17]


def test_the_table_of_17_runs_fits_100_columns(runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """17 runs named by long paths: short column names with a legend, as many tables as the width needs; every line
    of the report fits 100 characters, and every run's numbers are still there."""
    for name in LONG_RUNS:
        shutil.copytree(runs.root / "a" / "version_0", tmp_path / name)
    assert main(["report", str(tmp_path), "--no-plots", "--width", "100"]) == 0
    out = capsys.readouterr().out
    wide = [line for line in out.splitlines() if len(line) > 100]
    assert not wide, f"{len(wide)} lines wider than 100, the widest {max(map(len, wide))}"
    assert out.startswith(f"lightning-mpt report: {tmp_path} (17 runs)\n\ncolumns:\n")
    for i, name in enumerate(sorted(LONG_RUNS), start=1):
        assert f"  #{i}: {name}\n" in out  # the legend
        assert f"\n{name}:\n" in out  # each run's own lists keep its full name
    skipped = [cell for line in out.splitlines() if line.startswith("skipped steps  ") for cell in line.split()[2:]]
    assert skipped == ["3", "(30%)"] * 17


def test_a_few_short_names_keep_one_table(runs: Runs, tmp_path: Path) -> None:
    for name in ("story/dynamic", "story/unscaled"):
        shutil.copytree(runs.root / "a" / "version_0", tmp_path / name)
    text = format_text(build_report(tmp_path), width=100)
    assert text.splitlines()[2].split() == ["story/dynamic", "story/unscaled"]  # the full names fit: no legend
    assert "columns:" not in text


def test_the_command_ends_with_the_dashboard(runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_mpt.diagnostics.dashboard import dashboard_url

    assert main(["report", str(runs.root / "b"), "--no-plots"]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-3:] == [
        "the Mixed precision dashboard (smoothing off):",
        f"  tensorboard --logdir {runs.root / 'b'}",
        f"  then open {dashboard_url()}",
    ]
    assert main(["report", str(runs.root / "b"), "--no-plots", "--json"]) == 0
    json.loads(capsys.readouterr().out)  # --json prints the JSON alone


# ------------------------------------------------------------------------------------------------------ the plots
def test_the_exponent_histogram_labels_zero_once(runs: Runs) -> None:
    pytest.importorskip("matplotlib")
    from lightning_mpt.report.plots import exponent_figure

    (summary,) = build_report(runs.root / "a").runs
    assert summary.exponents is not None
    ax = exponent_figure(summary.exponents).axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels.count("0") == 1  # the tick of exponent 0 (2^0), not also the bar of exact zeros
    assert (labels[0], labels[-1]) == ("zero", "inf/NaN")


def test_a_run_without_underflow_gets_words_not_a_blank_heatmap(runs: Runs) -> None:
    pytest.importorskip("matplotlib")
    from lightning_mpt.report.plots import underflow_figure

    report = build_report(runs.root / "a")
    (summary,) = report.runs
    assert summary.flush is not None
    assert summary.flush.max == 0  # the dynamic scale flushed nothing at any fp32 reference step
    ax = underflow_figure(report.data[0], summary).axes[0]
    assert not ax.collections  # no heatmap
    (text,) = ax.texts
    assert text.get_text().startswith("No underflow: the flush fraction was 0% for all 4 parameters at all 5 logged")
