"""The report's advice (``lightning_mpt.report_advice``): each rule fires on a run built to trigger it, with the run's
own numbers, and stays silent on runs where it must.

The runs are real ``Trainer`` fits of a tiny fp16 MLP with the real monitors, all under one log directory, read by
one ``build_report`` (one of the bf16 rule's two reasons comes from event files written directly).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from models import InjectInf, TinyMLP, quiet_trainer, regression_data
from tb_events import read_events, series
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter

from lightning_mpt import DynamicLossScaler, MPTPrecision
from lightning_mpt.callbacks import LossScaleMonitor, UnderflowMonitor
from lightning_mpt.cli import main
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.report import RunSummary, build_report, format_text
from lightning_mpt.report_advice import RULES, Advice

RULE_IDS = {rule.__name__ for rule in RULES}


class SmallGradients(TinyMLP):
    """Its loss (so every gradient) times 2^-18: at a low scale fp16 flushes part of the gradients."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * 2.0**-18


def bad_batch_data(steps: int, bad: int) -> DataLoader:
    """Regression data whose batch ``bad`` holds inputs beyond fp16's max: the forward pass overflows there."""
    x, y = regression_data(n=16 * steps).dataset.tensors
    x = x.clone()
    x[16 * bad : 16 * (bad + 1)] *= 1e5
    return DataLoader(TensorDataset(x, y), batch_size=16)


@dataclass
class Fit:
    plugin: MPTPrecision
    summary: RunSummary

    def advice(self) -> dict[str, Advice]:
        found = {a.rule: a for a in self.summary.advice}
        assert len(found) == len(self.summary.advice)
        assert set(found) <= RULE_IDS
        return found


# name -> (model, plugin, steps, extra callbacks, UnderflowMonitor's reference_every_n_steps, data)
def _runs() -> dict[str, tuple[Any, ...]]:
    return {
        # a static scale of 1: gradients flush (with the fp32 reference) / sit subnormal (without it)
        "static_low": (SmallGradients(), MPTPrecision("fp16", scaler=1.0), 8, [], 2, None),
        "static_noref": (SmallGradients(), MPTPrecision("fp16", scaler=1.0), 4, [], 0, None),
        # a dynamic scale started low that cannot grow in 8 steps / grows after every clean step
        "stuck": (SmallGradients(), MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=16.0)), 8, [], 2, None),
        "grows": (
            SmallGradients(),
            MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=16.0, growth_interval=1)),
            8,
            [],
            2,
            None,
        ),
        # a dynamic scale started at 2^24 probes down through overflows
        "probe": (TinyMLP(), MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**24)), 10, [], 2, None),
        # a static scale too high for the gradients: every step overflows (the guard allows it here)
        "static_over": (TinyMLP(), MPTPrecision("fp16", scaler=2.0**22, max_consecutive_skips=100), 4, [], 2, None),
        # every step overflows while a dynamic scale backs off: no scale is known to work
        "all_skipped": (
            TinyMLP(),
            MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**10)),
            4,
            [InjectInf("net.0.bias", steps={0, 1, 2, 3})],
            2,
            None,
        ),
        # one parameter's gradient is non-finite at every skipped step (a bad value written into it)
        "one": (
            TinyMLP(),
            MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**10)),
            7,
            [InjectInf("net.0.bias", steps={1, 3, 5})],
            2,
            None,
        ),
        # SGD with a tiny learning rate: the updates are below half an ulp of the fp16 weights
        "masters": (TinyMLP(lr=1e-6, optimizer="sgd"), MPTPrecision("fp16"), 4, [], 2, None),
        "bf16": (TinyMLP(lr=1e-6, optimizer="sgd"), MPTPrecision("bf16"), 4, [], 2, None),
        # one batch with inputs beyond fp16's max: its loss is NaN
        "forward_overflow": (TinyMLP(), MPTPrecision("fp16"), 4, [], 2, bad_batch_data(4, bad=1)),
    }


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Fit]:
    root = tmp_path_factory.mktemp("advice")
    plugins = {}
    for name, (model, plugin, steps, callbacks, reference, data) in _runs().items():
        torch.manual_seed(0)
        monitors = [LossScaleMonitor(), UnderflowMonitor(every_n_steps=1, reference_every_n_steps=reference)]
        logger = TensorBoardLogger(str(root), name=name, version=0)
        trainer = quiet_trainer(plugins=[plugin], callbacks=[*callbacks, *monitors], logger=logger, max_steps=steps)
        trainer.fit(model, data or regression_data(n=16 * steps))
        plugins[name] = plugin
    report = build_report(root)
    summaries = {s.run.split("/")[0]: s for s in report.runs}
    return {name: Fit(plugins[name], summaries[name]) for name in plugins}


