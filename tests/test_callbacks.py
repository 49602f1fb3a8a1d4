"""The diagnostic callbacks with a real Trainer, read back from TensorBoard event files (docs/concepts.md#definitions,
docs/concepts.md#tensorboard-tags)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from host_syncs import HostSyncCounter
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from models import TinyMLP, quiet_trainer, regression_data
from tb_events import layouts, read_events, records, series, texts
from torch import nn

from lightning_mpt import DynamicLossScaler, MPTPrecision, NonFiniteGradientError
from lightning_mpt.callbacks import (
    CATEGORY,
    DiagnosticsWarning,
    GradientHistogramMonitor,
    LossScaleMonitor,
    TensorCoreCheck,
    UnderflowMonitor,
    tensor_core_report,
)
from lightning_mpt.callbacks._monitor import Monitor
from lightning_mpt.core.numerics import FP16, flush_counts
from lightning_mpt.diagnostics.dashboard import SCALE_TITLE
from lightning_mpt.diagnostics.recorder import Recorder
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistic import STRICT_ENV, Statistic

HALF_PARAMS = ["net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"]  # TinyMLP without its LayerNorm
ALL_PARAMS = ["net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias"]
FRACTION_TAGS = [
    "mpt/grad_zero_fraction",
    "mpt/grad_subnormal_fraction",
    "mpt/grad_underflow_fraction",
    "mpt/update_underflow_fraction",
]


# ------------------------------------------------------------------------------------------------------ helpers
class InjectNonFinite(L.Callback):
    """Write inf/NaN into one named parameter's gradient after backward at chosen optimizer steps."""

    def __init__(self, param: str, steps: dict[int, float]) -> None:
        self.param, self.steps = param, steps

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = self.steps.get(trainer.global_step)
        if value is not None:
            grad = dict(pl_module.named_parameters())[self.param].grad
            grad.view(-1)[0] = value


class ScaleProbe(L.Callback):
    """Record, per optimizer step, the GradScaler's scale the step's gradients were computed with."""

    def __init__(self) -> None:
        self.scales: list[tuple[int, float]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.scales.append((trainer.global_step, trainer.precision_plugin.scaler.get_scale()))


def fit(
    model: L.LightningModule, tmp_path: Any, callbacks: list, plugin: Any, steps: int, data: Any = None, **kwargs: Any
):
    logger = TensorBoardLogger(str(tmp_path), name="", version=0)
    precision = {"precision": plugin} if isinstance(plugin, str) else {"plugins": [plugin]}
    trainer = quiet_trainer(**precision, callbacks=callbacks, logger=logger, max_steps=steps, **kwargs)
    trainer.fit(model, data if data is not None else regression_data(n=128))
    return trainer, read_events(logger.log_dir)


# ------------------------------------------------------------------------ one fp16 run with injected overflows
@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    torch.manual_seed(0)
    monitors = [
        LossScaleMonitor(),
        GradientHistogramMonitor(every_n_steps=1),
        UnderflowMonitor(every_n_steps=1, reference_every_n_steps=2),
    ]
    inject = InjectNonFinite("net.3.weight", {2: math.inf, 5: math.nan})
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=2))
    trainer, ea = fit(TinyMLP(), tmp_path_factory.mktemp("fp16"), [inject, *monitors], plugin, steps=8)
    return trainer, ea, monitors


def test_event_files_hold_the_design_tags(fp16_run):
    trainer, ea, _ = fp16_run
    scalars, histograms = set(ea.Tags()["scalars"]), set(ea.Tags()["histograms"])
    assert {"mpt/loss_scale", "mpt/skipped_steps", "mpt/overflow", *FRACTION_TAGS} <= scalars
    for tag in FRACTION_TAGS:
        assert {f"{tag}/{name}" for name in HALF_PARAMS} <= scalars
        assert not any(t.startswith(tag + "/net.1.") for t in scalars)  # the LayerNorm stays fp32: not measured
    assert {f"mpt/grad/{name}" for name in ALL_PARAMS} <= histograms
    assert {f"mpt/grad_exponent/{name}" for name in HALF_PARAMS} == {t for t in histograms if "exponent" in t}
    assert {e.step for e in ea.Histograms("mpt/grad/net.0.weight")} == set(range(8))


def test_loss_scale_series_equals_plugin_history(fp16_run):
    trainer, ea, _ = fp16_run
    history = [(r.step, r.scale) for r in trainer.precision_plugin.history]
    assert len(history) == 8
    assert series(ea, "mpt/loss_scale") == history
    # growth every 2 clean steps, back-off at each overflow: the series really moves
    assert [s for _, s in history] == [1024, 1024, 2048, 1024, 1024, 2048, 1024, 1024]
    assert series(ea, "mpt/scale_change") == [(1, 1.0), (2, -1.0), (4, 1.0), (5, -1.0), (7, 1.0)]


