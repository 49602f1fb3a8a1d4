"""LitGPT with Lightning Fabric and MPTPrecision: a tiny Llama-style GPT (random init, nothing downloaded) learns
byte-level language modelling on the source files of Python's standard library, then the same run with Fabric's
"bf16-mixed" for comparison.

    python examples/litgpt_fabric.py --fast                 # seconds on CPU (what the test suite runs)
    python examples/litgpt_fabric.py                        # about 25 s on 2 quiet CPU cores
    python examples/litgpt_fabric.py --accelerator gpu --devices 2 --n-layer 6 --n-embd 384 --steps 2000
    python examples/litgpt_fabric.py --fast --devices 2 --strategy fsdp   # FSDP2 on 2 CPU processes
    tensorboard --logdir runs                               # Custom Scalars tab: the "Mixed precision" dashboard
    lightning-mpt report runs/litgpt_fabric                 # the two runs side by side

The model's half weights, the fp32 masters in the optimizer and the dynamic loss scale all come from
``Fabric(plugins=[MPTPrecision("fp16")])``: the loop below is a plain Fabric loop. LitGPT's ``RMSNorm`` is its own
class, so it is added to ``keep_fp32`` (torch's norm layers are there by default). ``MixedPrecisionLogger`` writes the
diagnostics of the Trainer callbacks (loss scale, skipped steps, gradient fractions and histograms, update underflow,
the flush fraction from an fp32 reference) for both runs.

``--strategy fsdp`` shards the model with FSDP2 (Fabric's ``ModelParallelStrategy``): each transformer block and the
root with the plugin's ``mp_policy`` (``MPTPrecision(..., sharded=True)``: FSDP2's fp32 shards are the masters), each
RMSNorm first on its own in fp32; the "bf16-mixed" run gets the same sharding with torch's bf16 policy.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.loggers import TensorBoardLogger
from lightning.fabric.strategies import ModelParallelStrategy
from litgpt.config import Config
from litgpt.model import GPT, RMSNorm
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_utils import example_parser, next_version, parse_args, print_summary

from lightning_mpt import DEFAULT_KEEP_FP32
from lightning_mpt.fabric import MixedPrecisionLogger, MPTPrecision

NAME = "litgpt_fabric"


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's top-level ``.py`` files, in name order: real text that
    every Python installation has on disk, tokenized as bytes (a vocabulary of 256, no tokenizer to download)."""
    chunks, size = [], 0
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batches(
    data: torch.Tensor, block: int, batch: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``block + 1`` bytes: inputs and next-byte targets."""
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=generator)
    windows = torch.stack([data[s : s + block + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def next_byte_loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the next byte."""
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def config(args: Any) -> Config:
    """A small Llama-style configuration: RMSNorm, rotary embeddings, SwiGLU MLP, no biases."""
    return Config(
        name="tiny-llama-bytes",
        block_size=args.block_size,
        vocab_size=256,
        padded_vocab_size=256,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=4 * args.n_embd,
        parallel_residual=False,
        rotary_percentage=1.0,
        bias=False,
    )


def sharding(policy: Any) -> Any:
    """FSDP2's ``parallelize_fn``: every RMSNorm on its own in fp32 (so it computes in fp32, as ``keep_fp32`` does
    without sharding), then each transformer block and the root with ``policy``."""
    from torch.distributed.fsdp import fully_shard

    def parallelize(model: GPT, device_mesh: Any) -> GPT:
        mesh = device_mesh["data_parallel"]
        for module in model.modules():
            if isinstance(module, RMSNorm):
                fully_shard(module, mesh=mesh)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    return parallelize


def strategy_for(args: Any, plugin: Optional[MPTPrecision]) -> Any:
    if args.strategy != "fsdp":
        return "ddp" if args.devices > 1 else "auto"
    from lightning_mpt.core.masters.sharded import mixed_precision_policy

    policy = plugin.mp_policy if plugin is not None else mixed_precision_policy(torch.bfloat16)
    return ModelParallelStrategy(sharding(policy), data_parallel_size=args.devices, tensor_parallel_size=1)


def train(
    args: Any,
    precision: str,
    data: torch.Tensor,
    val: torch.Tensor,
    version: int,
    plugin: Optional[MPTPrecision] = None,
) -> dict[str, Any]:
    """One Fabric run; ``plugin`` (MPTPrecision) or Fabric's own ``precision``.

    Prints the summary on rank 0 and returns it on every rank.
    """
    logger = TensorBoardLogger(args.logdir, name=NAME, version=version, sub_dir=precision)
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy_for(args, plugin),
        plugins=[plugin] if plugin is not None else None,
        precision=None if plugin is not None else precision,
        loggers=logger,
    )
    fabric.launch()  # a no-op for the second run: the processes exist
    fabric.seed_everything(args.seed)  # the same initial weights and batches for both runs
    model = GPT(config(args))
    if args.strategy == "fsdp":  # FSDP2: shard first, then make the optimizer over the (fp32) shards
        model = fabric.setup_module(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    if args.strategy == "fsdp":
        optimizer = fabric.setup_optimizers(optimizer)
    else:
        model, optimizer = fabric.setup(model, optimizer)
    generator = torch.Generator().manual_seed(args.seed + fabric.global_rank)
    every = max(1, args.steps // 10)  # about 10 points of fractions and histograms, 2 fp32 references per run
    diagnostics = MixedPrecisionLogger(fabric, model, every_n_steps=every, histograms_every_n_steps=every)

    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = fabric.to_device(batches(data, args.block_size, args.batch_size, generator))
        if step % (5 * every) == 0:
            diagnostics.reference(next_byte_loss, x, y)  # fp32 re-run with the masters: the true flush fraction
        loss = next_byte_loss(model, x, y)  # fp32 out of the model, so the loss is fp32
        fabric.backward(loss)
        diagnostics.after_backward(loss)  # the stored half gradients, before clipping unscales them
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        diagnostics.step(optimizer)  # optimizer.step(), the update underflow, the loss scale, one host read
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.detach())
        fabric.log_dict({"train_loss": loss.detach()}, step=step)
    diagnostics.finalize()
    seconds = time.perf_counter() - start

    model.eval()
    val_generator = torch.Generator().manual_seed(1234)  # the same validation windows for every run
    with torch.no_grad():
        val_losses = []
        for _ in range(args.val_batches):
            x, y = fabric.to_device(batches(val, args.block_size, args.batch_size, val_generator))
            val_losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    val_loss = fabric.all_reduce(torch.stack(val_losses).mean(), reduce_op="mean")
    fabric.log_dict({"val_loss": val_loss}, step=args.steps)
    logger.finalize("success")

    history = torch.stack(losses).tolist()
    window = min(5, len(history))
    summary: dict[str, Any] = {
        "steps": args.steps,
        "first_loss": statistics.fmean(history[:window]),
        "last_loss": statistics.fmean(history[-window:]),
        "val_loss": float(val_loss),
    }
    if plugin is not None:
        summary.update(skipped_steps=plugin.skipped_steps, final_loss_scale=plugin.loss_scale)
        plugin.restore()  # done: the model is fp32 again (what a checkpoint of it would hold)
    summary.update(seconds=seconds, logdir=logger.log_dir)
    if fabric.global_rank == 0:  # rank 0's line only: the processes share stdout
        print_summary(precision, summary)
    return summary


def main(argv: Optional[list[str]] = None) -> dict[str, dict[str, Any]]:
    parser = example_parser(__doc__, steps=300)
    parser.add_argument("--devices", type=int, default=1, help="processes (DDP when > 1, unless --strategy fsdp)")
    parser.add_argument("--strategy", choices=["auto", "fsdp"], default="auto", help="fsdp: FSDP2 over --devices")
    # CPU-sized defaults: a context of 128 bytes made each run several minutes on 2 CPU cores
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(
        parser,
        argv,
        fast={
            "steps": 20,
            "n_layer": 2,
            "n_embd": 64,
            "block_size": 64,
            "batch_size": 8,
            "corpus_bytes": 200_000,
            "val_batches": 2,
        },
    )

    corpus = stdlib_bytes(args.corpus_bytes)
    split = int(0.9 * len(corpus))
    data, val = corpus[:split], corpus[split:]
    version = next_version(args.logdir, NAME)
    mpt_name = f"mpt-{args.precision}"
    keep_fp32 = (*DEFAULT_KEEP_FP32, RMSNorm)
    return {
        mpt_name: train(
            args,
            mpt_name,
            data,
            val,
            version,
            MPTPrecision(args.precision, keep_fp32=keep_fp32, sharded=args.strategy == "fsdp"),
        ),
        "bf16-mixed": train(args, "bf16-mixed", data, val, version),
    }


if __name__ == "__main__":
    main()
