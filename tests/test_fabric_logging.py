"""``MixedPrecisionLogger`` (the diagnostics for a Fabric loop) writes the tags and values of the Trainer callbacks.

The same model, batches and seed run through a ``Trainer`` with ``LossScaleMonitor``, ``UnderflowMonitor`` (fp32
reference every 2 steps) and ``GradientHistogramMonitor`` at every step, and through a Fabric loop with the logger at
every step and ``reference()`` every 2 steps; both under ``MPTPrecision("fp16")`` with a scale that starts too high
(skipped steps, culprits, back-offs) and under Lightning's own ``"16-mixed"`` (a ``GradScaler``). The two loops
compute the same steps bitwise: they run in this process one after the other (the same kernels and thread count) on
the same weights and batches with the same operations in the same order (the loss is fp32 in both), so every value,
the histograms' float64 sums included, must be equal. What legitimately differs:
the run record names the monitors (``["LossScaleMonitor", ...]`` / ``["MixedPrecisionLogger"]``).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from host_syncs import HostSyncCounter
from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from models import quiet_trainer, run_until_written
from tb_events import layouts, read_events, records, texts
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import DynamicLossScaler, MPTPrecision
from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor
from lightning_mpt.diagnostics import tags
from lightning_mpt.fabric import MixedPrecisionLogger
from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision
from lightning_mpt.report import build_report

STEPS = 8
REFERENCE_EVERY = 2
STEPS_DDP = 6  # tests/fabric_logging_worker.py


def batches() -> list[tuple[Tensor, Tensor]]:
    """Features 0-3 are 0 (zero gradients), 4-5 tiny (subnormal gradients once scaled to fp16, at large
    scales), 6-7 tinier
    (flushed)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x = torch.randn(16, 16, generator=g)
        x[:, :4] = 0.0
        x[:, 4:6] *= 1e-8
        x[:, 6:8] *= 1e-13
        out.append((x, torch.randn(16, 4, generator=g)))
    return out


def layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = layers()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = layers()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def compute_loss(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(module(x).float(), y)


SCALER = {"init_scale": 2.0**20, "growth_interval": 3}  # ours and torch's GradScaler (the reference) alike


def scaler() -> DynamicLossScaler:
    return DynamicLossScaler(**SCALER)


def grad_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **SCALER)


def trainer_run(root: Path, precision: str) -> Path:
    L.seed_everything(0, verbose=False)
    plugin = (
        MPTPrecision("fp16", scaler=scaler())
        if precision == "mpt"
        else MixedPrecision("16-mixed", "cpu", grad_scaler())
    )
    logger = TensorBoardLogger(root, name="trainer", version=0)
    trainer = quiet_trainer(
        plugins=[plugin],
        max_steps=STEPS,
        logger=logger,
        callbacks=[
            LossScaleMonitor(),
            UnderflowMonitor(every_n_steps=1, reference_every_n_steps=REFERENCE_EVERY),
            GradientHistogramMonitor(every_n_steps=1),
        ],
    )
    data = batches()
    loader = DataLoader(TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])), batch_size=16)
    trainer.fit(Lit(), loader)
    return Path(logger.log_dir)


def fabric_run(root: Path, precision: str) -> tuple[Path, MixedPrecisionLogger]:
    L.seed_everything(0, verbose=False)
    plugin = (
        FabricMPTPrecision("fp16", scaler=scaler())
        if precision == "mpt"
        else FabricMixedPrecision("16-mixed", "cpu", grad_scaler())
    )
    logger = FabricTensorBoardLogger(root, name="fabric", version=0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin], loggers=logger)
    model = Net()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    diagnostics = MixedPrecisionLogger(fabric, model, every_n_steps=1, histograms_every_n_steps=1)
    for step, (x, y) in enumerate(batches()):
        if step % REFERENCE_EVERY == 0:
            diagnostics.reference(compute_loss, x, y)
        loss = compute_loss(model, x, y)
        fabric.backward(loss)
        diagnostics.after_backward(loss)
        diagnostics.step(optimizer)
        optimizer.zero_grad()
    diagnostics.finalize()
    logger.finalize("success")
    if precision == "mpt":
        plugin.restore()
    return Path(logger.log_dir), diagnostics


