"""Writes ``f51cb33_bf16.ckpt``: a Trainer checkpoint of ``MPTPrecision("bf16")`` as commit f51cb33 wrote it (4-byte
masters, the whole step), for ``tests/test_checkpoint.py``'s resume under today's default.

Run from a checkout of f51cb33 with this file's folder's parent (``tests/``) on the path:

    git worktree add /tmp/f51 f51cb33
    cd /tmp/f51 && PYTHONPATH=.:tests python /path/to/tests/data/make_f51cb33_checkpoint.py /path/to/tests/data
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision


class Net(L.LightningModule):
    """The module of the checkpoint (tests/test_checkpoint.py defines the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.b(torch.relu(self.norm(self.a(x)))).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def main(out: Path) -> None:
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        plugins=[MPTPrecision("bf16")],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), data())
    trainer.save_checkpoint(out / "f51cb33_bf16.ckpt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
