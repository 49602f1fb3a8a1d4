"""The monitors under DDP with 2 CPU processes (``ddp_spawn``, gloo): only rank 0 writes, nothing hangs, and the
per-rank fp32 reference flush counts are reduced across ranks by the torchmetrics metric.

The run happens in a subprocess (this file run as a script), and the assertions read what the workers wrote:
gloo sometimes aborts a process at exit ("terminate called without an active exception") after the work is done,
which must not decide the test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from models import quiet_trainer, run_until_written
from tb_events import read_events, records, series
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision
from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

STEPS = 4
REFERENCE_EVERY = 2


def test_ddp_rank_zero_writes_and_flush_is_reduced_across_ranks(tmp_path):
    files = [tmp_path / f"rank{rank}.json" for rank in (0, 1)]
    log = tmp_path / "log.txt"
    run_until_written([sys.executable, __file__, str(tmp_path)], files, log)
    reports = {}
    for rank, path in enumerate(files):
        assert path.exists(), f"rank {rank} wrote no report; subprocess output:\n{log.read_text()[-3000:]}"
        reports[rank] = json.loads(path.read_text())
    r0, r1 = reports[0], reports[1]
    for r in (r0, r1):
        assert r["checks"] == {"reduced_is_sum_of_ranks": True, "same_scale_history": True}, r["checks"]
        assert r["reference_steps"] == list(range(0, STEPS, REFERENCE_EVERY))
    # every nonzero gradient of rank 0 flushes, some of rank 1 cannot (Tiny): the ranks' counts differ by construction,
    # and both hold the same reduced counts, the sums of their own
    assert r0["local_flushed"] == r0["local_nonzero"]
    assert sum(r0["local_nonzero"]) > 0
    assert sum(r1["local_flushed"]) < sum(r1["local_nonzero"])
    summed = [a + b for a, b in zip(r0["local_flushed"], r1["local_flushed"])]
    assert r0["flushed"] == r1["flushed"] == summed
    assert r0["nonzero"] == [a + b for a, b in zip(r0["local_nonzero"], r1["local_nonzero"])]
    # only rank 0 wrote event files
    events = sorted(p for p in tmp_path.rglob("events.out.tfevents.*"))
    assert len(events) == 1
    assert events[0].name.split(".")[-2] == str(r0["pid"]) != str(r1["pid"])
    ea = read_events(events[0].parent)
    logged = dict(series(ea, "mpt/grad_underflow_fraction"))
    assert sorted(logged) == r0["reference_steps"]
    assert logged[r0["reference_steps"][-1]] == pytest.approx(sum(r0["flushed"]) / sum(r0["nonzero"]))
    assert series(ea, "mpt/loss_scale") == [tuple(x) for x in r0["history"]]
    assert [r["monitors"] for _, r in records(ea, "mpt/data/run")] == [
        ["LossScaleMonitor", "UnderflowMonitor", "GradientHistogramMonitor"]
    ]  # one group, one header, rank 0
    assert "mpt/grad_zero_fraction/l1.weight" in ea.Tags()["scalars"]
    assert "mpt/grad_exponent/l1.weight" in ea.Tags()["histograms"]


# ------------------------------------------------------------------------------------------ the worker script
class Tiny(L.LightningModule):
    """Rank 0's loss is multiplied by 1e-20: its gradients lie far below fp16's smallest subnormal (2^-24), so every
    nonzero one flushes. Rank 1's are of the order of its loss (1), so some cannot (the output bias's at least)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        gain = 1e-20 if self.global_rank == 0 else 1.0
        loss = nn.functional.mse_loss(self.l2(torch.relu(self.l1(x))), y) * gain
        self.log("loss", loss, sync_dist=True)  # a collective inside the re-run must not derail the ranks
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Report(L.Callback):
    """Per rank: the reference counts, checked against an all-gather of every rank's own, and the pid."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[int] = []

    @staticmethod
    def monitor(trainer: L.Trainer) -> UnderflowMonitor:
        return next(c for c in trainer.callbacks if isinstance(c, UnderflowMonitor))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        ref = self.monitor(trainer).last_reference
        if ref is not None and ref.step not in self.steps:
            self.steps.append(ref.step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ref = self.monitor(trainer).last_reference
        gathered = trainer.strategy.all_gather(ref.local_flushed)  # (world, P)
        history = [(r.step, r.scale) for r in trainer.precision_plugin.history]
        histories: list[Any] = [None, None]
        torch.distributed.all_gather_object(histories, history)
        report = {
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "reference_steps": self.steps,
            "history": history,
            "local_nonzero": ref.local_nonzero.tolist(),
            "local_flushed": ref.local_flushed.tolist(),
            "nonzero": ref.nonzero.tolist(),
            "flushed": ref.flushed.tolist(),
            "checks": {
                "reduced_is_sum_of_ranks": torch.equal(gathered.sum(0), ref.flushed),
                "same_scale_history": histories[0] == histories[1],
            },
        }
        if trainer.is_global_zero:
            trainer.logger.experiment.flush()
        path = Path(self.out, f"rank{trainer.global_rank}.json")
        Path(f"{path}.tmp").write_text(json.dumps(report))
        os.replace(f"{path}.tmp", path)  # atomic: the test never reads a half-written file


def _main(out: str) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    torch.manual_seed(0)  # the initial weights
    trainer = quiet_trainer(
        devices=2,
        strategy="ddp_spawn",
        plugins=[MPTPrecision("fp16", scaler=1.0)],
        max_steps=STEPS,
        callbacks=[
            LossScaleMonitor(),
            UnderflowMonitor(every_n_steps=1, reference_every_n_steps=REFERENCE_EVERY),
            GradientHistogramMonitor(every_n_steps=2),
            Report(out),
        ],
        logger=TensorBoardLogger(out, name="", version=0),
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, y), batch_size=8))


if __name__ == "__main__":
    _main(sys.argv[1])
