"""The report's advice (``lightning_mpt.report.advice``): each rule fires on a run built to trigger it, with the run's
own numbers, and stays silent on runs where it must.

The runs are real ``Trainer`` fits of a tiny fp16 MLP with the real monitors, all under one log directory, read by
one ``build_report`` (one of the bf16 rule's two reasons comes from event files written directly).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from models import InjectInf, TinyMLP, quiet_trainer, regression_data
from tb_events import read_events, series
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter

from lightning_mpt import DynamicLossScaler, MPTPrecision
from lightning_mpt.callbacks import LossScaleMonitor, UnderflowMonitor
from lightning_mpt.cli import main
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.report import RULES, Advice, RunSummary, build_report, format_text

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


def tiny_column_data(steps: int, d_in: int = 128) -> DataLoader:
    """Regression data whose first input feature is 2^-40 times the others: the gradients of its weights flush to
    zero at any usable fp16 scale, about 0.75% of all gradient values, the rest stay normal (a healthy run's tail)."""
    x, y = regression_data(n=16 * steps, d_in=d_in).dataset.tensors
    x = x.clone()
    x[:, 0] *= 2.0**-40
    return DataLoader(TensorDataset(x, y), batch_size=16)


@dataclass
class Spec:
    """One run of the fixture: the model, the plugin's arguments (or Lightning's ``precision``), its steps."""

    model: Callable[[], L.LightningModule]
    plugin: dict[str, Any]  # MPTPrecision's arguments; {"precision": "bf16-mixed"} for Lightning's own plugin
    steps: int
    callbacks: Callable[[], list[L.Callback]] = list
    reference: int = 2  # UnderflowMonitor's reference_every_n_steps
    data: Optional[Callable[[int], DataLoader]] = None

    def fit(self, logger: Any = None, monitors: Optional[list[L.Callback]] = None, **changes: Any) -> Fit:
        """Train it (seeded: the same initial weights and batches each time), ``changes`` to the plugin's arguments
        (or ``trainer={...}`` to the Trainer's)."""
        trainer_args = changes.pop("trainer", {})
        args = {**self.plugin, **changes}
        torch.manual_seed(0)
        model = self.model()
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if "precision" in args:
            plugin, trainer_args = None, {**trainer_args, "precision": args["precision"]}
        else:
            plugin = MPTPrecision(args.pop("format", "fp16"), **args)
            trainer_args["plugins"] = [plugin]
        trainer = quiet_trainer(
            callbacks=[*self.callbacks(), *(monitors or [])],
            logger=logger or False,
            max_steps=self.steps,
            **trainer_args,
        )
        trainer.fit(model, (self.data or (lambda n: regression_data(n=16 * n)))(self.steps))
        return Fit(plugin, None, model, initial)


@dataclass
class Fit:
    plugin: Optional[MPTPrecision]
    summary: Optional[RunSummary]
    model: L.LightningModule
    initial: dict[str, torch.Tensor]

    def advice(self) -> dict[str, Advice]:
        assert self.summary is not None
        found = {a.rule: a for a in self.summary.advice}
        assert len(found) == len(self.summary.advice)
        assert set(found) <= RULE_IDS
        return found

    @property
    def skipped(self) -> list[int]:
        assert self.plugin is not None
        return [r.step for r in self.plugin.history if r.skipped]

    def moved(self, names: tuple[str, ...], fp16: bool = False) -> float:
        """The share of the weights ``names`` that training changed (from their fp16 rounding with ``fp16``)."""
        changed = total = 0
        for name in names:
            before, after = self.initial[name], self.model.state_dict()[name].float()
            before = before.half().float() if fp16 else before
            changed += int((after != before).sum())
            total += before.numel()
        return changed / total


def dynamic(init_scale: Any, **kwargs: Any) -> dict[str, Any]:
    return {"scaler": DynamicLossScaler(init_scale=init_scale, **kwargs)}


SPECS: dict[str, Spec] = {
    # a static scale of 1: gradients flush (with the fp32 reference) / sit subnormal (without it)
    "static_low": Spec(SmallGradients, {"scaler": 1.0}, 8),
    "static_noref": Spec(SmallGradients, {"scaler": 1.0}, 4, reference=0),
    # a dynamic scale started low that cannot grow in 8 steps / grows after every clean step
    "stuck": Spec(SmallGradients, dynamic(16.0), 8),
    "grows": Spec(SmallGradients, dynamic(16.0, growth_interval=1), 8),
    # a dynamic scale started at 2^24 probes down through overflows; one started one or two doublings too high
    "probe": Spec(TinyMLP, dynamic(2.0**24), 10),
    "near": Spec(TinyMLP, dynamic(2.0**18), 10),
    # a dynamic scale that grows every 2 clean steps into overflows: growth probes, the scaler at work
    "probes": Spec(TinyMLP, dynamic(2.0**14, growth_interval=2), 30),
    # a static scale too high for the gradients: every step overflows / most steps do (the guard allows it here)
    "static_over": Spec(TinyMLP, {"scaler": 2.0**22, "max_consecutive_skips": 100}, 4),
    "static_some": Spec(TinyMLP, {"scaler": 2.0**17.6, "max_consecutive_skips": 100}, 12),
    # every step overflows while a dynamic scale backs off: no scale is known to work
    "all_skipped": Spec(TinyMLP, dynamic(2.0**10), 4, lambda: [InjectInf("net.0.bias", steps={0, 1, 2, 3})]),
    # one parameter's gradient is non-finite at every skipped step (a bad value written into it)
    "one": Spec(TinyMLP, dynamic(2.0**10), 7, lambda: [InjectInf("net.0.bias", steps={1, 3, 5})]),
    # SGD with a tiny learning rate: the updates are below half an ulp of the fp16 weights; with the masters, without
    # them, in bf16 with masters, and under Lightning's "bf16-mixed" (fp32 weights)
    "masters": Spec(lambda: TinyMLP(lr=1e-6, optimizer="sgd"), {}, 4),
    "no_masters": Spec(lambda: TinyMLP(lr=1e-6, optimizer="sgd"), {"master_weights": False}, 4),
    "bf16": Spec(lambda: TinyMLP(lr=1e-6, optimizer="sgd"), {"format": "bf16"}, 4),
    "bf16_mixed": Spec(lambda: TinyMLP(lr=1e-6, optimizer="sgd"), {"precision": "bf16-mixed"}, 4),
    # one batch with inputs beyond fp16's max: its loss is NaN
    "forward_overflow": Spec(TinyMLP, {}, 4, data=lambda n: bad_batch_data(n, bad=1)),
    # healthy runs that flush a tail of 0.75% of the gradient values (one input feature 2^-40 of the others), with
    # room to spare above the largest gradient: a dynamic scale that never grew, a static one
    "tail_dynamic": Spec(lambda: TinyMLP(d_in=128), dynamic(2.0**8), 8, data=tiny_column_data),
    "tail_static": Spec(lambda: TinyMLP(d_in=128), {"scaler": 2.0**8}, 8, data=tiny_column_data),
}


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Fit]:
    root = tmp_path_factory.mktemp("advice")
    done = {}
    for name, spec in SPECS.items():
        monitors = [LossScaleMonitor(), UnderflowMonitor(every_n_steps=1, reference_every_n_steps=spec.reference)]
        done[name] = spec.fit(TensorBoardLogger(str(root), name=name, version=0), monitors)
    report = build_report(root)
    for summary in report.runs:
        done[summary.run.split("/")[0]].summary = summary
    return done


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


