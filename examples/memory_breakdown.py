"""Where the memory goes under each precision: bytes per parameter and saved-activation bytes per step, measured.

    python examples/memory_breakdown.py                 # all precisions on the BERT example's model, ~1 min on CPU
    python examples/memory_breakdown.py --model vit     # or resnet
    python examples/memory_breakdown.py --fast          # a few seconds (what the tests run)

For each precision a real ``Trainer`` runs a few AdamW steps, and :class:`MemoryProbe` looks at one of them:

* at ``on_before_optimizer_step`` it adds up the tensors that exist: the module's weights and gradients, the
  precision plugin's master copies (``plugin.main_params(optimizer)`` that are not the module's own parameters)
  and their gradients, and the optimizer's state;
* during that step's forward it records every tensor that autograd saves for the backward, with
  ``torch.autograd.graph.saved_tensors_hooks``, counting each storage once and leaving out the parameters
  themselves. Saved half-precision casts of the weights (what autocast makes per op under ``"16-mixed"``) are
  counted apart as "weight copies".

What you should see (measured on the default BERT-like model, 110,530 parameters of which 640 in LayerNorms,
batch 32, AdamW), in bytes per parameter at the optimizer step and MiB saved for the backward:

| precision      | weights | masters | grads | master grads | AdamW state | total | activations | weight copies |
|----------------|---------|---------|-------|--------------|-------------|-------|-------------|---------------|
| 32-true        | 4       | 0       | 4     | 0            | 8           | 16    | 15.8        | 0             |
| 16-mixed       | 4       | 0       | 4     | 0            | 8           | 16    | 10.3        | 0.20          |
| 16-true        | 2       | 0       | 2     | 0            | 4           | 8     | 9.7         | 0             |
| mpt-fp16       | 2.01    | 3.98    | 2.01  | 3.98         | 8           | 20    | 9.7         | 0             |

``bf16-mixed``, ``bf16-true`` and ``mpt-bf16`` match their fp16 rows. ``"16-mixed"`` keeps fp32 weights and
saves a half copy of each in every step's graph (autocast runs with its cache off under Lightning);
``MPTPrecision`` keeps the weights in fp16 (LayerNorms in fp32), so autocast has nothing to copy, plus an fp32
master. At the optimizer step it holds both the half gradients (hooks read them) and their fp32 copies, which it
frees when the next forward starts: 20 bytes per parameter at that moment, against 16 for ``"16-mixed"``. What it
saves is the per-step weight copies, and in DDP half the gradient bytes to all-reduce. ``"16-true"`` is the
smallest (8) because it keeps no fp32 copy at all, and pays for it in lost updates (see the concepts page).
Saved activations drop to about 61% of fp32's, not 50%: integer token ids, boolean masks, LayerNorm
statistics and the loss do not shrink.

On a GPU the peak allocated memory of the measured step is reported as well:

    python examples/memory_breakdown.py --accelerator gpu --model bert --width 768 --depth 12 --heads 12 \
        --batch-size 32
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from example_utils import (
    PRECISIONS, example_parser, make_trainer, next_version, parse_args, precision_setup, synthetic_images,
)
from lightning_mpt import MPTPrecision

NORM_LAYERS = MPTPrecision().keep_fp32  # the default keep_fp32: every norm layer
MiB = 2**20


class MemoryProbe(L.Callback):
    """Measures the tensors of one training step (``at_step``): static bytes and saved-activation bytes.

    After that step ``probe.result`` holds byte counts: ``params`` and ``norm_params`` (element counts),
    ``weights``, ``masters``, ``grads``, ``master_grads``, ``optimizer_state``, ``activations``,
    ``weight_copies`` and, on CUDA, ``peak_allocated``.

    Example::

        probe = MemoryProbe(at_step=2)
        L.Trainer(max_steps=3, plugins=[MPTPrecision("bf16")], callbacks=[probe]).fit(model, data)
        print(probe.result["masters"] / probe.result["params"])   # about 4 bytes per parameter
    """

    def __init__(self, at_step: int = 2) -> None:
        self.at_step = at_step
        self.result: dict[str, int] = {}
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._own: set[int] = set()  # storages of parameters and masters: not activations
        self._saved: dict[int, int] = {}
        self._copies: dict[int, int] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != self.at_step:
            return
        self._own = {_storage(p) for p in pl_module.parameters()}
        self._own |= {_storage(m) for opt in trainer.optimizers for m in trainer.precision_plugin.main_params(opt)}
        self._saved, self._copies = {}, {}
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def _pack(self, t: Tensor) -> Tensor:
        key = _storage(t)
        if key not in self._own:
            target = self._copies if _is_weight_cast(t) else self._saved
            target[key] = t.untyped_storage().nbytes()
        return t

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        if self._hooks is not None:  # the forward is over: the backward saves nothing we count
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != self.at_step:
            return
        params = list(pl_module.parameters())
        ids = {id(p) for p in params}
        masters = [m for m in trainer.precision_plugin.main_params(optimizer) if id(m) not in ids]
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        counted: set[int] = set()  # each storage once: a module gradient that is its master's gradient is one tensor
        self.result = {
            "params": sum(p.numel() for p in params),
            "norm_params": sum(p.numel() for m in pl_module.modules() if isinstance(m, NORM_LAYERS)
                               for p in m.parameters(recurse=False)),
            "weights": _nbytes(params, counted),
            "masters": _nbytes(masters, counted),
            "master_grads": _nbytes((m.grad for m in masters), counted),
            "grads": _nbytes((p.grad for p in params), counted),
            "optimizer_state": _nbytes(state, counted),
            "activations": sum(self._saved.values()),
            "weight_copies": sum(self._copies.values()),
        }

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.result and torch.cuda.is_available() and "peak_allocated" not in self.result:
            self.result["peak_allocated"] = torch.cuda.max_memory_allocated()


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _nbytes(tensors: Any, counted: set[int]) -> int:
    """Bytes of ``tensors`` whose storage is not in ``counted`` yet (which they join)."""
    total = 0
    for t in tensors:
        if t is not None and _storage(t) not in counted:
            counted.add(_storage(t))
            total += t.numel() * t.element_size()
    return total


def _is_weight_cast(t: Tensor) -> bool:
    """Whether ``t`` is (a view of) a dtype cast of a leaf that requires grad: autocast's per-op copy of a weight."""
    fn = (t._base if t._is_view() else t).grad_fn  # linear saves the transposed view of the cast weight
    return fn is not None and fn.name() == "ToCopyBackward0" and any(
        type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None
    )


