"""The "Mixed precision" dashboard is readable as TensorBoard opens it: the loss scale as log2 steps, no chart whose
straight lines draw values a tag never had, and the address that opens it unsmoothed where a user starts.

TensorBoard draws every chart on a linear axis and joins a tag's points with straight lines. The tests read the
event files a real Trainer wrote and check the points a chart joins (the server-side view is in
tests/test_dashboard_server.py).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from models import InjectInf, TinyMLP, quiet_trainer, regression_data
from tb_events import layouts, read_events, series

from lightning_mpt import DynamicLossScaler, MPTPrecision
from lightning_mpt.callbacks import LossScaleMonitor
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.dashboard import CHARTS, SCALE_TITLE, dashboard_url

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


def _fit(tmp_path: Path, every_n_steps: int):
    """A fp16 run whose scale grows every 3 clean steps and backs off at the injected overflows (steps 4 and 9)."""
    torch.manual_seed(0)
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=3))
    callbacks = [InjectInf("net.3.weight", steps={4, 9}), LossScaleMonitor(every_n_steps=every_n_steps)]
    logger = TensorBoardLogger(str(tmp_path), name="", version=0)
    quiet_trainer(plugins=[plugin], callbacks=callbacks, logger=logger, max_steps=STEPS).fit(
        TinyMLP(), regression_data(n=16 * STEPS)
    )
    return [(r.step, r.scale) for r in plugin.history], read_events(logger.log_dir)


def _drawn(points: list[tuple[int, float]], step: int) -> float:
    """The value TensorBoard's line through ``points`` shows at ``step``: straight between neighbouring points."""
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    raise ValueError(f"step {step} outside {points}")


def test_log2_scale_equals_the_history_at_every_step(tmp_path: Path) -> None:
    history, ea = _fit(tmp_path, every_n_steps=1)
    assert len({s for _, s in history}) > 1  # the scale moves
    assert series(ea, tags.LOSS_SCALE_LOG2) == [(step, math.log2(scale)) for step, scale in history]


@pytest.mark.parametrize("every_n_steps", [5, 100])
def test_log2_scale_is_a_step_chart_when_logged_sparsely(tmp_path: Path, every_n_steps: int) -> None:
    """Logged every n steps, the line through the points still shows the scale of every step: a point on each side
    of every change, none in between (on a straight line from a growth to the next logged step, a scale it never
    had would show)."""
    history, ea = _fit(tmp_path, every_n_steps)
    points = series(ea, tags.LOSS_SCALE_LOG2)
    assert len(points) < len(history)  # sparse: not every step
    for step, scale in history[: points[-1][0] + 1]:  # the line ends at the last logged step
        assert _drawn(points, step) == math.log2(scale), (step, points)


def test_loss_scale_tag_keeps_its_steps(tmp_path: Path) -> None:
    """``mpt/loss_scale`` (the contract tag) is written where it always was; the extra points are the log2 tag's."""
    history, ea = _fit(tmp_path, every_n_steps=5)
    changed = {s for (s, a), (_, b) in zip(history, history[1:]) if a != b}
    skipped = {4, 9}
    expected = [(s, v) for s, v in history if s % 5 == 0 or s in changed | skipped]
    assert series(ea, tags.LOSS_SCALE) == expected


def test_layout_charts_the_log2_scale_and_no_zigzag(tmp_path: Path) -> None:
    _, ea = _fit(tmp_path, every_n_steps=1)
    (layout,) = layouts(ea)
    charts = {c.title: list(c.multiline.tag) for c in layout.category[0].chart}
    assert charts[SCALE_TITLE] == ["mpt/loss_scale_log2$"]
    # mpt/scale_change is written at changes only (+1, -1): joined by lines it draws fractions it never had
    assert not any(tags.SCALE_CHANGE in regex for regexes in charts.values() for regex in regexes)
    assert not any(tags.SCALE_CHANGE in regex for _, regexes in CHARTS.values() for regex in regexes)


def test_demo_prints_the_dashboard_address(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``make demo`` ends with the command and the address that opens the dashboard unsmoothed."""
    sys.path.insert(0, str(ROOT / "examples"))
    import precision_story

    precision_story.main(["--steps", "6", "--logdir", str(tmp_path / "story"), "--no-plots"])
    printed = capsys.readouterr().out
    assert f"tensorboard --logdir {tmp_path / 'story'}" in printed
    assert printed.count(dashboard_url()) == 1  # the report's last lines, not repeated by the example


def test_readme_shows_the_dashboard_address() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert dashboard_url() in readme
