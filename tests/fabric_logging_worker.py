"""A 2-process CPU (gloo) Fabric loop with ``MixedPrecisionLogger`` for tests/test_fabric_logging.py.

usage: python fabric_logging_worker.py OUT

``Fabric(devices=2, strategy="ddp", plugins=[MPTPrecision("fp16")])``, the logger at every step and the fp32 reference
every 2 steps; the ranks see different batches, and rank 1's loss is multiplied by 1e-20: every nonzero gradient of
its fp32 reference lies far below fp16's smallest subnormal and flushes, while rank 0's are of the order of its
outputs (its output bias's at least cannot flush): the ranks' counts differ by construction. Each rank writes
``OUT/rank<r>.json``: its own and the reduced reference counts, the plugin's history, its host reads and its pid;
rank 0's TensorBoard files go to ``OUT/tb``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F

from lightning_mpt.fabric import MixedPrecisionLogger, MPTPrecision

STEPS = 6


def loss_of(module: nn.Module, x: torch.Tensor, y: torch.Tensor, gain: float) -> torch.Tensor:
    return F.mse_loss(module(x).float(), y) * gain


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    fabric = L.Fabric(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        plugins=[MPTPrecision("fp16", scaler=1024.0)],
        loggers=TensorBoardLogger(out, name="tb", version=0),
    )
    fabric.launch()
    rank = fabric.global_rank
    fabric.seed_everything(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    diagnostics = MixedPrecisionLogger(fabric, model, every_n_steps=1, histograms_every_n_steps=2)
    g = torch.Generator().manual_seed(rank)
    gain = 1e-20 if rank else 1.0
    references = []
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=g) * 1e-3
        y = torch.randn(8, 4, generator=g) * 1e-3
        if step % 2 == 0:
            references.append(diagnostics.reference(loss_of, x, y, gain).step)
        fabric.backward(loss_of(model, x, y, gain))
        diagnostics.after_backward()
        diagnostics.step(optimizer)
        optimizer.zero_grad()
    diagnostics.finalize()
    ref = diagnostics.last_reference
    report = {
        "pid": os.getpid(),
        "references": references,
        "local_flushed": ref.local_flushed.tolist(),
        "local_nonzero": ref.local_nonzero.tolist(),
        "flushed": ref.flushed.tolist(),
        "nonzero": ref.nonzero.tolist(),
        "history": [[r.step, r.scale] for r in fabric.strategy.precision.history],
        "syncs": diagnostics.recorder.syncs,
    }
    path = out / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(report))
    os.replace(path.with_suffix(".tmp"), path)  # atomic: the test never reads a half-written file


if __name__ == "__main__":
    main()