def test_static_overflow_advises_what_helps(fits: dict[str, Fit]) -> None:
    """A static scale that overflows at most steps, always in one parameter: the advice names it and a lower scale or
    the dynamic scaler, each of which removes the skips; clipping and ``keep_fp32=nn.Linear`` (once advised for
    "one parameter") change nothing, so they are not advised."""
    fit = fits["static_some"]
    skipped = fit.skipped
    assert 3 <= len(skipped) < SPECS["static_some"].steps
    advice = fit.advice()
    assert list(advice) == ["static_overflow"]
    text = advice["static_overflow"].text
    assert "it starts in net.3.weight's gradient" in text
    assert "gradient_clip_val" not in text
    assert "keep_fp32" not in text
    suggested = advice["static_overflow"].numbers["suggested_scale"]
    assert suggested < 2.0**17.6
    spec = SPECS["static_some"]
    assert spec.fit(scaler=suggested).skipped == []
    assert spec.fit(scaler=None).skipped == []  # the dynamic scaler from 2^16
    assert spec.fit(trainer={"gradient_clip_val": 1.0}).skipped == skipped
    assert spec.fit(keep_fp32=(nn.Linear,)).skipped == skipped


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
    assert 'DynamicLossScaler(init_scale="auto")' in advice.text
    # skips later in the run, a static scale, no skips, one or two skips at the start (the scaler at work)
    assert 1 <= len(fits["near"].summary.skips.start) < 3
    silent(fits, "skips_at_start", "one", "static_over", "stuck", "forward_overflow", "near")


