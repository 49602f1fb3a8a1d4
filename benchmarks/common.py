"""Workloads and a step timer shared by the benchmark scripts.

Two models, one per regime:

* ``transformer``: a small transformer encoder classifier, compute-bound (run it in bf16 on CPU, fp16 on GPU).
* ``deep_mlp``: about 200 tiny Linear layers, bound by per-op and per-parameter overhead (fp16).

Each benchmark builds a fresh model per precision, times optimizer steps with :class:`StepTimer` after a warm-up,
and prints ratios against Lightning's built-in precisions measured in the same process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TransformerClassifier(L.LightningModule):
    def __init__(self, vocab: int = 1000, d_model: int = 256, layers: int = 4, heads: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(self.embed(x))).mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class DeepMLP(L.LightningModule):
    """``depth`` Linear(width, width) + ReLU blocks: tiny matmuls, many parameters, overhead-bound."""

    def __init__(self, depth: int = 200, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def transformer_data(n: int, seq: int = 128, vocab: int = 1000, classes: int = 10, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def mlp_data(n: int, width: int = 32, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)), batch_size=batch_size)


WORKLOADS: dict[str, tuple[Callable[[], L.LightningModule], Callable[[int], DataLoader]]] = {
    "transformer": (TransformerClassifier, lambda steps: transformer_data(16 * steps)),
    "deep_mlp": (DeepMLP, lambda steps: mlp_data(16 * steps)),
}


class StepTimer(L.Callback):
    """Wall time of each training batch (forward, backward, optimizer step), after ``warmup`` batches."""

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._t0)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def time_steps(
    workload: str,
    steps: int,
    precision: Optional[str] = None,
    plugin: Optional[Any] = None,
    callbacks: Optional[list[L.Callback]] = None,
    accelerator: str = "auto",
    seed: int = 0,
    **trainer_kwargs: Any,
) -> StepTimer:
    """Train ``workload`` for ``steps`` optimizer steps with a Lightning precision string or a plugin; return the
    timer (median seconds per step in ``.median``)."""
    make_model, make_data = WORKLOADS[workload]
    L.seed_everything(seed, verbose=False)
    timer = StepTimer()
    kwargs: dict[str, Any] = dict(
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, *(callbacks or [])],
    )
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    else:
        kwargs["precision"] = precision
    kwargs.update(trainer_kwargs)
    trainer = L.Trainer(**kwargs)
    trainer.fit(make_model(), make_data(steps))
    return timer