def test_overflow_counts_equal_injected_and_name_the_parameter(fp16_run):
    trainer, ea, monitors = fp16_run
    assert series(ea, "mpt/overflow") == [(s, float(s in (2, 5))) for s in range(8)]
    assert series(ea, "mpt/skipped_steps")[-1] == (7, 2.0)
    assert trainer.precision_plugin.skipped_steps == 2
    assert monitors[0].overflow_counts == {"net.3.weight": 2}
    assert series(ea, "mpt/nonfinite_param_count") == [(2, 1.0), (5, 1.0)]
    assert series(ea, "mpt/loss_nonfinite") == [(2, 0.0), (5, 0.0)]
    notes = texts(ea, "mpt/nonfinite_params")
    assert [s for s, _ in notes] == [2, 5]
    assert all("`net.3.weight`" in t and "loss finite" in t for _, t in notes)
    ((_, summary),) = texts(ea, "mpt/overflow_summary")
    assert "| `net.3.weight` | 2 |" in summary


def test_nonfinite_values_are_counted_not_plotted(fp16_run):
    _, ea, _ = fp16_run
    by_step = {e.step: e.histogram_value for e in ea.Histograms("mpt/grad_exponent/net.3.weight")}
    for step in range(8):
        h = by_step[step]
        assert (h.min, h.max) == (-27.0, 19.0)  # the axis spans the whole fp16 range
        assert h.bucket_limit[-1] == 19.0
        assert h.bucket[-1] == (1.0 if step in (2, 5) else 0.0)
        assert h.num == 4 * 32
    values = {e.step: e.histogram_value for e in ea.Histograms("mpt/grad/net.3.weight")}
    assert values[2].num == values[5].num == 4 * 32 - 1
    assert values[3].num == 4 * 32
    assert all(math.isfinite(values[s].min) and math.isfinite(values[s].max) for s in values)
    # the fractions at the injected steps still come out (over the stored values)
    overflow = dict(series(ea, "mpt/grad_overflow_fraction/net.3.weight"))
    assert overflow[2] == overflow[5] == 1 / 128
    assert overflow[3] == 0.0


def test_update_underflow_logged_on_clean_steps_only(fp16_run):
    _, ea, _ = fp16_run
    steps = [s for s, _ in series(ea, "mpt/update_underflow_fraction")]
    assert steps == [0, 1, 3, 4, 6, 7]  # steps 2 and 5 were skipped: nothing was updated
    assert all(0.0 <= v <= 1.0 for _, v in series(ea, "mpt/update_underflow_fraction"))


def test_dashboard_layout_written_once(fp16_run):
    _, ea, _ = fp16_run
    (layout,) = layouts(ea)
    assert [c.title for c in layout.category] == [CATEGORY] == ["Mixed precision"]
    charts = {c.title: list(c.multiline.tag) for c in layout.category[0].chart}
    assert charts[SCALE_TITLE] == ["mpt/loss_scale_log2$"]
    assert "mpt/skipped_steps$" in charts["Skipped steps (cumulative) and overflows (0/1)"]
    assert any("mpt/grad_underflow_fraction$" in tags for tags in charts.values())
    assert any("mpt/update_underflow_fraction$" in tags for tags in charts.values())


def test_dashboard_written_once_per_run_across_fits(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="", version=0)
    for _ in range(2):  # e.g. a second fit continuing with the same logger
        monitors = [LossScaleMonitor(), GradientHistogramMonitor(values=False)]
        trainer = quiet_trainer(plugins=[MPTPrecision("bf16")], callbacks=monitors, logger=logger, max_steps=1)
        trainer.fit(TinyMLP(), regression_data())
    (layout,) = layouts(read_events(logger.log_dir))
    assert [c.title for c in layout.category[0].chart][:2] == [
        SCALE_TITLE,
        "Skipped steps (cumulative) and overflows (0/1)",
    ]
    assert not any("fraction" in c.title for c in layout.category[0].chart)  # only the monitors present


