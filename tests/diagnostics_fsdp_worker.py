"""2-process CPU (gloo) runs for tests/test_diagnostics_fsdp.py: the diagnostic callbacks under FSDP2 and under DDP.

usage: python diagnostics_fsdp_worker.py OUT

The same model, data, seed and ``MPTPrecision("fp16")`` with a dynamic scale that starts too high (skipped steps, then
back-offs and growth) are trained under DDP and under FSDP2 (``ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=1)``: the batches are split as under DDP), with ``LossScaleMonitor``, ``UnderflowMonitor`` and
``GradientHistogramMonitor`` at every step, and the fp32 reference every ``REFERENCE`` steps. Each run logs to
``OUT/<run>/`` (rank 0's TensorBoard files); each rank writes ``OUT/<run>/rank<r>.json`` (the scale history, digests
of the whole stored half gradients and of the masters at every step, the reference counts, the warnings) and, at the
end, ``OUT/done-rank<r>``. The test compares the event files.

The model has uneven shards: ``Linear(16, 33)`` splits its 33 rows 17/16, and ``Linear(33, 1)``'s single row and bias
leave rank 1 an empty local shard.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L
import torch
from fsdp_worker import Sharded, fsdp, write
from lightning.pytorch.loggers import TensorBoardLogger
from models import quiet_trainer, regression_data
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import DynamicLossScaler, MPTPrecision
from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor

STEPS = 12
REFERENCE = 3  # the fp32 reference at steps 0 (skipped: overflow), 3, 6 and 9 (clean)


class Uneven(Sharded):
    """Linear(16, 33) -> LayerNorm (fp32, sharded on its own) -> ReLU -> Linear(33, 1)."""

    lr = 1e-2

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 33), nn.LayerNorm(33), nn.ReLU(), nn.Linear(33, 1))

    def blocks(self) -> list[nn.Module]:
        return [self.model[0]]

    break_reference_at: Optional[int] = None  # the fp32 re-run raises at this step (set on one rank)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        rerun = not isinstance(self.model[0].weight, DTensor)  # the reference swapped in whole fp32 weights
        if rerun and self.device_mesh is not None and self.trainer.global_step == self.break_reference_at:
            raise RuntimeError("this model cannot run in fp32 on this rank")
        return nn.functional.mse_loss(self.model(x).float(), y)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def digest(tensors: list[torch.Tensor]) -> str:
    flat = torch.cat([t.detach().float().flatten() for t in tensors])
    return hashlib.sha1(flat.numpy().tobytes(), usedforsecurity=False).hexdigest()


class Probe(L.Callback):
    """Per step: a digest of the whole stored gradients (as fp16) of the Linear layers, and of the fp32 masters after
    the step (all-gathered under FSDP2: a collective on every rank); at the fp32 reference's steps its counts (this
    rank's, and those summed over the ranks) and maxima."""

    def __init__(self) -> None:
        self.grads: list[str] = []
        self.masters: list[str] = []
        self.reads: dict[str, int] = {}
        self.references: list[list[Any]] = []

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        grads = [full(p.grad).half() for n, p in module.named_parameters() if "model.1." not in n]
        self.grads.append(digest(grads))

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        self.masters.append(digest([full(m) for m in plugin.main_params(trainer.optimizers[0])]))
        ref = next(c for c in trainer.callbacks if isinstance(c, UnderflowMonitor)).last_reference
        if ref is not None and (not self.references or self.references[-1][0] != ref.step):  # measured in this step
            counts = (ref.local_nonzero, ref.local_flushed, ref.nonzero, ref.flushed, ref.max_scaled)
            self.references.append([ref.step, ref.scale, *(t.tolist() for t in counts)])

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        recorder = next(c for c in trainer.callbacks if isinstance(c, UnderflowMonitor)).recorder
        calls = recorder.shards.calls if recorder.shards is not None else 0
        self.reads = {"syncs": recorder.syncs, "flush_collectives": recorder.collectives, "collectives": calls}


def data(steps: int) -> DataLoader:
    """Regression data whose first 4 features are 0 (zero gradients in ``model.0.weight``) and next 4 tiny (its
    gradients there are subnormal or flushed once scaled to fp16)."""
    loader = regression_data(n=16 * steps, d_out=1, batch_size=8)
    x, y = loader.dataset.tensors
    x = x.clone()
    x[:, :4] = 0.0
    x[:, 4:8] *= 1e-8
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def plugin() -> MPTPrecision:
    return MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**20, growth_interval=4))


def monitors(reference: int = REFERENCE, strict: bool = True) -> list[L.Callback]:
    return [
        LossScaleMonitor(strict=strict),
        UnderflowMonitor(every_n_steps=1, reference_every_n_steps=reference, strict=strict),
        GradientHistogramMonitor(every_n_steps=1, strict=strict),
    ]


class BreakOnOneRank(L.Callback):
    """An internal error in two statistics on one rank only, from ``step`` on: the stored-gradient fractions get a
    format that is not one, and the value histograms a parameter that is not a tensor."""

    def __init__(self, rank: int, step: int, reference_step: int) -> None:
        self.rank, self.step, self.reference_step = rank, step, reference_step

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank:
            module.break_reference_at = self.reference_step  # the fp32 re-run of this step raises on this rank
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        underflow = next(c for c in trainer.callbacks if isinstance(c, UnderflowMonitor))
        underflow.stored_stat.fmt = None  # AttributeError in the statistic
        histograms = next(c for c in trainer.callbacks if isinstance(c, GradientHistogramMonitor))
        key, members = histograms._val_groups[0]
        histograms._val_groups[0] = (key, [(members[0][0], object())])  # AttributeError gathering the gradients


def run(
    out: Path,
    name: str,
    strategy: Any,
    reference: int = REFERENCE,
    steps: int = STEPS,
    extra: tuple = (),
    strict: bool = True,
    data_steps: Optional[int] = None,
) -> None:
    L.seed_everything(0, verbose=False)
    model = Uneven()
    probe = Probe()
    watched = monitors(reference, strict)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=2,
        plugins=[plugin()],
        max_steps=steps,
        callbacks=[*watched, probe, *extra],
        logger=TensorBoardLogger(out / name, name="", version=0),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data(data_steps or steps))  # the data depend on their size
    mpt = trainer.precision_plugin
    write(
        out / name,
        trainer.global_rank,
        {
            "history": [[r.step, r.scale, r.skipped, r.nonfinite_params] for r in mpt.history],
            "grads": probe.grads,
            "masters": probe.masters,
            "references": probe.references,
            "warnings": [str(w.message) for w in caught],
            **probe.reads,
        },
    )


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    run(out, "ddp", "ddp")
    run(out, "fsdp", fsdp())
    run(out, "fsdp-no-reference", fsdp(), reference=0, steps=REFERENCE + 2, data_steps=STEPS)  # the fsdp run's start
    breaks = BreakOnOneRank(rank=1, step=3, reference_step=4)
    run(out, "fsdp-fail", fsdp(), reference=2, steps=6, extra=(breaks,), strict=False)
    rank = torch.distributed.get_rank()
    (out / f"done-rank{rank}").write_text("")


if __name__ == "__main__":
    main()
