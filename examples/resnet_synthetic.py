"""A small ResNet (BatchNorm, residual blocks) trained with MPTPrecision on synthetic images.

    python examples/resnet_synthetic.py            # fp16, about 70 s on 2 quiet CPU cores
    python examples/resnet_synthetic.py --fast     # a few seconds (what the tests run)
    tensorboard --logdir runs                      # runs/resnet_synthetic: train_loss, val_acc, loss_scale

What it shows: the convolutions and the classifier hold fp16 weights, the BatchNorm layers stay fp32 (weights,
bias and running statistics: ``keep_fp32`` covers every norm layer by default), SGD with Nesterov momentum steps
fp32 masters under a one-cycle LR schedule, and the dynamic loss scaler stays at its initial 2^16 = 65536:
a CNN with BatchNorm and a mean loss has small gradients, so no scaled gradient reaches fp16's 65504 and no step
is skipped. The loss falls from ln(10) = 2.30 to about 0.8 and the validation accuracy reaches about 0.75
(chance: 0.1) in the default 150 steps.

On a GPU, scale it up:

    python examples/resnet_synthetic.py --accelerator gpu --width 64 --blocks 2 --image-size 32 \
        --batch-size 256 --steps 2000
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from example_utils import (
    Classifier,
    decay_groups,
    diagnostics,
    example_parser,
    fit,
    make_trainer,
    parse_args,
    print_summary,
    synthetic_images,
)
from torch import nn
from torch.utils.data import DataLoader

from lightning_mpt import MPTPrecision


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (a 1x1 projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(Classifier):
    """A CIFAR-style ResNet: a 3x3 stem, three stages of ``blocks`` basic blocks (width w, 2w, 4w; the last two
    halve the resolution), global average pooling and a linear classifier.

    Example::

        model = ResNet(classes=4, width=8, blocks=1)
        assert model(torch.randn(2, 3, 16, 16)).shape == (2, 4)
    """

    def __init__(
        self, classes: int = 10, width: int = 16, blocks: int = 1, lr: float = 0.1, weight_decay: float = 5e-4
    ) -> None:
        super().__init__(classes)
        self.save_hyperparameters()
        stem = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        layers: list[nn.Module] = list(stem)
        c = width
        for stage, c_out in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks):
                layers.append(BasicBlock(c, c_out, stride=2 if stage > 0 and i == 0 else 1))
                c = c_out
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))

    def configure_optimizers(self) -> Any:
        groups = decay_groups(self, self.hparams.weight_decay)
        opt = torch.optim.SGD(groups, lr=self.hparams.lr, momentum=0.9, nesterov=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr, total_steps=self.trainer.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Train and return a summary: losses at the start and end, validation accuracy, skipped steps, final scale."""
    p = example_parser(__doc__, steps=150)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--width", type=int, default=16, help="channels of the first stage")
    p.add_argument("--blocks", type=int, default=1, help="residual blocks per stage")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--noise", type=float, default=3.0, help="std of the pixel noise (templates have std 1)")
    args = parse_args(p, argv, fast={"steps": 30, "width": 8, "classes": 4, "image_size": 12, "noise": 2.0})

    L.seed_everything(0, verbose=False)
    train = DataLoader(
        synthetic_images(args.batch_size * args.steps, args.classes, args.image_size, 0, args.noise),
        batch_size=args.batch_size,
        shuffle=True,
    )
    val = DataLoader(synthetic_images(512, args.classes, args.image_size, 1, args.noise), batch_size=256)
    plugin = MPTPrecision(args.precision)
    trainer = make_trainer(
        args, "resnet_synthetic", plugins=[plugin], callbacks=diagnostics(args.steps), val_check_interval=args.steps
    )
    model = ResNet(args.classes, args.width, args.blocks, lr=args.lr)
    summary = fit(trainer, model, train, val)
    print_summary("resnet_synthetic", summary)
    return summary


if __name__ == "__main__":
    main()
