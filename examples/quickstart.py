"""Quickstart: train a small classifier with MPTPrecision("fp16") on CPU and write a TensorBoard log.

    python examples/quickstart.py              # about 4 s on 2 quiet CPU cores
    python examples/quickstart.py --fast       # 60 steps, a few seconds (what the tests run)
    tensorboard --logdir runs                  # scalars under mpt/ and the "Mixed precision" dashboard

Flags scale it up on a GPU: --accelerator gpu --hidden 1024 --steps 2000 --precision fp16
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision
from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor


class Classifier(L.LightningModule):
    def __init__(self, d_in: int = 32, hidden: int = 64, classes: int = 8, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr, total_steps=self.trainer.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def synthetic(n: int, d_in: int, classes: int, seed: int) -> TensorDataset:
    """Gaussian clusters around fixed class centres; ``seed`` picks the samples (train and val share centres)."""
    centers = torch.randn(classes, d_in, generator=torch.Generator().manual_seed(1234)) * 0.4
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centers[y] + torch.randn(n, d_in, generator=g), y)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--logdir", default="runs")
    p.add_argument("--name", default="quickstart")
    p.add_argument("--fast", action="store_true", help="60 steps (what tests/test_examples.py runs)")
    args = p.parse_args(argv)
    if args.fast:  # fewer steps by default; a --steps given explicitly still wins
        p.set_defaults(steps=60)
        args = p.parse_args(argv)

    L.seed_everything(0, verbose=False)
    train = DataLoader(synthetic(4096, 32, 8, 0), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(synthetic(512, 32, 8, 1), batch_size=256)
    plugin = MPTPrecision(args.precision)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        plugins=[plugin],
        callbacks=[LossScaleMonitor(), GradientHistogramMonitor(every_n_steps=50), UnderflowMonitor()],
        logger=L.pytorch.loggers.TensorBoardLogger(args.logdir, name=args.name),
        log_every_n_steps=10,
        val_check_interval=min(100, args.steps),
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    model = Classifier(hidden=args.hidden)
    trainer.fit(model, train, val)
    summary = {
        "steps": trainer.global_step,
        "skipped_steps": plugin.skipped_steps,
        "final_loss_scale": plugin.loss_scale,
        "val_acc": float(trainer.callback_metrics.get("val_acc", float("nan"))),
        "logdir": trainer.logger.log_dir,
    }
    print("quickstart:", ", ".join(f"{k}={v}" for k, v in summary.items()))
    return summary


if __name__ == "__main__":
    main()
