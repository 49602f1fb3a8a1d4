"""One static loss scale for every model: a scale of 1024 that worked for a CNN, reused for a ViT.

    python examples/vit_static_vs_dynamic.py          # two fp16 runs, about 11 s on 2 quiet CPU cores
    python examples/vit_static_vs_dynamic.py --fast   # a few seconds (what the tests run)
    tensorboard --logdir runs/vit_static_vs_dynamic   # side by side: version_<n>/static_1024, version_<n>/dynamic

The same small ViT (same seed, same data) is trained twice in fp16 with AdamW:

* ``static_1024``: ``MPTPrecision("fp16", scaler=1024.0)``, the scale that "worked for ResNet";
* ``dynamic``: ``MPTPrecision("fp16")``, the dynamic scaler (starts at 2^16 = 65536, halves on overflow, doubles
  after ``growth_interval`` clean steps).

The training loss is a *sum* over the batch (``reduction="sum"``), as in code that sums per-example losses. With
Adam this changes nothing in exact arithmetic (Adam's update does not depend on the gradient's magnitude), but it
makes every gradient ``batch_size`` times larger than with a mean. The largest gradients are those of the
``[CLS]`` token and the position embeddings: parameters shared by every example, so their gradient is a sum of
``batch_size`` terms. Measured in this run (batch 128), their largest entry is about 60 at the start and wanders
between 30 and 270 as training goes on. A static scale of 1024 overflows whenever a gradient exceeds
65504 / 1024 = 64: the scaled backward produces ``inf``.

What you should see (printed at the end, and in TensorBoard as ``train_loss``, ``mpt/loss_scale``,
``mpt/skipped_steps`` and ``mpt/overflow``, the "Mixed precision" dashboard of the Custom Scalars tab, and the
gradient exponent histograms ``mpt/grad_exponent/...``, whose inf bucket fills up in the static run):

* static 1024: most steps overflow and are skipped (about 80% by default, all of them with ``--fast``).
  ``MPTPrecision`` refuses to apply an ``inf`` gradient; code without that check would hold NaN weights after the
  first overflow. The few clean steps barely move the loss: training stalls. ``max_consecutive_skips`` is raised
  for this run so that it shows its skips instead of stopping with ``NonFiniteGradientError`` (the guard's default
  is 50 skips in a row). The summary names the parameters that held the inf: ``cls_token`` and ``positions``.
* dynamic: the first 7 steps overflow while the scale halves from 65536 to 512; when the gradients grow it backs
  off once or twice more (to 128 by default), and every other step is applied. The loss falls from ln(10) = 2.3 to
  about 0.1.

``--reduction mean`` divides every gradient by the batch size: then 1024 fits, as it did for the CNN. With
``--growth-interval 50`` the dynamic scale also grows back (doubling after every 50 clean steps) and backs off
again whenever it overflows.

On a GPU, scale it up:

    python examples/vit_static_vs_dynamic.py --accelerator gpu --dim 384 --depth 6 --heads 6 --image-size 32 \
        --patch 4 --batch-size 256 --steps 2000
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import lightning as L
import torch
from example_utils import (
    diagnostics,
    example_parser,
    fit,
    make_trainer,
    next_version,
    parse_args,
    print_summary,
    synthetic_images,
)
from torch import nn
from torch.utils.data import DataLoader

from lightning_mpt import DynamicLossScaler, MPTPrecision

NAME = "vit_static_vs_dynamic"


class ViT(L.LightningModule):
    """A Vision Transformer: patch embedding, ``[CLS]`` token and learned positions, pre-LN encoder, linear head.

    Example::

        model = ViT(image_size=16, patch=4, dim=32, depth=1, heads=2, classes=4)
        assert model(torch.randn(2, 3, 16, 16)).shape == (2, 4)
    """

    def __init__(
        self,
        image_size: int = 16,
        patch: int = 4,
        dim: int = 32,
        depth: int = 2,
        heads: int = 4,
        classes: int = 10,
        lr: float = 1e-3,
        reduction: str = "sum",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.positions = nn.Parameter(0.02 * torch.randn(1, (image_size // patch) ** 2 + 1, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(len(x), -1, -1).to(tokens.dtype), tokens], dim=1)
        return self.head(self.norm(self.encoder(tokens + self.positions.to(tokens.dtype)))[:, 0])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y, reduction=self.hparams.reduction)
        self.log("train_loss", loss / len(y) if self.hparams.reduction == "sum" else loss)  # per example
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05)


def train(args: Any, name: str, plugin: MPTPrecision, version: int) -> dict[str, Any]:
    """One run; returns its summary (skipped steps, scale history, per-example losses at the start and end)."""
    L.seed_everything(0, verbose=False)
    data = DataLoader(
        synthetic_images(args.batch_size * args.steps, args.classes, args.image_size, 0, args.noise),
        batch_size=args.batch_size,
        shuffle=True,
    )
    trainer = make_trainer(
        args, NAME, run=name, version=version, plugins=[plugin], callbacks=diagnostics(args.steps), log_every_n_steps=1
    )
    model = ViT(args.image_size, args.patch, args.dim, args.depth, args.heads, args.classes, args.lr, args.reduction)
    summary = fit(trainer, model, data)
    scales = [r.scale for r in plugin.history]
    skipped = [r for r in plugin.history if r.skipped]
    summary.update(
        first_skipped=skipped[0].step if skipped else None,
        last_skipped=skipped[-1].step if skipped else None,
        min_scale=min(scales),
        scale_changes=_changes(scales),
        # which parameters held the inf: the ones whose gradient sums over the whole batch
        overflowing_params=Counter(name for r in skipped for name in r.nonfinite_params).most_common(3),
    )
    return summary


def _changes(scales: list[float]) -> list[tuple[int, float]]:
    """``(step, scale)`` at the first step and wherever the scale changed: the scale history, compressed."""
    return [(i, s) for i, s in enumerate(scales) if i == 0 or s != scales[i - 1]]


def main(argv: Optional[list[str]] = None) -> dict[str, dict[str, Any]]:
    """Train with a static scale of 1024 and with the dynamic scaler; return both summaries by run name."""
    p = example_parser(__doc__, steps=150, precision=None)
    p.add_argument("--static-scale", type=float, default=1024.0)
    p.add_argument("--growth-interval", type=int, default=2000, help="of the dynamic scaler (torch's default)")
    p.add_argument("--reduction", choices=["sum", "mean"], default="sum", help="'mean' makes 1024 fit again")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--patch", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--noise", type=float, default=1.0, help="std of the pixel noise (templates have std 1)")
    args = parse_args(p, argv, fast={"steps": 40, "depth": 1, "heads": 2, "classes": 4, "image_size": 8, "patch": 4})

    runs = {
        "static_1024" if args.static_scale == 1024 else f"static_{args.static_scale:g}": MPTPrecision(
            "fp16", scaler=args.static_scale, max_consecutive_skips=args.steps + 1
        ),
        "dynamic": MPTPrecision("fp16", scaler=DynamicLossScaler(growth_interval=args.growth_interval)),
    }
    version = next_version(args.logdir, NAME)
    summaries = {name: train(args, name, plugin, version) for name, plugin in runs.items()}
    for name, summary in summaries.items():
        print_summary(f"vit_static_vs_dynamic[{name}]", summary)
    return summaries


if __name__ == "__main__":
    main()