@pytest.fixture(scope="module", params=["mpt", "16-mixed"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any, Path]:
    root = tmp_path_factory.mktemp(f"fabric-vs-trainer-{request.param}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer_dir = trainer_run(root, request.param)
        fabric_dir, diagnostics = fabric_run(root, request.param)
    return read_events(trainer_dir), read_events(fabric_dir), diagnostics, root


def test_same_scalars_with_the_same_values(runs):
    trainer, fabric, _, _ = runs
    names = set(trainer.Tags()["scalars"])
    assert names == set(fabric.Tags()["scalars"])
    expected = {tags.LOSS_SCALE, tags.SKIPPED_STEPS, tags.OVERFLOW, tags.NONFINITE_PARAMS, tags.LOSS_NONFINITE}
    expected |= {tags.GRAD_ZERO, tags.GRAD_SUBNORMAL, tags.GRAD_UNDERFLOW, tags.UPDATE_UNDERFLOW, tags.SCALE_HEADROOM}
    assert expected <= names
    assert tags.per_parameter(tags.GRAD_UNDERFLOW, "net.0.weight") in names
    for tag in sorted(names):
        a, b = [(e.step, e.value) for e in trainer.Scalars(tag)], [(e.step, e.value) for e in fabric.Scalars(tag)]
        assert [s for s, _ in a] == [s for s, _ in b], tag
        assert all(x == y or (math.isnan(x) and math.isnan(y)) for (_, x), (_, y) in zip(a, b)), (tag, a, b)
    skipped = [e.value for e in fabric.Scalars(tags.OVERFLOW)]
    assert any(skipped)
    assert not all(skipped)
    assert any(0 < e.value < 1 for e in fabric.Scalars(tags.GRAD_UNDERFLOW))  # the reference sees flushed values
    assert any(0 < e.value < 1 for e in fabric.Scalars(tags.GRAD_SUBNORMAL))
    assert [e.step for e in fabric.Scalars(tags.GRAD_UNDERFLOW)] == list(range(0, STEPS, REFERENCE_EVERY))


def test_same_histograms(runs):
    trainer, fabric, _, _ = runs
    names = set(trainer.Tags()["histograms"])
    assert names == set(fabric.Tags()["histograms"])
    assert tags.per_parameter(tags.GRAD_EXPONENT, "net.3.weight") in names
    assert tags.per_parameter(tags.GRAD_HIST, "net.1.weight") in names  # value histograms: every parameter
    for tag in sorted(names):
        a, b = trainer.Histograms(tag), fabric.Histograms(tag)
        assert a, tag
        assert [e.step for e in a] == [e.step for e in b], tag
        for x, y in zip(a, b):
            assert x.histogram_value == y.histogram_value, (tag, x.step)


def test_same_texts_records_and_dashboard(runs):
    trainer, fabric, _, _ = runs
    for tag in (tags.SKIP_RECORD, tags.SUMMARY_RECORD):
        assert records(trainer, tag) == records(fabric, tag), tag
    (run_t,), (run_f,) = records(trainer, tags.RUN_RECORD), records(fabric, tags.RUN_RECORD)
    assert run_t[1]["monitors"] == ["LossScaleMonitor", "UnderflowMonitor", "GradientHistogramMonitor"]
    assert run_f[1]["monitors"] == ["MixedPrecisionLogger"]
    assert {**run_t[1], "monitors": None} == {**run_f[1], "monitors": None}
    for tag in (tags.NONFINITE_TEXT, tags.EXPONENT_LEGEND, tags.OVERFLOW_SUMMARY):
        assert texts(trainer, tag) == texts(fabric, tag), tag
    assert [str(x) for x in layouts(trainer)] == [str(x) for x in layouts(fabric)]
    assert len(layouts(fabric)) == 1


def test_one_host_read_per_step_and_the_report_reads_it(runs):
    _, _, diagnostics, root = runs
    assert diagnostics.recorder.syncs == STEPS
    report = build_report(root)
    by_run = {Path(r.run).parts[0]: r for r in report.runs}
    a, b = by_run["trainer"], by_run["fabric"]
    assert (a.steps, a.skipped_steps, a.scale, a.flush, a.nonfinite_params) == (
        b.steps,
        b.skipped_steps,
        b.scale,
        b.flush,
        b.nonfinite_params,
    )
    assert a.worst_underflow == b.worst_underflow
    assert b.steps == STEPS
    assert b.skipped_steps > 0


def test_one_host_read_per_logging_step_counting_every_read(tmp_path):
    """Every statistic at every step, the fp32 reference included: one host read more per step than the same loop
    without the logger (counted over every way torch reads a tensor's values), and at each skipped step one more: the
    names of the parameters at fault (``StepRecord.nonfinite_params``), as with ``LossScaleMonitor``."""
    skipped: list[int] = []

    def reads(log: bool) -> int:
        L.seed_everything(0, verbose=False)
        plugin = FabricMPTPrecision("fp16", scaler=scaler())
        fabric = L.Fabric(accelerator="cpu", plugins=[plugin], loggers=FabricTensorBoardLogger(tmp_path, name=str(log)))
        model = Net()
        model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        diagnostics = MixedPrecisionLogger(fabric, model, every_n_steps=1, histograms_every_n_steps=1) if log else None
        with HostSyncCounter() as syncs:
            for x, y in batches():
                if diagnostics is not None:
                    diagnostics.reference(compute_loss, x, y)
                fabric.backward(compute_loss(model, x, y))
                if diagnostics is not None:
                    diagnostics.after_backward()
                    diagnostics.step(optimizer)
                else:
                    optimizer.step()
                optimizer.zero_grad()
        skipped.append(plugin.skipped_steps)
        plugin.restore()
        return syncs.count

    extra = reads(True) - reads(False)
    assert skipped[0] == skipped[1] > 0
    assert extra == STEPS + skipped[0]


# ------------------------------------------------------------------------------------------------ edge cases
def small_fabric(tmp_path: Path, **logger: Any) -> tuple[L.Fabric, nn.Module, Any, MixedPrecisionLogger]:
    fabric = L.Fabric(
        accelerator="cpu", plugins=[FabricMPTPrecision("bf16")], loggers=FabricTensorBoardLogger(tmp_path, name="r")
    )
    model = Net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return fabric, model, optimizer, MixedPrecisionLogger(fabric, model, **logger)


def test_the_guard_stop_is_recorded_and_reraised(tmp_path):
    fabric = L.Fabric(
        accelerator="cpu",
        plugins=[FabricMPTPrecision("fp16", scaler=1024.0, max_consecutive_skips=2)],
        loggers=FabricTensorBoardLogger(tmp_path, name="r", version=0),
    )
    model = Net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    diagnostics = MixedPrecisionLogger(fabric, model, every_n_steps=1)
    x, y = batches()[0]
    from lightning_mpt import NonFiniteGradientError

    with pytest.raises(NonFiniteGradientError):
        for _ in range(3):
            fabric.backward(compute_loss(model, x, y))
            model.module.net[3].weight.grad[0, 0] = math.inf
            diagnostics.after_backward()
            diagnostics.step(optimizer)
            optimizer.zero_grad()
    fabric.strategy.precision.restore()
    ea = read_events(tmp_path / "r" / "version_0")
    ((step, stop),) = records(ea, tags.STOP_RECORD)
    assert (step, stop["error"]) == (1, "NonFiniteGradientError")
    assert records(ea, tags.SUMMARY_RECORD)[-1][1]["params"] == {"net.3.weight": 2}
    assert [e.value for e in ea.Scalars(tags.SKIPPED_STEPS)] == [1.0, 2.0]


def test_after_backward_twice_in_a_step_warns_and_measures_once(tmp_path):
    fabric, model, optimizer, diagnostics = small_fabric(tmp_path, every_n_steps=1, histograms_every_n_steps=0)
    x, y = batches()[0]
    fabric.backward(compute_loss(model, x, y))
    diagnostics.after_backward()
    fabric.backward(compute_loss(model, x, y))
    with pytest.warns(UserWarning, match="called twice in step 0"):
        diagnostics.after_backward()
    assert len(diagnostics.recorder) == 1  # the fractions of the first call only
    diagnostics.step(optimizer)
    fabric.strategy.precision.restore()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "every_n_steps=0"),
        ({"histograms_every_n_steps": -1}, "histograms_every_n_steps=-1"),
        ({"group_by": "layer"}, "group_by='layer'"),
    ],
)
def test_bad_arguments_say_what_is_accepted(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        small_fabric(tmp_path, **kwargs)


# ------------------------------------------------------------------------------------------------ DDP
@pytest.mark.ddp
@pytest.mark.slow
def test_fabric_ddp_rank_zero_writes_and_the_reference_is_summed_across_ranks(tmp_path):
    files = [tmp_path / "rank0.json", tmp_path / "rank1.json"]
    worker = Path(__file__).with_name("fabric_logging_worker.py")
    code = run_until_written([sys.executable, str(worker), str(tmp_path)], files, tmp_path / "log.txt")
    if not all(f.exists() for f in files):
        pytest.fail(f"workers did not finish (exit {code}):\n{(tmp_path / 'log.txt').read_text()[-3000:]}")
    r0, r1 = (json.loads(f.read_text()) for f in files)
    assert r0["references"] == r1["references"] == [0, 2, 4]
    # rank 1's reference gradients all flush, rank 0's cannot all (the worker): different by construction
    assert r1["local_flushed"] == r1["local_nonzero"]
    assert sum(r1["local_nonzero"]) > 0
    assert sum(r0["local_flushed"]) < sum(r0["local_nonzero"])
    assert r0["flushed"] == r1["flushed"] == [a + b for a, b in zip(r0["local_flushed"], r1["local_flushed"])]
    assert r0["nonzero"] == [a + b for a, b in zip(r0["local_nonzero"], r1["local_nonzero"])]
    assert r0["syncs"] == STEPS_DDP  # one host read per step on rank 0; rank 1 writes nothing and reads nothing
    assert r1["syncs"] == 0
    events = sorted(tmp_path.rglob("events.out.tfevents.*"))
    assert len(events) == 1
    assert events[0].name.split(".")[-2] == str(r0["pid"])
    ea = read_events(events[0].parent)
    flush = {e.step: e.value for e in ea.Scalars(tags.GRAD_UNDERFLOW)}
    assert sorted(flush) == [0, 2, 4]
    assert flush[4] == pytest.approx(sum(r0["flushed"]) / sum(r0["nonzero"]))
    assert 0 < flush[4] < 1
    assert [[e.step, e.value] for e in ea.Scalars(tags.LOSS_SCALE)] == r0["history"]
    assert tags.per_parameter(tags.GRAD_EXPONENT, "0.weight") in ea.Tags()["histograms"]


def test_every_tensorboard_logger_of_fabric_gets_the_tags_and_one_layout(tmp_path):
    """``Fabric(loggers=[TensorBoardLogger(a), TensorBoardLogger(b)])``: both runs hold the same scalars, histograms
    and records, and one dashboard layout each (only the first got them before)."""
    loggers = [FabricTensorBoardLogger(str(tmp_path), name=name, version=0) for name in ("a", "b")]
    fabric = L.Fabric(
        accelerator="cpu", devices=1, plugins=[FabricMPTPrecision("fp16", scaler=scaler())], loggers=loggers
    )
    model = Net()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    diagnostics = MixedPrecisionLogger(fabric, model, every_n_steps=1, histograms_every_n_steps=1)
    for x, y in batches()[:4]:
        fabric.backward(compute_loss(model, x, y))
        diagnostics.after_backward()
        diagnostics.step(optimizer)
        optimizer.zero_grad()
    diagnostics.finalize()
    a, b = (read_events(lg.log_dir) for lg in loggers)
    assert "mpt/loss_scale" in a.Tags()["scalars"]
    assert a.Tags()["scalars"] == b.Tags()["scalars"]
    for tag in a.Tags()["scalars"]:
        assert [(e.step, e.value) for e in a.Scalars(tag)] == [(e.step, e.value) for e in b.Scalars(tag)], tag
    assert a.Tags()["histograms"]
    assert a.Tags()["histograms"] == b.Tags()["histograms"]
    assert records(a, tags.RUN_RECORD) == records(b, tags.RUN_RECORD)
    assert len(layouts(a)) == len(layouts(b)) == 1
    fabric.strategy.precision.restore()