def silent(fits: dict[str, Fit], rule: str, *names: str) -> None:
    for name in names:
        assert rule not in fits[name].advice(), f"{rule} spoke on {name}: {fits[name].advice()[rule].text}"


def log_dir(fit: Fit) -> Path:
    return Path(fit.summary.path)


# ---------------------------------------------------------------------------------------------- each rule
def test_static_overflow(fits: dict[str, Fit]) -> None:
    fit = fits["static_over"]
    advice = fit.advice()["static_overflow"]
    history = list(fit.plugin.history)
    assert advice.numbers["overflow_steps"] == sum(r.skipped for r in history) == 4
    assert advice.numbers["scale"] == 2.0**22
    worst = min(v for _, v in series(read_events(log_dir(fit)), tags.SCALE_HEADROOM))
    assert worst < 0  # the fp32 reference measured the overflow
    assert advice.numbers["suggested_scale"] == 2.0 ** (22 + math.floor(worst) - 1)
    assert "overflowed at 4 of 4 steps" in advice.text
    assert "2^22" in advice.text
    silent(fits, "static_overflow", "static_low", "probe", "one", "forward_overflow")


def test_skips_at_start(fits: dict[str, Fit]) -> None:
    fit = fits["probe"]
    history = list(fit.plugin.history)
    leading = next(i for i, r in enumerate(history) if not r.skipped)
    assert leading >= 3
    advice = fit.advice()["skips_at_start"]
    assert advice.numbers["leading_skips"] == leading
    assert advice.numbers["initial_scale"] == 2.0**24
    assert advice.numbers["settled_scale"] == history[leading].scale
    assert f"init_scale=2.0**{int(math.log2(history[leading].scale))}" in advice.text
    # skips later in the run, a static scale, no skips
    silent(fits, "skips_at_start", "one", "static_over", "stuck", "forward_overflow")


def test_skips_at_start_advises_no_scale_when_every_step_was_skipped(fits: dict[str, Fit]) -> None:
    fit = fits["all_skipped"]
    assert [r.skipped for r in fit.plugin.history] == [True] * 4
    advice = fit.advice()["skips_at_start"]
    assert advice.numbers["leading_skips"] == advice.numbers["steps"] == 4
    assert "All 4 optimizer steps were skipped" in advice.text
    assert "init_scale=2.0**" not in advice.text  # no scale let a step through


def test_one_param(fits: dict[str, Fit]) -> None:
    advice = fits["one"].advice()["one_param"]
    assert advice.numbers == {
        "param": "net.0.bias",
        "skips_with_param": 3,
        "skipped_steps": 3,
        "next_param": None,
        "next_count": 0,
    }
    # an overflow of the whole network names every parameter alike; a single skip proves nothing
    assert len(fits["probe"].summary.nonfinite_params) > 2
    silent(fits, "one_param", "probe", "static_over", "forward_overflow")


