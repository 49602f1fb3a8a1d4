"""Pieces the examples share: command-line flags, a Trainer factory with the diagnostic callbacks, a classifier
base, synthetic images, and the names of the precisions that the memory example and the benchmarks compare.

Each example is a script (``python examples/<name>.py --help``) and a function ``main(argv) -> dict`` that the test
suite calls with ``["--fast"]``. Running from the repository root or from ``examples/`` both work, because Python
puts the script's folder on ``sys.path``.

Example::

    parser = example_parser(__doc__, steps=200)
    args = parse_args(parser, ["--fast"], fast=dict(steps=10))
    trainer = make_trainer(args, "my_example", plugins=[MPTPrecision("fp16")])
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Optional

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision
from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor

# The precisions the memory example and the benchmark table compare: Lightning's names, and ours.
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "mpt-fp16", "mpt-bf16")


def precision_setup(name: str, accelerator: str = "cpu") -> dict[str, Any]:
    """Trainer keyword arguments for one of :data:`PRECISIONS`.

    ``"16-mixed"`` on CPU is real fp16 autocast with a ``GradScaler``: ``Trainer(precision="16-mixed")`` would
    silently switch to bf16 there.

    Example::

        trainer = L.Trainer(max_steps=1, **precision_setup("mpt-fp16"))
    """
    if name.startswith("mpt-"):
        return {"plugins": [MPTPrecision(name[len("mpt-") :])]}  # type: ignore[arg-type]
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; expected one of {PRECISIONS}")
    if name == "16-mixed" and accelerator == "cpu":
        return {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    return {"precision": name}


def example_parser(doc: Optional[str], *, steps: int, precision: Optional[str] = "fp16") -> argparse.ArgumentParser:
    """The flags every example has: ``--fast``, ``--accelerator``, ``--steps``, ``--logdir`` and, unless
    ``precision`` is ``None``, ``--precision fp16|bf16`` for :class:`MPTPrecision`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fast", action="store_true", help="a few seconds on CPU (what the test suite runs)")
    p.add_argument("--accelerator", default="cpu", help="cpu, gpu, auto, ...")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--logdir", default="runs", help="TensorBoard logs go to <logdir>/<example name>")
    if precision is not None:
        p.add_argument("--precision", choices=["fp16", "bf16"], default=precision, help="MPTPrecision format")
    return p


def parse_args(parser: argparse.ArgumentParser, argv: Optional[list[str]], fast: dict[str, Any]) -> argparse.Namespace:
    """Parse ``argv``; with ``--fast`` the ``fast`` values become the defaults (flags given explicitly still win)."""
    args = parser.parse_args(argv)
    if args.fast:
        parser.set_defaults(**fast)
        args = parser.parse_args(argv)
    return args