def test_every_tensorboard_logger_gets_the_tags_and_one_layout(tmp_path):
    """``Trainer(logger=[TensorBoardLogger(a), TensorBoardLogger(b)])``: both runs hold the same scalars, histograms
    and records, and one dashboard layout each."""
    loggers = [TensorBoardLogger(str(tmp_path / name), name="", version=0) for name in ("a", "b")]
    monitors = [LossScaleMonitor(), GradientHistogramMonitor(every_n_steps=1), UnderflowMonitor(every_n_steps=1)]
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**20))  # overflows: skip records too
    trainer = quiet_trainer(plugins=[plugin], callbacks=monitors, logger=loggers, max_steps=4)
    trainer.fit(TinyMLP(), regression_data())
    a, b = (read_events(lg.log_dir) for lg in loggers)
    assert "mpt/loss_scale" in a.Tags()["scalars"]
    assert a.Tags()["scalars"] == b.Tags()["scalars"]
    for tag in a.Tags()["scalars"]:
        assert series(a, tag) == series(b, tag), tag
    assert a.Tags()["histograms"]
    assert a.Tags()["histograms"] == b.Tags()["histograms"]
    assert records(a, "mpt/data/skipped_step") == records(b, "mpt/data/skipped_step")
    assert records(a, "mpt/data/run") == records(b, "mpt/data/run")
    assert len(layouts(a)) == len(layouts(b)) == 1


# ---------------------------------------------------------------------- the fp32 reference: same batch, no trace
class Dropper(L.LightningModule):
    """Dropout, BatchNorm, a torchmetrics metric, self.log calls and a record of the random draws of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn, self.drop, self.l2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.Linear(32, 4)
        self.mean_loss = torchmetrics.MeanMetric()
        self.draws: list[float] = []
        self.draws_after: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.draws.append(torch.rand(()).item())
        loss = nn.functional.mse_loss(self.l2(self.drop(torch.relu(self.bn(self.l1(x))))), y)
        self.mean_loss.update(loss.detach().float())
        self.log("calls", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("mean_loss", self.mean_loss, on_step=False, on_epoch=True)
        return loss

    def on_after_backward(self) -> None:
        self.draws_after.append(torch.rand(()).item())  # between the step's forward and the reference re-run

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _dropper_run(tmp_path: Any, monitor: bool):
    torch.manual_seed(0)
    model = Dropper()
    callbacks = [UnderflowMonitor(every_n_steps=1, reference_every_n_steps=1)] if monitor else []
    trainer, ea = fit(
        model, tmp_path, callbacks, MPTPrecision("fp16"), steps=4, max_epochs=1, data=regression_data(n=64)
    )
    return trainer, ea, model


def test_reference_leaves_no_trace(tmp_path):
    _, _, plain = _dropper_run(tmp_path / "plain", monitor=False)
    trainer, ea, watched = _dropper_run(tmp_path / "watched", monitor=True)
    # the re-run replays each batch's RNG state: its draw equals the real call's, and training continues unchanged
    real, replayed = watched.draws[0::2], watched.draws[1::2]
    assert len(watched.draws) == 8
    assert real == replayed == plain.draws
    assert watched.draws_after == plain.draws_after
    # weights, BatchNorm statistics, optimizer state and logged metrics are those of the run without the monitor
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a, b), name
    opt_a, opt_b = plain.trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict()
    for key, state in opt_a["state"].items():
        for k, v in state.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt_b["state"][key][k])), (key, k)
    assert plain.trainer.logged_metrics.keys() == trainer.logged_metrics.keys()
    assert trainer.logged_metrics["calls"] == 4.0  # the re-run's self.log calls never reached the results
    assert torch.equal(plain.trainer.logged_metrics["mean_loss"], trainer.logged_metrics["mean_loss"])
    assert [s for s, _ in series(ea, "mpt/grad_underflow_fraction")] == [0, 1, 2, 3]


class TinyGrads(TinyMLP):
    """Gradients around fp16's flush threshold: a static scale of 1 loses part of them."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * 2e-6