def build(model: str, width: int, depth: int, heads: int, n: int) -> tuple[L.LightningModule, Dataset]:
    """One of the other examples' models, at the given size, with ``n`` samples of its data."""
    if model == "bert":
        from bert_finetune import TinyBert, sentiment_data

        return TinyBert(dim=width, layers=depth, heads=heads), sentiment_data(n, 64, 32, seed=0)
    if model == "vit":
        from vit_static_vs_dynamic import ViT

        return ViT(dim=width, depth=depth, heads=heads, reduction="mean"), synthetic_images(n, 10, 16, 0)
    if model == "resnet":
        from resnet_synthetic import ResNet

        return ResNet(width=width, blocks=depth), synthetic_images(n, 10, 16, 0)
    raise ValueError(f"unknown model {model!r}")


def measure(precision: str, args: Any, version: Optional[int] = None) -> dict[str, int]:
    """Train ``args.model`` for ``args.steps`` steps under ``precision`` (one of :data:`PRECISIONS`) and probe the
    last one."""
    L.seed_everything(0, verbose=False)
    probe = MemoryProbe(at_step=args.steps - 1)  # a later step: the optimizer's state exists by then
    model, data = build(args.model, args.width, args.depth, args.heads, args.batch_size * args.steps)
    trainer = make_trainer(args, "memory_breakdown", run=precision, version=version, callbacks=[probe],
                           **precision_setup(precision, args.accelerator))
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size))
    per_param = {k: v / probe.result["params"] for k, v in probe.result.items() if k not in ("params", "norm_params")}
    trainer.logger.log_metrics({f"memory/{k}": v for k, v in per_param.items()}, step=0)
    return probe.result


def format_table(results: dict[str, dict[str, int]]) -> str:
    """A markdown table: bytes per parameter of each kind, MiB saved for the backward per step and, on CUDA, the
    step's peak allocated MiB."""
    peak = all("peak_allocated" in r for r in results.values())
    head = ("| precision | weights | masters | grads | master grads | optimizer state | total B/param "
            "| activations MiB | weight copies MiB |" + (" peak MiB |" if peak else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        n = r["params"]
        kinds = [r[k] / n for k in ("weights", "masters", "grads", "master_grads", "optimizer_state")]
        mib = [r["activations"], r["weight_copies"]] + ([r["peak_allocated"]] if peak else [])
        cells = [f"{v:.2f}" for v in kinds] + [f"{sum(kinds):.2f}"] + [f"{v / MiB:.2f}" for v in mib]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, dict[str, int]]:
    """Measure every precision; print a table and return the byte counts by precision name."""
    p = example_parser(__doc__, steps=3, precision=None)
    p.add_argument("--model", choices=["bert", "vit", "resnet"], default="bert")
    p.add_argument("--width", type=int, default=64, help="model dim (bert, vit) or first-stage channels (resnet)")
    p.add_argument("--depth", type=int, default=2, help="layers (bert, vit) or blocks per stage (resnet)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (bert, vit)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    args = parse_args(p, argv, fast=dict(width=32, depth=1, heads=2, batch_size=8))
    version = next_version(args.logdir, "memory_breakdown")
    results = {name: measure(name, args, version) for name in args.precisions}
    n = next(iter(results.values()))
    print(f"memory_breakdown: {args.model}, {n['params']} parameters ({n['norm_params']} in norm layers), "
          f"batch {args.batch_size}\n{format_table(results)}")
    return results


if __name__ == "__main__":
    main()
