"""A real TensorBoard server over a real training run: the "Mixed precision" dashboard as TensorBoard serves it.

TensorBoard is started as a subprocess on 127.0.0.1 (it picks a free port), the test reads its HTTP API (what the
browser's dashboard reads) and the server is stopped whatever happens. The server helper is the one
scripts/make_screenshots.py uses for the docs' screenshot.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from models import InjectInf, TinyMLP, quiet_trainer, regression_data

from lightning_mpt import DynamicLossScaler, MPTPrecision
from lightning_mpt.callbacks import CATEGORY, GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor
from lightning_mpt.diagnostics.dashboard import SCALE_TITLE

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
RUN = "mp/version_0"


def _screenshots_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_screenshots", ROOT / "scripts" / "make_screenshots.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tb = _screenshots_module()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """A fp16 run with overflows injected at steps 2 and 5, and a TensorBoard server over its log directory."""
    root = tmp_path_factory.mktemp("tb")
    torch.manual_seed(0)
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=2))
    callbacks = [
        InjectInf("net.3.weight", steps={2, 5}),
        LossScaleMonitor(),
        GradientHistogramMonitor(every_n_steps=4),
        UnderflowMonitor(every_n_steps=1, reference_every_n_steps=2),
    ]
    logger = TensorBoardLogger(str(root), name="mp", version=0)
    quiet_trainer(plugins=[plugin], callbacks=callbacks, logger=logger, max_steps=STEPS).fit(
        TinyMLP(), regression_data(n=16 * STEPS)
    )
    history = [(r.step, r.scale) for r in plugin.history]
    assert len(history) == STEPS
    assert plugin.skipped_steps == 2
    with tb.serve_tensorboard(root) as url:
        # TensorBoard reads event files in the background: wait until the run's whole series is there
        tb.wait_for(
            lambda: tb.get_json(url, "/data/plugin/scalars/scalars", run=RUN, tag="mpt/loss_scale"),
            lambda points: len(points) == STEPS,
        )
        yield url, history


def test_tensorboard_executable_is_installed() -> None:
    """tensorboard is a declared dependency: a missing executable is a failure, not a skip."""
    assert Path(tb.tensorboard_executable()).exists()


def test_layout_has_the_mixed_precision_category(served) -> None:
    url, _ = served
    layout = tb.get_json(url, "/data/plugin/custom_scalars/layout")
    assert [c["title"] for c in layout["category"]] == [CATEGORY] == ["Mixed precision"]
    charts = {c["title"]: c["multiline"]["tag"] for c in layout["category"][0]["chart"]}
    assert charts[SCALE_TITLE] == ["mpt/loss_scale_log2$"]
    assert tb.get_json(url, "/data/runs") == [RUN]


def test_loss_scale_series_equals_plugin_history(served) -> None:
    url, history = served
    points = tb.get_json(url, "/data/plugin/scalars/scalars", run=RUN, tag="mpt/loss_scale")
    assert [(step, value) for _, step, value in points] == history
    assert [s for _, s in history] == [1024, 1024, 2048, 1024, 1024, 2048, 1024, 1024]  # it really moves


def test_every_chart_of_the_dashboard_has_data(served) -> None:
    """What each chart draws: the custom-scalars plugin matches the chart's tag regexes against the run's tags."""
    url, history = served
    layout = tb.get_json(url, "/data/plugin/custom_scalars/layout")
    for chart in layout["category"][0]["chart"]:
        drawn = {}
        for regex in chart["multiline"]["tag"]:
            answer = tb.get_json(url, "/data/plugin/custom_scalars/scalars", run=RUN, tag=regex)
            assert answer["regex_valid"]
            drawn.update(answer["tag_to_events"])
        assert drawn, f"chart {chart['title']!r} is empty: no tag matches {chart['multiline']['tag']}"
        assert all(tag.startswith("mpt/") for tag in drawn)
    scale = tb.get_json(url, "/data/plugin/custom_scalars/scalars", run=RUN, tag="mpt/loss_scale_log2$")
    assert [(s, v) for _, s, v in scale["tag_to_events"]["mpt/loss_scale_log2"]] == [
        (step, math.log2(value)) for step, value in history
    ]