class ReferenceProbe(L.Callback):
    """An independent fp32 reference: a fresh fp32 model loaded with the masters, the same batch, flush counts."""

    def __init__(self, monitor: UnderflowMonitor) -> None:
        self.monitor = monitor
        self.pairs: list[tuple[list[int], list[int]]] = []
        self.batch: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = batch

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        plugin = trainer.precision_plugin
        fresh = TinyMLP()
        state = {name: p.detach() for name, p in pl_module.named_parameters() if p.dtype == torch.float32}
        state.update({name: m.detach() for name, _, m in plugin.named_masters()})
        fresh.load_state_dict(state)
        x, y = self.batch
        loss = nn.functional.mse_loss(fresh(x), y) * 2e-6 / trainer.accumulate_grad_batches
        grads = torch.autograd.grad(loss, [dict(fresh.named_parameters())[n] for n in HALF_PARAMS])
        measured = self.monitor.last_reference
        expected = flush_counts(grads, plugin.loss_scale, FP16)[:, 1].tolist()
        self.pairs.append((expected, measured.local_flushed.tolist()))
        top = torch.stack([g.abs().max() for g in grads]) * plugin.loss_scale
        torch.testing.assert_close(measured.max_scaled, top, rtol=1e-6, atol=0)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_reference_flush_matches_independent_fp32_gradient(tmp_path, accumulate):
    monitor = UnderflowMonitor(every_n_steps=1, reference_every_n_steps=1)
    probe = ReferenceProbe(monitor)
    plugin = MPTPrecision("fp16", scaler=1.0)
    trainer, ea = fit(TinyGrads(), tmp_path, [monitor, probe], plugin, steps=3, accumulate_grad_batches=accumulate)
    assert len(probe.pairs) == 3
    for expected, measured in probe.pairs:
        assert measured == expected
    logged = series(ea, "mpt/grad_underflow_fraction")
    assert [s for s, _ in logged] == [0, 1, 2]
    assert 0.05 < logged[-1][1] < 0.95  # a real mix of kept and flushed values
    assert logged[-1][1] == pytest.approx(monitor.last_reference.flush_fraction)
    # the stored half gradients agree: the flushed values are zeros there
    zero = dict(series(ea, "mpt/grad_zero_fraction"))
    assert zero[2] >= logged[-1][1] * 0.5


def test_nan_batch_never_crashes_and_is_reported(tmp_path):
    data = regression_data(n=64)
    x, y = data.dataset.tensors
    x[2 * 16 + 3, 5] = math.nan  # batch 2 holds a NaN: non-finite loss and gradients, also in the fp32 reference
    monitors = [
        LossScaleMonitor(),
        GradientHistogramMonitor(every_n_steps=1),
        UnderflowMonitor(every_n_steps=1, reference_every_n_steps=1),
    ]
    trainer, ea = fit(TinyMLP(), tmp_path, monitors, MPTPrecision("fp16"), steps=4, data=data)
    assert series(ea, "mpt/loss_nonfinite") == [(2, 1.0)]
    assert "loss **non-finite**" in texts(ea, "mpt/nonfinite_params")[0][1]
    assert [s for s, _ in series(ea, "mpt/scale_headroom")] == [0, 1, 3]  # no headroom from a NaN reference
    assert [s for s, _ in series(ea, "mpt/grad_underflow_fraction")] == [0, 1, 2, 3]
    assert {e.step for e in ea.Histograms("mpt/grad/net.0.weight")} == {0, 1, 3}  # nothing finite at step 2


# ------------------------------------------------------------------------------------- Lightning's "16-mixed"
def test_grad_scaler_overflows_named_and_scale_series(tmp_path):
    probe = ScaleProbe()
    monitors = [
        LossScaleMonitor(),
        UnderflowMonitor(every_n_steps=1, reference_every_n_steps=2),
        GradientHistogramMonitor(every_n_steps=3),
    ]
    inject = InjectNonFinite("net.0.bias", {1: math.inf, 4: math.inf})
    plugin = MixedPrecision("16-mixed", "cpu")
    trainer, ea = fit(TinyMLP(), tmp_path, [inject, probe, *monitors], plugin, steps=6)
    assert series(ea, "mpt/loss_scale") == probe.scales
    assert [s for _, s in probe.scales] == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0, 16384.0]
    assert series(ea, "mpt/overflow") == [(s, float(s in (1, 4))) for s in range(6)]
    assert monitors[0].overflow_counts == {"net.0.bias": 2}
    assert series(ea, "mpt/loss_nonfinite") == [(1, 0.0), (4, 0.0)]
    tags = set(ea.Tags()["scalars"])
    assert {"mpt/grad_underflow_fraction", "mpt/grad_zero_fraction", "mpt/update_underflow_fraction"} <= tags
    assert "mpt/grad_zero_fraction/net.1.weight" not in tags  # autocast runs LayerNorm in fp32
    assert {e.step for e in ea.Histograms("mpt/grad_exponent/net.0.weight")} == {0, 3}


# ------------------------------------------------------------------------------------------- other set-ups
class TwoOptimizers(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 4)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y))
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


def test_manual_optimization_several_steps_per_batch(tmp_path):
    monitors = [LossScaleMonitor(), UnderflowMonitor(every_n_steps=2), GradientHistogramMonitor(every_n_steps=2)]
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**8, growth_interval=3))
    with pytest.warns(UserWarning, match="manual optimization"):
        trainer, ea = fit(TwoOptimizers(), tmp_path, monitors, plugin, steps=8)
    history = [(r.step, r.scale) for r in trainer.precision_plugin.history]
    assert len(history) == 8
    assert series(ea, "mpt/loss_scale") == history
    assert "mpt/grad_zero_fraction" in ea.Tags()["scalars"]


