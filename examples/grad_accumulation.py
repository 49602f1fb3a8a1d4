"""How much a long gradient accumulation loses when micro-batches are summed in the half format, and what
``MPTPrecision(accumulate_fp32=True)`` gives back, measured against an fp64 reference of the same gradient.

    python examples/grad_accumulation.py                  # 64, 256 and 1024 micro-batches, fp16 and bf16 (~9 s)
    python examples/grad_accumulation.py --micro-batches 64
    python examples/grad_accumulation.py --fast           # what the tests run

A real ``Trainer`` accumulates ``--micro-batches`` micro-batches (``accumulate_grad_batches``) for one optimizer step
of a small MLP regression model. The gradient the optimizer is handed (the fp32 master gradient, at
``on_before_optimizer_step``) is compared with the exact gradient of the same mean loss computed in fp64 on the same
weights and batches. Each micro-batch's own gradient is computed in the half format either way (that is the point of
mixed precision); what differs is the sum:

* a half-precision running sum rounds at every addition, so the later micro-batches' small contributions lose bits
  against the growing sum: bf16's default sums so (its step then holds no fp32 gradient), and fp16 where the half
  weights get no masters (``master_weights=False``, measured here) or step in chunks (``chunked_step=True``);
* ``accumulate_fp32=True`` sums them in fp32 (Megatron's ``main_grad``; torch >= 2.13), rounding once per micro-batch;
  fp16's default does the same from the second micro-batch on (its step holds fp32 gradients anyway), so it measures
  as the fp32 column.

The relative error is ``|g - g64| / |g64|`` over all parameters. Each micro-batch's own rounding error shrinks in
the mean like 1/sqrt(N); the half-precision running sum's error grows with N, so the longer the accumulation, the more
the fp32 sum matters. Measured here: docs/concepts.md, "Long gradient accumulation".
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import lightning as L
import torch
from example_utils import example_parser, parse_args
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision


class Regression(L.LightningModule):
    """An MLP regression model that records the gradient it is about to step (the fp32 master gradients)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        self.stepped: Optional[list[torch.Tensor]] = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float().squeeze(1), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        plugin = self.trainer.precision_plugin
        self.stepped = [plugin.master_of(p).grad.double().clone() for p in self.parameters()]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # only the gradient matters here


def data(micro_batches: int, batch: int, width: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(micro_batches * batch, width, generator=g)
    y = x[:, 0] + 0.1 * torch.randn(micro_batches * batch, generator=g)
    return TensorDataset(x, y)


def reference(model: Regression, dataset: TensorDataset, micro_batches: int, batch: int) -> list[torch.Tensor]:
    """The exact gradient Lightning's accumulation computes (the mean of the micro-batch losses), in fp64."""
    ref = copy.deepcopy(model.net).double()
    x, y = (t.double() for t in dataset.tensors)
    losses = [
        nn.functional.mse_loss(ref(x[i * batch : (i + 1) * batch]).squeeze(1), y[i * batch : (i + 1) * batch])
        for i in range(micro_batches)
    ]
    (torch.stack(losses).sum() / micro_batches).backward()
    return [p.grad for p in ref.parameters()]


def relative_error(got: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    num = sum(float((g - e).pow(2).sum()) for g, e in zip(got, exact))
    den = sum(float(e.pow(2).sum()) for e in exact)
    return (num / den) ** 0.5


def measure(precision: str, accumulate_fp32: bool, args: Any) -> float:
    """The relative error of the gradient a step is handed, summed in fp32 (``accumulate_fp32``) or in the half
    format (bf16's default; fp16 without masters)."""
    torch.manual_seed(0)
    model = Regression(args.width)
    dataset = data(args.n, args.batch_size, args.width)
    exact = reference(model, dataset, args.n, args.batch_size)
    scale = 2.0**8 if precision == "fp16" else None  # a static scale: this one step must not be skipped
    # the whole step: its hooks see the masters' fp32 gradients, the sum this example measures (bf16's default steps
    # in chunks, which hold none at the hooks)
    half_sum = {"master_weights": False} if precision == "fp16" and not accumulate_fp32 else {"chunked_step": False}
    plugin = MPTPrecision(precision, scaler=scale, accumulate_fp32=accumulate_fp32, **half_sum)  # type: ignore[arg-type]
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=1,
        accumulate_grad_batches=args.n,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset, batch_size=args.batch_size))
    assert model.stepped is not None
    assert plugin.skipped_steps == 0
    return relative_error(model.stepped, [e.to(model.stepped[0].device) for e in exact])


def main(argv: Optional[list[str]] = None) -> dict[tuple[str, int], dict[str, float]]:
    """Measure every combination; print a table and return ``{(format, micro-batches): {"half": err, "fp32": err}}``."""
    p = example_parser(__doc__, steps=1, precision=None)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    args = parse_args(p, argv, fast={"micro_batches": [32], "batch_size": 16, "width": 32})
    results: dict[tuple[str, int], dict[str, float]] = {}
    for precision in ("fp16", "bf16"):
        for n in args.micro_batches:
            args.n = n
            results[(precision, n)] = {"half": measure(precision, False, args), "fp32": measure(precision, True, args)}
    print(f"grad_accumulation: micro-batches of {args.batch_size}, MLP width {args.width}")
    print("| format | micro-batches | relative error, half-precision sum | relative error, fp32 sum | ratio |")
    print("|---|--:|--:|--:|--:|")
    for (precision, n), r in results.items():
        print(f"| {precision} | {n} | {r['half']:.2e} | {r['fp32']:.2e} | {r['half'] / r['fp32']:.1f}x |")
    return results


if __name__ == "__main__":
    main()