def test_skips_at_start_advises_what_helps(fits: dict[str, Fit]) -> None:
    """The scale it names and ``init_scale="auto"`` each start the same run without the skips."""
    advice = fits["probe"].advice()["skips_at_start"]
    spec = SPECS["probe"]
    assert spec.fit(scaler=DynamicLossScaler(init_scale=advice.numbers["suggested_init_scale"])).skipped == []
    auto = spec.fit(scaler=DynamicLossScaler(init_scale="auto")).skipped
    assert auto[:3] != [0, 1, 2]  # fewer than 3 skips at the start, where 2^24 had 'leading_skips'
    assert advice.numbers["leading_skips"] >= 3


def test_skips_at_start_advises_no_scale_when_every_step_was_skipped(fits: dict[str, Fit]) -> None:
    fit = fits["all_skipped"]
    assert [r.skipped for r in fit.plugin.history] == [True] * 4
    advice = fit.advice()["skips_at_start"]
    assert advice.numbers["leading_skips"] == advice.numbers["steps"] == 4
    assert "All 4 optimizer steps were skipped" in advice.text
    assert "init_scale=2.0**" not in advice.text  # no scale let a step through


def test_growth_probes_are_not_a_culprit(fits: dict[str, Fit], capsys: pytest.CaptureFixture[str]) -> None:
    """A dynamic scale that grows every 2 clean steps overflows after most growths, always in the last layer's
    gradient: the scaler at work, said in the summary; nothing to change, and no parameter to blame."""
    fit = fits["probes"]
    assert fit.advice() == {}
    kinds = fit.summary.skips
    assert fit.skipped == sorted([*kinds.start, *kinds.probes, *kinds.other])
    assert len(kinds.probes) >= 3
    assert len(kinds.probes) > len(kinds.other)
    assert kinds.start == []
    assert list(fit.summary.nonfinite_params)[0] == "net.3.weight"  # the fact stays in the summary
    assert main(["report", str(log_dir(fit)), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert (
        f"    growth probes (an overflow at a scale just grown: the dynamic scaler at work): {len(kinds.probes)}" in out
    )
    assert "nothing to change (no rule applies)" in out


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
    # the same run with growth_interval=1 (it grew), a static scale, a scale that could not have grown, and a healthy
    # run whose scale never grew with 8 bits to spare while a tail of 0.75% of the gradient values flushed
    assert max(r.scale for r in fits["grows"].plugin.history) > 16.0
    tail = fits["tail_dynamic"].summary
    assert {r.scale for r in fits["tail_dynamic"].plugin.history} == {2.0**8}
    assert 0 < tail.flush.max < 0.01
    assert tail.subnormal.mean < 0.01
    silent(fits, "growth_interval", "grows", "static_low", "probe", "tail_dynamic")


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
    # a healthy static run with 8 bits to spare whose only flushed values are a tail of 0.75% no scale would save
    tail = fits["tail_static"].summary
    assert 0 < tail.flush.max < 0.01
    assert min(v for _, v in series(read_events(log_dir(fits["tail_static"])), tags.SCALE_HEADROOM)) >= 8
    silent(fits, "headroom", "static_low", "static_over", "stuck", "bf16", "tail_static")


def test_update_underflow_is_a_fact_not_advice(fits: dict[str, Fit], capsys: pytest.CaptureFixture[str]) -> None:
    """SGD's tiny updates are below half an ulp of fp16 weights: the masters keep them (without masters, measured on
    the Linear weights, not one moves; with them, the same updates move them). A run with the masters on, or with fp32
    weights (Lightning's "bf16-mixed"), has nothing to change: the summary says it, the advice does not."""
    linear = ("net.0.weight", "net.3.weight")
    assert fits["no_masters"].moved(linear, fp16=True) < 0.01  # the updates lost, but for a few in a thousand
    assert fits["masters"].moved(linear) > 0.5  # the same updates, kept by the masters
    for name in ("masters", "bf16", "bf16_mixed"):
        stats = fits[name].summary.update_underflow
        assert stats is not None, name
        assert stats.mean > 0.9, name
        assert fits[name].advice() == {}, name
    assert main(["report", str(log_dir(fits["masters"])), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "update underflow by layer (mean/last; the fp32 master weights keep these updates):" in out
    assert "nothing to change (no rule applies)" in out
    assert main(["report", str(log_dir(fits["bf16_mixed"])), "--no-plots"]) == 0
    assert "(mean/last; the weights are fp32 (autocast): these updates are kept)" in capsys.readouterr().out


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
    assert f"- {first['text']} [skips_at_start]" in " ".join(tail.split())  # wrapped to the width
    quiet = format_text(build_report(log_dir(fits["grows"])))
    assert quiet.rstrip().endswith("nothing to change (no rule applies)")


# ----------------------------------------------------------------------------------------------------- plots
def test_underflow_plot_adapts_to_the_logged_steps(fits: dict[str, Fit], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from lightning_mpt.report.plots import underflow_figure

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
