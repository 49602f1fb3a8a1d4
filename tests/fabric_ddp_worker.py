"""A 2-process CPU (gloo) Fabric loop for tests/test_fabric.py; each rank writes what it saw to ``OUT/rank<r>.json``.

usage: python fabric_ddp_worker.py OUT [--inject-step K] [--inject-rank R] [--accumulate N] [--steps S]
       [--accumulate-fp32] [--resume-and-marked]

``Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[MPTPrecision("fp16")])``. The ranks start from
different weights on purpose (DDP makes the half weights equal, the plugin the masters) and see different data.
Each optimizer step accumulates ``N`` micro-batches under ``fabric.no_backward_sync`` (the last one syncs); after
the last backward of step ``K`` rank ``R`` writes an inf into one gradient. Per step a rank records the scale the
step ran at, whether it was skipped, the culprits, a SHA-1 of its fp32 masters, of its half weights and of its
optimizer state, and the bytes its DDP communication hook all-reduced. ``--accumulate-fp32``: the plugin sums the
micro-batches in fp32 and each backward gets ``model=model``; the first one is tried without it first, and the error
is written to ``OUT/error-without-model-rank<r>.txt``.

``--resume-and-marked`` runs another scenario (``OUT/resume-rank<r>.json``), under ``strategy="ddp_spawn"`` (which
pickles the plugin to start the processes): 6 steps straight with
``fabric.setup(model, optimizer)``, saving at step 3; then the plugin restores that model, a fresh model (other
weights) is set up with ``fabric.setup_module`` and an optimizer made after it with ``fabric.setup_optimizers``,
``fabric.load`` restores the state (no other call) and steps 3-5 run again. Then a method marked with
``mark_forward_method`` runs, once unmarked first (its error is recorded).
"""

import argparse
import hashlib
import json
import math
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_mpt.fabric import MPTPrecision


def sha1(tensors: list[torch.Tensor]) -> str:
    flat = torch.cat([t.detach().float().flatten() for t in tensors]) if tensors else torch.zeros(0)
    return hashlib.sha1(flat.numpy().tobytes(), usedforsecurity=False).hexdigest()


class Net(nn.Sequential):
    """The workers' model, with a method besides ``forward``."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))  # no norm layer: every parameter is half

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self[1](self[0](x))


def resume_and_marked(fabric: L.Fabric, mpt: MPTPrecision, out: Path) -> None:
    rank = fabric.global_rank
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]
    path = out / "ckpt.pt"

    def run(model, optimizer, steps):
        seen = []
        for x, y in steps:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            seen.append(sha1(mpt.main_params(optimizer)))
        return seen

    torch.manual_seed(1000 + rank)
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    straight = run(model, optimizer, data[:3])
    fabric.save(path, {"model": model, "optimizer": optimizer, "mpt": mpt})
    straight += run(model, optimizer, data[3:])
    mpt.restore()

    torch.manual_seed(2000 + rank)  # other weights: everything must come from the checkpoint
    model = fabric.setup_module(Net())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, {"model": model, "optimizer": optimizer, "mpt": mpt})
        resumed = run(model, optimizer, data[3:])
    state_dtypes = sorted({str(v.dtype) for st in optimizer.state.values() for v in st.values() if v.ndim > 0})

    x = data[0][0]
    try:
        with torch.no_grad():
            model.encode(x)
        unmarked = "no error"
    except RuntimeError as err:
        unmarked = str(err)
    model.mark_forward_method("encode")
    inner = []
    model.module[0].register_forward_hook(lambda m, i, o: inner.append(str(o.dtype)))
    with torch.no_grad():
        encoded = model.encode(x)
        first = model.module[0]  # the reference: the half-precision matmul autocast runs, by hand
        expected = nn.functional.linear(x.half(), first.weight, first.bias).relu().float()
    result = {
        "straight": straight,
        "resumed": resumed,
        "warnings": [str(w.message) for w in caught if "MPTPrecision" in str(w.message)],
        "state_dtypes": state_dtypes,
        "unmarked": unmarked,
        "inner_dtypes": inner,
        "encoded_dtype": str(encoded.dtype),
        "encoded_equal": bool(torch.equal(encoded, expected)),
    }
    write(out / f"resume-rank{rank}.json", result)


def spawned(fabric: L.Fabric, out: Path) -> None:
    """:func:`resume_and_marked` in a process that ``ddp_spawn`` started, with its copy of the plugin."""
    torch.set_num_threads(1)
    resume_and_marked(fabric, fabric.strategy.precision, out)


def write(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # atomic: the test never reads a half-written file


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--inject-step", type=int, default=-1)
    p.add_argument("--inject-rank", type=int, default=1)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate-fp32", action="store_true")
    p.add_argument("--resume-and-marked", action="store_true")
    args = p.parse_args()

    torch.set_num_threads(1)
    mpt = MPTPrecision("fp16", accumulate_fp32=args.accumulate_fp32)
    if args.resume_and_marked:  # started by ddp_spawn: the plugin reaches each process pickled
        L.Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn", plugins=[mpt]).launch(spawned, args.out)
        return
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpt])
    fabric.launch()
    rank = fabric.global_rank
    torch.manual_seed(1000 + rank)  # different initial weights per rank
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)

    communicated = [0]

    def count_and_allreduce(state: list, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        state[0] += buf.numel() * buf.element_size()
        return default_hooks.allreduce_hook(None, bucket)

    model._forward_module.register_comm_hook(communicated, count_and_allreduce)

    g = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(args.steps):
        for micro in range(args.accumulate):
            x = torch.randn(8, 16, generator=g)
            y = torch.randn(8, 4, generator=g)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = nn.functional.mse_loss(model(x), y)
                if args.accumulate_fp32:
                    if step == micro == 0:
                        try:
                            fabric.backward(loss)
                        except ValueError as err:
                            (args.out / f"error-without-model-rank{rank}.txt").write_text(str(err))
                    fabric.backward(loss, model=model)
                else:
                    fabric.backward(loss)
        if step == args.inject_step and rank == args.inject_rank:
            model.module[2].weight.grad.view(-1)[0] = math.inf
        optimizer.step()
        optimizer.zero_grad()
        record = mpt.last_step
        state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        rows.append({
            "step": step,
            "scale": record.scale,
            "skipped": record.skipped,
            "culprits": record.nonfinite_params,
            "masters_sha1": sha1(mpt.main_params(optimizer)),
            "weights_sha1": sha1(list(model.parameters())),
            "state_sha1": sha1(state),
            "param_dtypes": sorted({str(q.dtype) for q in model.parameters()}),
            "state_dtypes": sorted({str(v.dtype) for v in state if v.ndim > 0}),
            "bytes": communicated[0],
            "loss_scale_after": mpt.loss_scale,
        })
        communicated[0] = 0
    write(args.out / f"rank{rank}.json", rows)


if __name__ == "__main__":
    main()
