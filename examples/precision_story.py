"""The demo that tells the story: a real overflow and the scaler's recovery, gradients that underflow at a low scale,
and what ``lightning-mpt report`` advises.

    python examples/precision_story.py            # about 5 s on 2 quiet CPU cores; runs/story, the report
    python examples/precision_story.py --fast     # 60 steps: the same story, shorter (a few seconds)
    lightning-mpt report runs/story               # the same report again; plots in runs/story/report
    tensorboard --logdir runs/story               # then http://localhost:6006/#custom_scalars&_smoothingWeight=0

The quickstart classifier (examples/quickstart.py) trains twice in fp16 with its loss weighted by 2^-12, as a small
auxiliary-loss weight or a mean over many tokens weights it, so its gradients are small (AdamW does not mind: it is
invariant to the loss's scale):

- ``dynamic``: the dynamic loss scaler, started at 2^32, above what the gradients allow: its first steps overflow and
  it backs off. Then it grows every 20 clean steps until a gradient overflows again (a real overflow, nothing
  injected), skips that step, backs off and recovers: the sawtooth of a dynamic scale.
- ``unscaled``: a static scale of 1 (no loss scaling). Nothing overflows, but fp16 flushes the smallest gradients to
  zero; the fp32 reference of ``UnderflowMonitor`` counts them, layer by layer.

Everything is seeded: the same numbers on every run of the same torch on the same CPU.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from quickstart import Classifier, synthetic
from torch.utils.data import DataLoader

from lightning_mpt import DynamicLossScaler, MPTPrecision
from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor
from lightning_mpt.cli import main as report

LOSS_WEIGHT = 2.0**-12


class WeightedLoss(Classifier):
    """The quickstart classifier with its loss times :data:`LOSS_WEIGHT`: every gradient 2^12 times smaller."""

    validation_step = None  # the demo trains only: no "validation_step but no val_dataloader" warning

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * LOSS_WEIGHT


def scalers() -> dict[str, Any]:
    """The two runs' scalers: a dynamic one that starts too high and grows quickly, and a static scale of 1."""
    # max_scale above the default 2^24: these small gradients need about 2^28 before the largest overflows
    return {
        "dynamic": DynamicLossScaler(init_scale=2.0**32, growth_interval=20, max_scale=2.0**40),
        "unscaled": 1.0,
    }


def train(name: str, scaler: Any, steps: int, logdir: str, accelerator: str = "cpu") -> dict[str, Any]:
    """One seeded fp16 run with the three monitors; what the plugin saw. The run's folder of an earlier demo is
    replaced: the report would read both runs' events as one."""
    shutil.rmtree(Path(logdir) / name, ignore_errors=True)
    L.seed_everything(0, verbose=False)
    plugin = MPTPrecision("fp16", scaler=scaler)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        plugins=[plugin],
        callbacks=[
            LossScaleMonitor(),
            GradientHistogramMonitor(every_n_steps=max(1, steps // 4)),
            UnderflowMonitor(every_n_steps=5, reference_every_n_steps=20),
        ],
        logger=L.pytorch.loggers.TensorBoardLogger(logdir, name=name, version=""),
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    data = DataLoader(synthetic(32 * 160, 32, 8, 0), batch_size=32, shuffle=True)  # one epoch of the default run
    trainer.fit(WeightedLoss(), data)
    return {
        "steps": trainer.global_step,
        "skipped": [r.step for r in plugin.history if r.skipped],
        "scales": [r.scale for r in plugin.history],
        "loss": float(trainer.callback_metrics["train_loss"]),
        "logdir": trainer.logger.log_dir,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--fast", action="store_true", help="60 steps (what tests/test_examples.py runs)")
    p.add_argument("--accelerator", default="cpu", help="the numbers in the docs are the CPU's")
    p.add_argument("--logdir", default="runs/story")
    p.add_argument("--no-plots", action="store_true", help="print the report only")
    args = p.parse_args(argv)

    steps = 60 if args.fast else args.steps
    runs = {name: train(name, scaler, steps, args.logdir, args.accelerator) for name, scaler in scalers().items()}
    for name, run in runs.items():
        print(f"{name}: {len(run['skipped'])} skipped steps of {run['steps']} (at {run['skipped']})")
    print()
    code = report(["report", args.logdir, *(["--no-plots"] if args.no_plots else [])])
    if code:
        raise SystemExit(code)
    return {"runs": runs, "report": str(Path(args.logdir))}


if __name__ == "__main__":
    main()