def diagnostics(steps: int) -> list[L.Callback]:
    """The three diagnostic callbacks at a cadence that gives about ten points (histograms, fractions) and three
    fp32 reference measurements per run: the ``mpt/`` scalars and the "Mixed precision" dashboard in TensorBoard."""
    every = max(1, steps // 10)
    return [
        LossScaleMonitor(),
        GradientHistogramMonitor(every_n_steps=every),
        UnderflowMonitor(every_n_steps=every, reference_every_n_steps=max(1, steps // 3)),
    ]


def next_version(logdir: str, name: str) -> int:
    """The version number the next TensorBoard log under ``<logdir>/<name>`` gets (``version_<n>``)."""
    return L.pytorch.loggers.TensorBoardLogger(logdir, name=name).version


def make_trainer(
    args: argparse.Namespace, name: str, run: Optional[str] = None, version: Optional[int] = None, **kwargs: Any
) -> L.Trainer:
    """A quiet Trainer with a :class:`LossHistory` that logs to TensorBoard under ``<args.logdir>/<name>/version_<n>``.

    Examples that compare runs pass the same ``version`` (from :func:`next_version`) and a ``run`` name each: the
    runs log to ``version_<n>/<run>`` and TensorBoard shows them side by side.
    """
    logger = L.pytorch.loggers.TensorBoardLogger(args.logdir, name=name, version=version, sub_dir=run)
    defaults: dict[str, Any] = {
        "accelerator": args.accelerator,
        "devices": 1,
        "max_steps": args.steps,
        "logger": logger,
        "log_every_n_steps": min(10, args.steps),
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "enable_progress_bar": False,
        "num_sanity_val_steps": 0,
    }
    defaults.update(kwargs)
    defaults["callbacks"] = [LossHistory(), *defaults.get("callbacks", [])]
    return L.Trainer(**defaults)


def fit(
    trainer: L.Trainer, model: L.LightningModule, train: DataLoader, val: Optional[DataLoader] = None
) -> dict[str, Any]:
    """``trainer.fit`` and a summary: steps, mean ``train_loss`` of the first and last 5 steps, ``val_acc`` if
    validated, skipped steps and final loss scale (under :class:`MPTPrecision`), seconds, log directory."""
    history = next(cb for cb in trainer.callbacks if isinstance(cb, LossHistory))
    t0 = time.perf_counter()
    trainer.fit(model, train, val)
    seconds = time.perf_counter() - t0
    first, last = history.loss_drop()
    summary: dict[str, Any] = {"steps": trainer.global_step, "first_loss": first, "last_loss": last}
    if "val_acc" in trainer.callback_metrics:
        summary["val_acc"] = float(trainer.callback_metrics["val_acc"])
    plugin = trainer.precision_plugin
    if isinstance(plugin, MPTPrecision):
        summary.update(skipped_steps=plugin.skipped_steps, final_loss_scale=plugin.loss_scale)
    summary.update(seconds=seconds, logdir=trainer.logger.log_dir)
    return summary


def synthetic_images(n: int, classes: int, size: int, seed: int, noise: float = 1.0) -> TensorDataset:
    """Noisy copies of one fixed random template per class, shifted by up to a quarter of the image.

    Train and validation sets made with different ``seed`` share the templates, so the task is learnable; the
    random shifts make convolutions and attention, not a single linear map, the natural solution.

    Example::

        x, y = synthetic_images(8, classes=4, size=16, seed=0)[:]
        assert x.shape == (8, 3, 16, 16) and int(y.max()) < 4
    """
    smooth = torch.nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
    templates = smooth(torch.randn(classes, 3, size, size, generator=torch.Generator().manual_seed(1234)))
    templates = templates / templates.std(dim=(1, 2, 3), keepdim=True)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    shifts = torch.randint(-(size // 4), size // 4 + 1, (n, 2), generator=g)
    x = torch.stack([torch.roll(templates[c], (int(dy), int(dx)), dims=(1, 2)) for c, (dy, dx) in zip(y, shifts)])
    return TensorDataset(x + noise * torch.randn(x.shape, generator=g), y)


class Classifier(L.LightningModule):
    """Cross-entropy training with torchmetrics accuracy, for a subclass whose ``forward`` maps inputs to logits.

    Logs ``train_loss`` and ``train_acc`` every logging step and ``val_acc`` per validation run.

    Example::

        class Linear(Classifier):
            def __init__(self):
                super().__init__(classes=3)
                self.fc = nn.Linear(8, 3)

            def forward(self, x):
                return self.fc(x)
    """

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(classes, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(classes, average="micro")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        logits = self(inputs)
        loss = nn.functional.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log_dict({"train_loss": loss, "train_acc": self.train_acc})
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, labels = batch
        self.val_acc(self(inputs), labels)
        self.log("val_acc", self.val_acc)


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Optimizer parameter groups with weight decay on matrices and kernels only, not on biases and norm
    parameters (the usual recipe for ResNet and BERT)."""
    params = list(module.parameters())
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]


def print_summary(name: str, summary: dict[str, Any]) -> None:
    """One line ``name: key=value, ...`` with floats to four significant digits.

    Written and flushed in one call: processes that share the stdout pipe cannot split the line.
    """
    fields = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items())
    sys.stdout.write(f"{name}: {fields}\n")
    sys.stdout.flush()


class LossHistory(L.Callback):
    """Keeps the logged ``train_loss`` of every step (read at the end: no host sync per step).

    Example::

        history = LossHistory()     # make_trainer adds one
        trainer = L.Trainer(max_steps=20, callbacks=[history])
        trainer.fit(model)          # a model that logs "train_loss" at every step
        print(history.losses[0], history.losses[-1])
    """

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self._losses.append(loss.detach().float().clone())

    @property
    def losses(self) -> list[float]:
        """The training loss of every step so far."""
        return torch.stack(self._losses).tolist() if self._losses else []

    def loss_drop(self, window: int = 5) -> tuple[float, float]:
        """Mean training loss over the first and over the last ``window`` steps."""
        losses = self.losses
        return statistics.fmean(losses[:window]), statistics.fmean(losses[-window:])