def test_bf16_and_csv_logger_fallback(tmp_path):
    monitors = [LossScaleMonitor(), UnderflowMonitor(every_n_steps=2, reference_every_n_steps=2)]
    logger = CSVLogger(str(tmp_path), name="", version=0)
    trainer = quiet_trainer(plugins=[MPTPrecision("bf16")], callbacks=monitors, logger=logger, max_steps=4)
    trainer.fit(TinyMLP(), regression_data())
    header, *rows = Path(logger.log_dir, "metrics.csv").read_text().splitlines()
    columns = header.split(",")
    assert {"mpt/loss_scale", "mpt/grad_underflow_fraction", "mpt/grad_zero_fraction/net.0.weight"} <= set(columns)
    scales = [r.split(",")[columns.index("mpt/loss_scale")] for r in rows]
    assert [float(s) for s in scales if s] == [1.0] * 4  # bf16: no scaling
    assert monitors[1].last_reference.flush_fraction == 0.0  # bf16 keeps tiny values


class QueueProbe(L.Callback):
    """After every monitor's batch end: how much the monitors' read-out still holds."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor, self.queued = monitor, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.queued.append(len(self.monitor.recorder))


def test_without_logger_warns_and_trains(tmp_path):
    monitors = [LossScaleMonitor(), GradientHistogramMonitor(every_n_steps=1), UnderflowMonitor(every_n_steps=1)]
    probe = QueueProbe(monitors[0])
    trainer = quiet_trainer(plugins=[MPTPrecision("fp16")], callbacks=[*monitors, probe], max_steps=2)
    with pytest.warns(UserWarning, match="no logger"):
        trainer.fit(TinyMLP(), regression_data())
    assert trainer.global_step == 2
    assert probe.queued == [0, 0]
    assert all(m.group is None for m in monitors)  # the group is dissolved at teardown


def test_full_precision_plugin_warns(tmp_path):
    with pytest.warns(UserWarning, match="no loss scaler"):
        fit(TinyMLP(), tmp_path, [LossScaleMonitor(), UnderflowMonitor(every_n_steps=1)], "32-true", steps=2)


def test_group_by_module(tmp_path):
    monitor = GradientHistogramMonitor(every_n_steps=2, group_by="module", bins=8)
    _, ea = fit(TinyMLP(), tmp_path, [monitor], MPTPrecision("fp16"), steps=3)
    histograms = set(ea.Tags()["histograms"])
    assert {"mpt/grad/net.0", "mpt/grad/net.1", "mpt/grad/net.3"} <= histograms
    assert {"mpt/grad_exponent/net.0", "mpt/grad_exponent/net.3"} == {t for t in histograms if "exponent" in t}
    (h,) = [e.histogram_value for e in ea.Histograms("mpt/grad/net.0") if e.step == 2]
    assert h.num == 16 * 32 + 32
    assert len(h.bucket) <= 8
    (legend,) = texts(ea, "mpt/legend/grad_exponent")
    assert "min subnormal 2^-24 = 5.96e-08" in legend[1]
    assert "65504" in legend[1]


# -------------------------------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize(
    "read",
    [
        bool,
        float,
        int,
        lambda t: t.item(),
        lambda t: t.tolist(),
        lambda t: t.cpu(),
        lambda t: t.numpy(),
        lambda t: t.nonzero(),
        lambda t: torch.nonzero(t),
        lambda t: t.unique(),
        lambda t: [1, 2][t],
        lambda t: torch.masked_select(t, t > 0),
    ],
    ids=[
        "bool",
        "float",
        "int",
        "item",
        "tolist",
        "cpu",
        "numpy",
        "nonzero",
        "torch.nonzero",
        "unique",
        "index",
        "masked_select",
    ],
)
def test_sync_counter_counts_every_host_read(read):
    t = torch.ones((), dtype=torch.long)
    with HostSyncCounter() as syncs:
        read(t)
    assert syncs.count == 1
    with HostSyncCounter() as syncs:
        t + 1, t.to(torch.float64), torch.stack([t, t]).sum(), t.device  # device work only
    assert syncs.count == 0


MONITOR_ORDERS = {
    "loss-hist-underflow": (0, 1, 2),
    "underflow-loss-hist": (2, 0, 1),  # the barrier does not depend on which monitor reports last
}


@pytest.mark.parametrize("order", MONITOR_ORDERS.values(), ids=MONITOR_ORDERS.keys())
def test_one_host_sync_per_logging_step_for_all_statistics(tmp_path, order):
    """Every monitor logging every step, reference included: one host read more per step than without them."""

    def syncs_per_run(callbacks: list, sub: str) -> int:
        with HostSyncCounter() as syncs:
            fit(TinyMLP(), tmp_path / sub, callbacks, MPTPrecision("fp16"), steps=6, log_every_n_steps=100)
        return syncs.count

    base = syncs_per_run([], "base")
    monitors = [
        LossScaleMonitor(),
        GradientHistogramMonitor(every_n_steps=1),
        UnderflowMonitor(every_n_steps=1, reference_every_n_steps=1),
    ]
    assert syncs_per_run([monitors[i] for i in order], "all") - base == 6


# -------------------------------------------------------------------------------------------- arguments, misc
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LossScaleMonitor(every_n_steps=0), r"every_n_steps=0\): expected an int >= 1"),
        (lambda: UnderflowMonitor(every_n_steps=-1), r"None \(the Trainer's log_every_n_steps\)"),
        (lambda: UnderflowMonitor(reference_every_n_steps=1.5), r"0 \(off\)"),
        (lambda: GradientHistogramMonitor(group_by="layer"), r"\['parameter', 'module'\]"),
        (lambda: GradientHistogramMonitor(bins=0), r"bins=0"),
        (lambda: TensorCoreCheck(multiple=True), r"multiple=True"),
    ],
)
def test_bad_arguments_say_what_is_accepted(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_tensor_core_check(tmp_path):
    model = nn.Sequential(nn.Linear(16, 10), nn.Conv2d(3, 16, 3), nn.MultiheadAttention(24, 2), nn.Linear(8, 8))
    found = {f.name: f.dims for f in tensor_core_report(model, batch_size=12)}
    assert found == {
        "0": {"out_features": 10},
        "1": {"in_channels/groups": 3},
        "2": {"head_dim": 12},
        "batch size": {"batch_size": 12},
    }
    check = TensorCoreCheck()
    with pytest.warns(UserWarning, match=r"net.3 \(Linear\): out_features=4"):
        _, ea = fit(TinyMLP(), tmp_path, [check], MPTPrecision("bf16"), steps=1)
    assert [f.name for f in check.findings] == ["net.3"]
    assert "out_features=4" in texts(ea, "mpt/tensor_cores")[0][1]


def test_loss_scale_monitor_state_roundtrip():
    m = LossScaleMonitor()
    m.overflows, m.overflow_counts["a.weight"] = 3, 3
    other = LossScaleMonitor()
    other.load_state_dict(m.state_dict())
    assert other.overflows == 3
    assert other.overflow_counts == {"a.weight": 3}


# ------------------------------------------------------------ edge cases: no model shape stops the monitors
class ScalarParam(L.LightningModule):
    """One zero-dimensional parameter: the whole half-precision table is a single 0-dim tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(x.sum(1) * self.w, y[:, 0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class OddParams(L.LightningModule):
    """A used layer, an unused one (no gradient), a frozen one (no gradient, not stepped) and an empty parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused, self.frozen = nn.Linear(16, 4), nn.Linear(16, 4), nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.empty = nn.Parameter(torch.zeros(0))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.used(self.frozen(x)), y) + self.empty.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class NormOnly(L.LightningModule):
    """Only a LayerNorm: no parameter is computed in half precision."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.norm(x)[:, :4], y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


EDGE_PLUGINS = {
    "fp16": lambda: MPTPrecision(
        "fp16", scaler=DynamicLossScaler(init_scale=2.0**8)
    ),  # no overflow: every step measured
    "bf16": lambda: MPTPrecision("bf16"),
    "16-mixed": lambda: MixedPrecision("16-mixed", "cpu"),
}
MEASURED = {ScalarParam: ["w"], OddParams: ["used.weight", "used.bias"], NormOnly: []}


@pytest.mark.parametrize("plugin", EDGE_PLUGINS, ids=list(EDGE_PLUGINS))
@pytest.mark.parametrize("model_class", MEASURED, ids=lambda c: c.__name__)
def test_every_statistic_on_edge_case_models(tmp_path, model_class, plugin):
    """Strict (the suite's default): any internal error in a monitor fails the test."""
    monitors = [
        LossScaleMonitor(),
        GradientHistogramMonitor(every_n_steps=1),
        UnderflowMonitor(every_n_steps=1, reference_every_n_steps=1),
    ]
    measured = MEASURED[model_class]
    if measured:
        trainer, ea = fit(model_class(), tmp_path, monitors, EDGE_PLUGINS[plugin](), steps=3)
    else:
        with pytest.warns(UserWarning, match="no parameter is computed in"):
            trainer, ea = fit(model_class(), tmp_path, monitors, EDGE_PLUGINS[plugin](), steps=3)
    assert trainer.global_step == 3
    scalars = set(ea.Tags()["scalars"])
    assert [s for s, _ in series(ea, "mpt/loss_scale")] == [0, 1, 2]
    for tag in ("mpt/grad_zero_fraction", "mpt/grad_underflow_fraction", "mpt/update_underflow_fraction"):
        assert {t for t in scalars if t.startswith(tag + "/")} == {f"{tag}/{n}" for n in measured}
        assert (tag in scalars) == bool(measured)
    histograms = set(ea.Tags()["histograms"])
    assert {t for t in histograms if t.startswith("mpt/grad_exponent/")} == {f"mpt/grad_exponent/{n}" for n in measured}
    assert {"mpt/grad/" + n for n in measured} <= histograms
    if measured:
        ref = monitors[2].last_reference
        assert ref.step == 2
        assert set(measured) <= set(ref.names)
        assert ref.nonzero.shape == ref.flushed.shape == ref.max_scaled.shape == (len(ref.names),)  # 1-D, also for one


# --------------------------------------------------------- an internal error: one warning, that statistic off
class HardCodedHalf(TinyMLP):
    """A user model that casts its input to fp16 itself. Under the plugin the weights are fp16 too; the fp32
    reference re-run of ``training_step`` multiplies fp16 inputs with fp32 weights and raises a dtype error."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x.to(torch.float16)).float(), y)


def test_internal_error_is_one_warning_and_turns_only_that_statistic_off(tmp_path):
    monitors = [
        LossScaleMonitor(strict=False),
        GradientHistogramMonitor(every_n_steps=1, strict=False),
        UnderflowMonitor(every_n_steps=1, reference_every_n_steps=1, strict=False),
    ]
    with pytest.warns(DiagnosticsWarning) as caught:
        trainer, ea = fit(HardCodedHalf(), tmp_path, monitors, MPTPrecision("fp16"), steps=4)
    (warning,) = [w for w in caught if issubclass(w.category, DiagnosticsWarning)]  # one, although 4 steps failed
    message = str(warning.message)
    assert message.startswith("UnderflowMonitor: the fp32 reference (mpt/grad_underflow_fraction, mpt/scale_headroom)")
    assert "Traceback (most recent call last)" in message
    assert "in _reference_grads" in message
    assert "RuntimeError" in message
    assert "LIGHTNING_MPT_STRICT_DIAGNOSTICS=1" in message
    assert trainer.global_step == 4  # training went on
    underflow = monitors[2]
    assert not underflow.reference_stat.enabled
    assert underflow.last_reference is None
    assert underflow.stored_stat.enabled
    assert underflow.update_stat.enabled
    assert underflow.setup_stat.enabled
    # the reference's tags are missing, everything else was written at every step
    scalars = set(ea.Tags()["scalars"])
    assert "mpt/grad_underflow_fraction" not in scalars
    assert "mpt/scale_headroom" not in scalars
    for tag in (
        "mpt/loss_scale",
        "mpt/grad_zero_fraction",
        "mpt/grad_subnormal_fraction",
        "mpt/update_underflow_fraction",
    ):
        assert [s for s, _ in series(ea, tag)] == [0, 1, 2, 3], tag
    assert {e.step for e in ea.Histograms("mpt/grad_exponent/net.0.weight")} == {0, 1, 2, 3}


def test_strict_reraises_the_internal_error(tmp_path):
    monitor = UnderflowMonitor(every_n_steps=1, reference_every_n_steps=1)  # strict from the environment
    with pytest.raises(RuntimeError, match="dtype"):
        fit(HardCodedHalf(), tmp_path, [LossScaleMonitor(), monitor], MPTPrecision("fp16"), steps=2)


def test_strict_switch_environment_and_argument(monkeypatch):
    monkeypatch.delenv(STRICT_ENV)
    assert not Statistic("m", "x").strict
    assert Statistic("m", "x", strict=True).strict
    monkeypatch.setenv(STRICT_ENV, "1")
    assert Statistic("m", "x").strict
    assert not Statistic("m", "x", strict=False).strict


class Broken(Statistic):
    """A statistic whose consumer raises: what any bug in a write-out would do."""

    def consume(self, values: list[float]) -> None:
        raise ZeroDivisionError("broken consumer")


def test_recorder_turns_off_only_the_failing_consumer(tmp_path):
    written: list[list[float]] = []
    good, bad = Statistic("m", "good", strict=False), Broken("m", "bad", strict=False)
    recorder = Recorder(Sink())
    for step in range(2):
        recorder.queue(good, torch.tensor([1.0, 2.0]), written.append)
        if bad.enabled:
            recorder.queue(bad, torch.tensor([3.0]), bad.consume)
        with (
            pytest.warns(DiagnosticsWarning, match="m: bad failed with ZeroDivisionError")
            if step == 0
            else _no_warning()
        ):
            recorder.flush()
    assert written == [[1.0, 2.0], [1.0, 2.0]]
    assert recorder.syncs == 2
    assert good.enabled
    assert not bad.enabled
    assert isinstance(bad.error, ZeroDivisionError)
    strict = Broken("m", "bad", strict=True)
    recorder.queue(strict, torch.tensor([3.0]), strict.consume)
    with pytest.raises(ZeroDivisionError):
        recorder.flush()


class _no_warning:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error", DiagnosticsWarning)

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


# -------------------------------------------------------------------------------------------- the monitor group
class GroupProbe(L.Callback):
    def __init__(self, monitors: list) -> None:
        self.monitors, self.groups = monitors, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.groups.append([m.group for m in self.monitors])


def test_monitors_share_one_group_formed_by_the_first_and_dissolved_at_teardown(tmp_path):
    monitors = [UnderflowMonitor(every_n_steps=1), LossScaleMonitor(), GradientHistogramMonitor(every_n_steps=1)]
    probe = GroupProbe(monitors)
    fit(TinyMLP(), tmp_path / "a", [monitors[0], probe, *monitors[1:]], MPTPrecision("fp16"), steps=2)
    (group,) = {id(g) for step in probe.groups for g in step}  # one group, the same at every step
    first = probe.groups[0][0]
    assert first.owner is monitors[0]
    assert first.members == monitors
    assert all(m.group is None for m in monitors)
    # the same monitors in a second fit form a new group
    fit(TinyMLP(), tmp_path / "b", [*monitors, probe], MPTPrecision("fp16"), steps=1)
    assert probe.groups[-1][0] is not first
    assert len({id(g) for g in probe.groups[-1]}) == 1


# ------------------------------------------------------------------------------------- records for programs
def test_records_of_skipped_steps_summary_and_run(fp16_run):
    trainer, ea, monitors = fp16_run
    history = {r.step: r for r in trainer.precision_plugin.history}
    skips = records(ea, "mpt/data/skipped_step")
    assert [s for s, _ in skips] == [2, 5]
    for step, r in skips:
        assert r == {
            "schema": 1,
            "step": step,
            "scale": history[step].scale,
            "scale_after": history[step + 1].scale,
            "params": ["net.3.weight"],
            "loss_finite": True,
        }
    ((_, summary),) = records(ea, "mpt/data/overflow_summary")
    assert summary == {"schema": 1, "step": 8, "skipped_steps": 2, "params": {"net.3.weight": 2}}
    ((_, run),) = records(ea, "mpt/data/run")
    assert run == {
        "schema": 1,
        "format": "fp16",
        "plugin": "MPTPrecision",
        "precision": "16-mixed",
        "loss_scaling": "dynamic",
        "scaler": {
            "scale": 2.0**10,
            "growth_interval": 2,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "hysteresis": 1,
            "min_scale": 1.0,
            "max_scale": 2.0**24,
        },
        "master_weights": True,
        "master_remainders": False,
        "chunked_step": False,
        "fp8": None,
        "monitors": ["LossScaleMonitor", "GradientHistogramMonitor", "UnderflowMonitor"],
    }
    assert "mpt/data/stopped" not in ea.Tags()["tensors"]


def test_guard_stop_is_recorded(tmp_path):
    inject = InjectNonFinite("net.0.bias", dict.fromkeys(range(1, 10), math.inf))
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**10), max_consecutive_skips=3)
    logger = TensorBoardLogger(str(tmp_path), name="", version=0)
    trainer = quiet_trainer(plugins=[plugin], callbacks=[inject, LossScaleMonitor()], logger=logger, max_steps=10)
    with pytest.raises(NonFiniteGradientError) as raised:
        trainer.fit(TinyMLP(), regression_data(n=160))
    ea = read_events(logger.log_dir)
    assert [s for s, _ in records(ea, "mpt/data/skipped_step")] == [1, 2, 3]  # the step that tripped it included
    ((step, stop),) = records(ea, "mpt/data/stopped")
    assert step == 3
    assert stop == {
        "schema": 1,
        "step": 3,
        "error": "NonFiniteGradientError",
        "message": str(raised.value),
    }
    assert "net.0.bias" in stop["message"]
    ((_, summary),) = records(ea, "mpt/data/overflow_summary")
    assert summary["skipped_steps"] == 3
    assert summary["params"] == {"net.0.bias": 3}
    assert series(ea, "mpt/overflow") == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 1.0)]
