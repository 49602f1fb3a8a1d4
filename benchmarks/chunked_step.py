"""Bytes per parameter at the optimizer step and step time of the ways ``MPTPrecision`` stores and steps the masters:
a whole step (today's default), ``chunked_step``, ``master_remainders`` (bf16), and both.

    python benchmarks/chunked_step.py                 # 8 x Linear(512, 512) + LayerNorm, AdamW, bf16 and fp16
    python benchmarks/chunked_step.py --rounds 5 --steps 20 --chunk 262144

Bytes: inside every ``optimizer.step()`` call (a step post-hook, so once per chunk) the script adds up the storage of
the module's weights and gradients, what holds the masters (``plugin.master_storage``: fp32 masters, or the 16-bit
remainders of those asleep) and their gradients, and the optimizer's state, each storage once; the figure is the
largest sum over the calls, divided by the number of parameters. Time: the configurations of a precision run in turn,
``--rounds`` times, each timing ``--steps`` training steps after two warm-up steps; the table gives the median and the
range over the rounds of each one's time over the whole step's of the same round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision


class Probe(L.LightningModule):
    """An MLP whose optimizer records the bytes alive in each of its ``step()`` calls."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU())]
        self.net = nn.Sequential(*layers, nn.Linear(width, 8))
        self.peak = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._count(opt))
        return optimizer

    def _count(self, optimizer: torch.optim.Optimizer) -> None:
        plugin = self.trainer.precision_plugin
        seen: dict[int, int] = {}
        held = plugin.master_storage()
        tensors = [t for p in self.parameters() for t in (p, p.grad)] + [t for m in held for t in (m, m.grad)]
        tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        for t in tensors:
            if t is not None:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(seen.values()))


def run(precision: str, options: dict[str, Any], steps: int, width: int, depth: int) -> tuple[float, float]:
    """``(bytes per parameter at the step, seconds per step)`` of one run."""
    torch.manual_seed(0)
    model = Probe(width, depth)
    n = sum(p.numel() for p in model.parameters())
    data = DataLoader(TensorDataset(torch.randn(16 * (steps + 2), width), torch.randn(16 * (steps + 2), 8)), 16)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps + 2,
        plugins=[MPTPrecision(precision, **options)],  # type: ignore[arg-type]
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    return model.peak / n, timer.per_step()


class StepTimer(L.Callback):
    """Wall time of the training steps after the first two."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def per_step(self) -> float:
        return (self.starts[-1] - self.starts[2]) / (len(self.starts) - 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=2**18)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    args = parser.parse_args()
    configs = {
        "whole step": {},
        "chunked_step": {"chunked_step": args.chunk},
        "master_remainders": {"master_remainders": True},
        "master_remainders + chunked_step": {"master_remainders": True, "chunked_step": args.chunk},
    }
    print("| precision | configuration | bytes/param at the step | step time / whole step: median [min-max] |")
    print("|---|---|--:|--:|")
    for precision in args.precisions:
        names = [n for n in configs if precision == "bf16" or "remainders" not in n]
        ratios: dict[str, list[float]] = {n: [] for n in names}
        sizes: dict[str, float] = {}
        for _ in range(args.rounds):
            times = {}
            for name in names:
                sizes[name], times[name] = run(precision, configs[name], args.steps, args.width, args.depth)
            for name in names:
                ratios[name].append(times[name] / times["whole step"])
        for name in names:
            r = ratios[name]
            print(
                f"| {precision} | {name} | {sizes[name]:.2f} | {statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}] |"
            )


if __name__ == "__main__":
    main()
