"""The held-out loss of each memory mode against ``"32-true"``, over seeds: ``python benchmarks/memory.py --loss``.

The model is the benchmark transformer (``benchmarks/common.py``: pre-norm GPT, tied embeddings, no dropout) at
:data:`LOSS_CONFIG`, a byte-level language model of real text: the source of Python's standard library as installed
(the same bytes on every machine with the same Python), 90% for training and the last 10% held out. Each run trains
``--loss-steps`` steps of random windows with the mode's optimizer (AdamW hyper-parameters of ``memory.HYPER``, peak
LR ``PEAK_LR``) under a linear warm-up and a cosine decay to 1% of the peak: late in the run the updates shrink below
the spacing of bf16 weights, where weights without an exact master stall. The held-out loss is the mean cross-entropy
(nats per byte) over fixed held-out windows, evaluated by ``trainer.validate`` under the run's own precision.

A seed sets the initial weights, the training windows and the torchao stochastic rounding: each mode runs on the
same seeds, so each mode's difference from ``"32-true"`` is taken per seed (paired) and reported as the mean and the
range over seeds. The spread of ``"32-true"`` itself over seeds is in the table too: differences within it do not
rank the runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import GPTConfig
from torch.utils.data import DataLoader, Dataset, TensorDataset

# small enough for a CPU without bf16 arithmetic (AVX2 only: a bf16 matmul there is ~20x slower than fp32)
LOSS_CONFIG = GPTConfig(layers=2, d_model=64, heads=2, vocab=128, seq=32, batch=16)
PEAK_LR = 3e-3
TEXT_BYTES = 2_000_000
HELD_OUT_WINDOWS = 256


def corpus(n: int = TEXT_BYTES) -> torch.Tensor:
    """The first ``n`` bytes of the standard library's ``.py`` files in sorted order, ASCII (others become 0).

    Args:
        n: how many bytes.

    Example::

        text = corpus(10_000)
        assert text.dtype == torch.long and int(text.max()) < 128
    """
    root = Path(argparse.__file__).parent  # the standard library's directory
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= n:
            break
    raw = torch.frombuffer(bytearray(b"".join(chunks)[:n]), dtype=torch.uint8).long()
    return torch.where(raw < 128, raw, torch.zeros_like(raw))


class Windows(Dataset):
    """Random windows of ``text`` (and their next bytes), drawn from a generator seeded by ``seed``."""

    def __init__(self, text: torch.Tensor, seq: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(text) - seq - 1, (count,), generator=g)
        self.text, self.seq = text, seq

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        window = self.text[s : s + self.seq + 1]
        return window[:-1], window[1:]


def loaders(config: GPTConfig, steps: int, seed: int) -> tuple[DataLoader, DataLoader]:
    """Training windows from the first 90% of :func:`corpus` (``steps`` batches, order set by ``seed``) and the
    held-out windows: consecutive, non-overlapping, from the last 10%, the same for every seed."""
    text = corpus()
    split = int(0.9 * len(text))
    train = Windows(text[:split], config.seq, steps * config.batch, seed)
    held = text[split:][: HELD_OUT_WINDOWS * (config.seq + 1)].view(-1, config.seq + 1)
    held_out = TensorDataset(held[:, :-1], held[:, 1:])
    return DataLoader(train, batch_size=config.batch), DataLoader(held_out, batch_size=64)


def train_once(mode: Any, seed: int, steps: int, lm: Callable[..., L.LightningModule], stance: Any) -> float:
    """Train ``mode`` from ``seed`` for ``steps`` steps; its held-out loss."""
    L.seed_everything(seed, verbose=False)
    train, held_out = loaders(LOSS_CONFIG, steps, seed)
    model = lm(LOSS_CONFIG, mode.optimizer, steps, lr=PEAK_LR)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **mode.trainer(),
    )
    with stance:
        trainer.fit(model, train)
        (metrics,) = trainer.validate(model, held_out, verbose=False)
    return float(metrics["val_loss"])


def run(
    modes: list[Any], args: argparse.Namespace, lm: Callable[..., L.LightningModule], stance: Any
) -> dict[str, Any]:
    """Every mode on seeds ``0..args.seeds-1``; the held-out losses by mode and the seconds each mode took.

    Args:
        modes: rows of ``memory.MODES`` (``"32-true"`` first or not, it is the reference).
        args: ``seeds``, ``loss_steps``, ``compile``.
        lm: the model class (``memory.LM``).
        stance: ``memory.torchao_stance``.

    Example::

        out = run([MODES[0]], argparse.Namespace(seeds=1, loss_steps=4, compile=False), LM, torchao_stance)
    """
    losses: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    for mode in modes:
        t0 = time.perf_counter()
        losses[mode.name] = [
            train_once(mode, seed, args.loss_steps, lm, stance(args.compile)) for seed in range(args.seeds)
        ]
        seconds[mode.name] = time.perf_counter() - t0
        print(f"held-out loss: {mode.name}: {losses[mode.name]} ({seconds[mode.name]:.0f} s)", file=sys.stderr)
    return {"losses": losses, "seconds": seconds}


def format_table(out: dict[str, Any], args: argparse.Namespace) -> str:
    """Markdown: per mode the mean held-out loss [min–max over seeds] and its paired difference from ``"32-true"``
    in percent, mean [min–max]."""
    losses = out["losses"]
    ref = losses.get("32-true")
    lines = [
        f"held-out loss (nats/byte), {LOSS_CONFIG}, {args.loss_steps} steps, peak LR {PEAK_LR:g} with warm-up and "
        f"cosine to 1%, seeds 0..{args.seeds - 1}",
        "",
        "| mode | held-out loss, mean [min–max] | vs 32-true, same seed: mean [min–max] | s/run |",
        "|---|--:|--:|--:|",
    ]
    for name, values in losses.items():
        cell = f"{statistics.mean(values):.4f} [{min(values):.4f}–{max(values):.4f}]"
        diff = "reference"
        if ref is not None and name != "32-true":
            d = [100 * (v - r) / r for v, r in zip(values, ref)]
            diff = f"{statistics.mean(d):+.2f}% [{min(d):+.2f}%–{max(d):+.2f}%]"
        lines.append(f"| {name} | {cell} | {diff} | {out['seconds'][name] / len(values):.0f} |")
    return "\n".join(lines)