def test_bf16_for_a_forward_overflow(fits: dict[str, Fit]) -> None:
    fit = fits["forward_overflow"]
    assert [r.step for r in fit.plugin.history if r.skipped] == [1]
    advice = fit.advice()["bf16"]
    assert advice.numbers["loss_nonfinite_steps"] == 1
    assert "no loss scale prevents" in advice.text
    silent(fits, "bf16", "bf16", "static_low", "stuck", "probe", "static_over", "one", "masters")


def test_underflow(fits: dict[str, Fit]) -> None:
    fit = fits["static_low"]
    advice = fit.advice()["underflow"]
    events = read_events(log_dir(fit))
    step, room = series(events, tags.SCALE_HEADROOM)[-1]
    flushed = {
        name: dict(series(events, tags.per_parameter(tags.GRAD_UNDERFLOW, name))).get(step, 0.0)
        for name in ("net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias")
    }
    assert advice.numbers["step"] == step == 6
    assert advice.numbers["flush"] == {n: v for n, v in flushed.items() if v >= 0.01}
    assert advice.numbers["flush"]  # the unscaled run loses a share of several layers
    assert advice.numbers["suggested_scale"] == 2.0 ** (math.floor(room) - 1)
    assert advice.numbers["lost_below"] == 2.0**-25  # what fp16 flushes at scale 1
    # a dynamic scale that grew out of its early underflow; a run without underflow
    assert fits["grows"].summary.flush is not None
    assert fits["grows"].summary.flush.max > 0
    silent(fits, "underflow", "grows", "probe", "static_noref")


def test_growth_interval(fits: dict[str, Fit]) -> None:
    fit = fits["stuck"]
    assert {r.scale for r in fit.plugin.history} == {16.0}
    advice = fit.advice()["growth_interval"]
    assert advice.numbers["growth_interval"] == 2000
    assert advice.numbers["longest_clean_steps"] == 8
    assert 1 <= advice.numbers["suggested_growth_interval"] < 8
    assert "growth_interval=2000" in advice.text
    # the same run with growth_interval=1 (it grew), a static scale, a scale that could not have grown
    assert max(r.scale for r in fits["grows"].plugin.history) > 16.0
    silent(fits, "growth_interval", "grows", "static_low", "probe")


def test_headroom(fits: dict[str, Fit]) -> None:
    fit = fits["static_noref"]
    advice = fit.advice()["headroom"]
    least = min(v for _, v in series(read_events(log_dir(fit)), tags.STORED_HEADROOM))
    assert advice.numbers["min_headroom_bits"] == pytest.approx(least)
    assert least >= 8
    assert advice.numbers["suggested_scale"] == 2.0 ** (math.floor(least) - 1)
    assert advice.numbers["subnormal_mean"] == fit.summary.subnormal.mean > 0.5
    # the underflow rule already names the scale; overflowing; a dynamic scale
    assert "underflow" in fits["static_low"].advice()
    silent(fits, "headroom", "static_low", "static_over", "stuck", "bf16")


def test_masters(fits: dict[str, Fit]) -> None:
    for name in ("masters", "bf16"):
        fit = fits[name]
        advice = fit.advice()["masters"]
        stats = fit.summary.update_underflow
        assert stats is not None
        assert stats.mean > 0.9
        assert (advice.numbers["mean"], advice.numbers["last"]) == (stats.mean, stats.last)
        assert f"{100 * stats.last:.3g}% of the updates at step 3" in advice.text
    assert fits["one"].summary.update_underflow.mean < 0.01  # Adam at lr 1e-2: updates far above an ulp
    silent(fits, "masters", "one", "probe", "static_over")


