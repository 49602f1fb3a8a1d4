"""A 2-process CPU (gloo) training run for tests/test_ddp.py; each rank writes what it saw to ``OUT/rank<r>.json``.

usage: python ddp_worker.py STRATEGY OUT PRECISION [--inject-step K --inject-rank R] [--model nonorm|mlp]
                            [--accumulate N [--accumulate-fp32]] [--chunked] [--remainders] [--fp8] [--auto-scale]

PRECISION is ``mpt-fp16``, ``mpt-bf16`` or ``lightning-16-mixed`` (Lightning's MixedPrecision with a GradScaler).
Per training batch a rank records the loss scale, whether the step was skipped, a SHA-1 of its fp32 weights (the
masters under MPTPrecision) and the bytes its DDP communication hook all-reduced.
"""

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from models import InjectInf, NoNormMLP, TinyMLP, quiet_trainer, regression_data
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lightning_mpt.core.engine
from lightning_mpt import DynamicLossScaler, MPTPrecision
from lightning_mpt.callbacks import Float8Monitor, UnderflowMonitor


class CountingDist:
    """``torch.distributed`` as the engine sees it, counting its ``all_reduce`` calls (the engine's collectives)."""

    def __init__(self) -> None:
        self.all_reduces = 0

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)

    def all_reduce(self, *args, **kwargs):
        self.all_reduces += 1
        return torch.distributed.all_reduce(*args, **kwargs)


class UnequalFirstGradients(L.Callback):
    """After DDP's all-reduce of the first step, rank 1's gradients are 16 times rank 0's: the ranks measure
    different ranges, and only the plugin's own all-reduce makes them choose one scale."""

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_step == 0 and trainer.global_rank == 1:
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.mul_(16)


class Record(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict] = []
        self.bytes = [0]

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        # Lightning registers DDP comm hooks only on CUDA: register ours on the DDP-wrapped model
        def count_and_allreduce(
            state: list, bucket: torch.distributed.GradBucket
        ) -> torch.futures.Future[torch.Tensor]:
            buf = bucket.buffer()
            state[0] += buf.numel() * buf.element_size()
            return default_hooks.allreduce_hook(None, bucket)

        trainer.strategy.model.register_comm_hook(self.bytes, count_and_allreduce)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        plugin = trainer.precision_plugin
        if isinstance(plugin, MPTPrecision):
            weights = [m for _, _, m in plugin.named_masters()]
            last = plugin.last_step  # None while the first accumulation window is open
            scale, skipped = (last.scale, last.skipped) if last is not None else (plugin.loss_scale, None)
            dtypes = sorted({str(p.dtype) for p in module.parameters()})
        else:
            weights = list(module.parameters())
            scale, skipped, dtypes = (
                plugin.scaler.get_scale(),
                None,
                sorted({str(p.dtype) for p in module.parameters()}),
            )
        flat = torch.cat([w.detach().float().flatten() for w in weights])
        self.rows.append({
            "step": trainer.global_step,
            "scale": scale,
            "engine_all_reduces": getattr(lightning_mpt.core.engine.dist, "all_reduces", None),
            "loss_scale": plugin.loss_scale if isinstance(plugin, MPTPrecision) else None,
            "skipped": skipped,
            "weights_sha1": hashlib.sha1(flat.numpy().tobytes(), usedforsecurity=False).hexdigest(),
            "bytes": self.bytes[0],
            "param_dtypes": dtypes,
            "fp8_layers": [n for n, m in module.named_modules() if type(m).__name__ == "Float8Linear"],
        })
        self.bytes[0] = 0

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        path = self.out / f"rank{trainer.global_rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rows))
        os.replace(tmp, path)  # atomic: the test never reads a half-written file


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("strategy", choices=["ddp", "ddp_spawn"])
    p.add_argument("out", type=Path)
    p.add_argument("precision", choices=["mpt-fp16", "mpt-bf16", "lightning-16-mixed"])
    p.add_argument("--inject-step", type=int, default=-1)
    p.add_argument("--inject-rank", type=int, default=1)
    p.add_argument("--model", choices=["nonorm", "mlp"], default="mlp")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reference", action="store_true", help="UnderflowMonitor's fp32 reference at every step")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--accumulate-fp32", action="store_true", help="MPTPrecision(accumulate_fp32=True)")
    p.add_argument("--chunked", action="store_true", help="MPTPrecision(chunked_step=64): the step in chunks")
    p.add_argument("--remainders", action="store_true", help="MPTPrecision(master_remainders=True) (bf16)")
    p.add_argument("--fp8", action="store_true", help="MPTPrecision(fp8=True, fp8_emulate=True), Float8Monitor (bf16)")
    p.add_argument("--auto-scale", action="store_true", help="DynamicLossScaler(init_scale='auto'), unequal gradients")
    args = p.parse_args()

    torch.manual_seed(os.getpid() if args.strategy == "ddp" else 0)  # ranks start from different weights on purpose
    extra: dict = {"accumulate_fp32": True} if args.accumulate_fp32 else {}
    if args.chunked:
        extra["chunked_step"] = 64
    if args.remainders:
        extra["master_remainders"] = True
    if args.fp8:
        extra.update(fp8=True, fp8_emulate=True)
    plugin = (
        MPTPrecision(args.precision[4:], **extra)
        if args.precision.startswith("mpt")
        else MixedPrecision("16-mixed", "cpu")
    )
    if args.precision == "mpt-fp16":
        plugin = MPTPrecision("fp16", scaler=1024.0 if args.inject_step < 0 else None, **extra)
    if args.auto_scale:
        plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale="auto"))
        lightning_mpt.core.engine.dist = CountingDist()  # type: ignore[assignment]
    trainer = quiet_trainer(
        strategy=args.strategy,
        devices=2,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        logger=TensorBoardLogger(args.out / "tb", name="", version="run") if args.fp8 else False,
        plugins=[plugin],
        callbacks=[
            *([UnderflowMonitor(every_n_steps=1, reference_every_n_steps=1)] if args.reference else []),
            *([Float8Monitor(every_n_steps=1)] if args.fp8 else []),
            Record(args.out),
            *([UnequalFirstGradients()] if args.auto_scale else []),
            InjectInf("net.0.weight", steps={args.inject_step}, rank=args.inject_rank),
        ],
    )
    model = NoNormMLP() if args.model == "nonorm" else TinyMLP()
    trainer.fit(model, regression_data(n=32 * args.steps * args.accumulate))


if __name__ == "__main__":
    main()