# -------------------------------------------------------------------------------- written event files
def write_run(path: Path, headroom: float, reference_steps: tuple[int, ...] = (4,)) -> None:
    """An fp16 run's tags as the monitors write them: at the fp32 reference steps (4) of a dynamic scale 2^10, a layer
    that lost 25% of its gradient values, with ``headroom`` bits above the largest gradient."""
    with SummaryWriter(str(path)) as writer:
        sink = Sink(writer)
        sink.record(tags.RUN_RECORD, {"format": "fp16", "loss_scaling": "dynamic", "scaler": None}, 0)
        for step in range(5):
            sink.scalars({tags.LOSS_SCALE: 2.0**10, tags.OVERFLOW: 0.0, tags.SKIPPED_STEPS: 0.0}, step)
        for step in reference_steps:
            sink.scalars(
                {
                    tags.GRAD_UNDERFLOW: 0.125,
                    tags.per_parameter(tags.GRAD_UNDERFLOW, "embed.weight"): 0.25,
                    tags.per_parameter(tags.GRAD_UNDERFLOW, "head.weight"): 0.0,
                    tags.SCALE_HEADROOM: headroom,
                },
                step,
            )


def test_bf16_for_gradients_wider_than_fp16(tmp_path: Path) -> None:
    write_run(tmp_path / "narrow", headroom=0.5)  # no higher scale is safe: bf16
    write_run(tmp_path / "room", headroom=6.5)  # a higher scale keeps them: the underflow rule says which
    runs = {s.run: {a.rule: a for a in s.advice} for s in build_report(tmp_path).runs}
    narrow, room = runs["narrow"], runs["room"]
    assert narrow["bf16"].numbers["flush"] == {"embed.weight": 0.25}
    assert narrow["bf16"].numbers["headroom_bits"] == 0.5
    assert "no higher fp16 scale is safe" in narrow["underflow"].text
    assert "bf16" not in room
    assert room["underflow"].numbers["suggested_scale"] == 2.0 ** (10 + 6 - 1)


# ------------------------------------------------------------------------------------------ text and JSON
def test_text_and_json_carry_the_advice(fits: dict[str, Fit], capsys: pytest.CaptureFixture[str]) -> None:
    path = log_dir(fits["probe"])
    assert main(["report", str(path), "--json", "--no-plots"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert [a["rule"] for a in run["advice"]] == [a.rule for a in fits["probe"].summary.advice]
    first = run["advice"][0]
    assert first["rule"] == "skips_at_start"
    assert first["numbers"]["leading_skips"] >= 3
    assert first["text"].startswith("The first ")
    text = format_text(build_report(path))
    tail = text[text.index("advice (what to change, and why):") :]
    assert f"  - {first['text']} [skips_at_start]" in tail
    quiet = format_text(build_report(log_dir(fits["grows"])))
    assert quiet.rstrip().endswith("nothing to change (no rule applies)")


# ----------------------------------------------------------------------------------------------------- plots
def test_underflow_plot_adapts_to_the_logged_steps(fits: dict[str, Fit], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from lightning_mpt.report_plots import underflow_figure

    write_run(tmp_path / "once", headroom=6.5)  # the flush fraction logged at step 4 only
    write_run(tmp_path / "twice", headroom=6.5, reference_steps=(3, 4))  # two steps: no half steps between them
    cases = [(tmp_path / "once", "bars"), (tmp_path / "twice", "heatmap"), (log_dir(fits["static_low"]), "heatmap")]
    for path, kind in cases:
        report = build_report(path)
        fig = underflow_figure(report.data[0], report.runs[0])
        ax = fig.axes[0]
        if kind == "bars":  # one column of a heatmap would invent a time axis around step 4
            assert len(fig.axes) == 1
            assert ax.get_xlabel() == "flush fraction (%)"
            assert "at step 4, the one logged step" in ax.get_title()
            assert [t.get_text() for t in ax.get_yticklabels()] == ["embed.weight", "head.weight"]
        else:  # one column per fp32 reference step, the optimizer step on the x axis, and a colour bar
            assert len(fig.axes) == 2
            assert ax.get_xlabel() == "optimizer step"
            fig.canvas.draw()
            assert all(float(t).is_integer() for t in ax.get_xticks())
