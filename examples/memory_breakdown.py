"""Where the memory goes under each precision: bytes per parameter and saved-activation bytes per step, measured.

    python examples/memory_breakdown.py                 # all precisions on the BERT example's model, ~4 s on CPU
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

Per rank under FSDP2 (Lightning's ``ModelParallelStrategy``, ``fully_shard`` on every encoder layer and on the
model), on 2 CPU processes by default, with the bytes each rank sends through FSDP's all-gathers and
reduce-scatters per step (counted at the collectives):

    python examples/memory_breakdown.py --strategy fsdp            # --devices 4, --accelerator gpu, --fast

Measured on the default BERT-like model (110,530 parameters, batch 32, AdamW) on 2 processes, per rank: bytes per
parameter of the model, and bytes sent per step:

| precision | fp32 shards | grad shards | AdamW | total | half, step | half, fwd peak | all-gather B | r-scatter B |
|------------|------|------|------|------|------|------|--------|--------|
| 32-true    | 2.00 | 2.00 | 4.00 | 8.00 | 0.00 | 2.19 (fp32) | 420996 | 442120 |
| bf16-mixed | 2.00 | 2.00 | 4.00 | 8.00 | 0.00 | 1.10 | 210498 | 221060 |
| mpt-fp16   | 2.00 | 2.00 | 4.00 | 8.00 | 0.00 | 1.10 | 210498 | 221060 |
| mpt-bf16   | 2.00 | 2.00 | 4.00 | 8.00 | 0.00 | 1.10 | 210498 | 221060 |

The fp32 masters (FSDP's own parameter shards: there is no second fp32 copy), their gradients and AdamW's state
are divided by the world size: 16 bytes per parameter on one device, 16/N on each of N ranks. The half compute copy
exists only while FSDP has a block all-gathered (the model's root group and one encoder layer at the forward's
peak here) and nothing of it is left at the optimizer step. The all-gathers and reduce-scatters move half the bytes
of an fp32 FSDP2 run (0.50x).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import lightning as L
import torch
from example_utils import (
    PRECISIONS,
    example_parser,
    make_trainer,
    next_version,
    parse_args,
    precision_setup,
    synthetic_images,
)
from tensor_bytes import is_shard, is_weight_cast, master_tensors, nbytes, storage
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_mpt import MPTPrecision

try:  # FSDP2 (torch >= 2.6): only for --strategy fsdp
    from collectives import CollectiveBytes
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

FSDP_PRECISIONS = ("32-true", "bf16-mixed", "mpt-fp16", "mpt-bf16")  # what ModelParallelStrategy can run

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
        self._comm: Optional[Any] = None  # a CollectiveBytes under FSDP2
        self._gather_hooks: list[Any] = []
        self._gathered_peak = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != self.at_step:
            return
        self._fsdp_start(pl_module)
        self._own = {storage(p) for p in pl_module.parameters()}
        self._own |= {storage(m) for opt in trainer.optimizers for m in master_tensors(trainer.precision_plugin, opt)}
        self._saved, self._copies = {}, {}
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def _pack(self, t: Tensor) -> Tensor:
        key = storage(t)
        if key not in self._own:
            target = self._copies if is_weight_cast(t) else self._saved
            target[key] = t.untyped_storage().nbytes()
        return t

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        if self._hooks is not None:  # the forward is over: the backward saves nothing we count
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        for h in self._gather_hooks:
            h.remove()
        self._gather_hooks = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != self.at_step:
            return
        params = list(pl_module.parameters())
        ids = {id(p) for p in params}
        masters = [m for m in master_tensors(trainer.precision_plugin, optimizer) if id(m) not in ids]
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        counted: set[Any] = set()  # each tensor once: a module gradient that is its master's gradient is one tensor
        self.result = {
            "params": sum(p.numel() for p in params),
            "norm_params": sum(
                p.numel()
                for m in pl_module.modules()
                if isinstance(m, NORM_LAYERS)
                for p in m.parameters(recurse=False)
            ),
            "weights": nbytes(params, counted),
            "masters": nbytes(masters, counted),
            "master_grads": nbytes((m.grad for m in masters), counted),
            "grads": nbytes((p.grad for p in params), counted),
            "optimizer_state": nbytes(state, counted),
            "activations": sum(self._saved.values()),
            "weight_copies": sum(self._copies.values()),
        }
        if self._comm is not None:  # FSDP2: the half copy now and at the forward's peak; the step's collectives
            self.result["gathered_at_step"] = nbytes((p for p in params if not is_shard(p)), set())
            self.result["gathered_peak"] = self._gathered_peak
            self._comm.__exit__(None, None, None)  # the forward, the backward and the step decision are done
            self.result.update(self._comm.sent)
            self._comm = None

    def _fsdp_start(self, pl_module: L.LightningModule) -> None:
        """Under FSDP2: count the bytes sent through collectives during this step, and the largest amount of
        all-gathered (unsharded) parameters that exists at once in the forward."""
        self._gather_hooks: list[Any] = []
        if DTensor is None or not any(isinstance(p, DTensor) for p in pl_module.parameters()):
            return
        self._gathered_peak = 0
        modules = list(pl_module.modules())

        def gathered(*_: Any) -> None:  # runs after FSDP's own pre-forward hook, which all-gathers
            now = nbytes((p for p in pl_module.parameters() if not is_shard(p)), set())
            self._gathered_peak = max(self._gathered_peak, now)

        self._gather_hooks = [m.register_forward_pre_hook(gathered) for m in modules]
        self._comm = CollectiveBytes()
        self._comm.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.result and torch.cuda.is_available() and "peak_allocated" not in self.result:
            self.result["peak_allocated"] = torch.cuda.max_memory_allocated()


def build(
    model: str, width: int, depth: int, heads: int, n: int, fsdp: bool = False
) -> tuple[L.LightningModule, Dataset]:
    """One of the other examples' models, at the given size, with ``n`` samples of its data, as :func:`_trained`
    makes it (``fsdp``: sharded with FSDP2)."""
    if model == "bert":
        from bert_finetune import TinyBert, sentiment_data

        return _trained(TinyBert, fsdp)(dim=width, layers=depth, heads=heads), sentiment_data(n, 64, 32, seed=0)
    if model == "vit":
        from vit_static_vs_dynamic import ViT

        return _trained(ViT, fsdp)(dim=width, depth=depth, heads=heads, reduction="mean"), synthetic_images(
            n, 10, 16, 0
        )
    if model == "resnet":
        from resnet_synthetic import ResNet

        return _trained(ResNet, False)(width=width, blocks=depth), synthetic_images(n, 10, 16, 0)
    raise ValueError(f"unknown model {model!r}")


def shard(module: L.LightningModule) -> None:
    """FSDP2 as Lightning documents it: ``fully_shard`` each encoder layer, then the whole model (its forward is
    what ``training_step`` calls), with the precision plugin's policy: ``MPTPrecision.mp_policy``, bf16 for
    Lightning's ``"bf16-mixed"``, none (fp32) for ``"32-true"``."""
    plugin = module.trainer.precision_plugin
    if isinstance(plugin, MPTPrecision):
        policy = {"mp_policy": plugin.mp_policy}
    elif plugin.precision == "bf16-mixed":
        policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}
    else:
        policy = {}
    mesh = module.device_mesh["data_parallel"]
    for layer in module.encoder.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(module, mesh=mesh, **policy)


def _trained(cls: type, fsdp: bool) -> type:
    """``cls`` as this example trains it: with no validation loop (Lightning warns about a ``validation_step`` that
    has no ``val_dataloader``) and, with ``fsdp``, a ``configure_model`` that shards it (:func:`shard`)."""
    body: dict[str, Any] = {"validation_step": None, "__module__": __name__}
    if fsdp:
        body["configure_model"] = shard
    return type(f"{'Sharded' if fsdp else 'Measured'}{cls.__name__}", (cls,), body)


def measure(precision: str, args: Any, version: Optional[int] = None) -> dict[str, int]:
    """Train ``args.model`` for ``args.steps`` steps under ``precision`` (one of :data:`PRECISIONS`) and probe the
    last one."""
    L.seed_everything(0, verbose=False)
    probe = MemoryProbe(at_step=args.steps - 1)  # a later step: the optimizer's state exists by then
    fsdp = args.strategy == "fsdp"
    model, data = build(args.model, args.width, args.depth, args.heads, args.batch_size * args.steps, fsdp=fsdp)
    distributed = {}
    if fsdp:
        from lightning.pytorch.strategies import ModelParallelStrategy

        distributed = {"devices": args.devices, "strategy": ModelParallelStrategy(args.devices, 1)}
    trainer = make_trainer(
        args,
        "memory_breakdown",
        run=precision,
        version=version,
        callbacks=[probe],
        **distributed,
        **precision_setup(precision, args.accelerator),
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size))
    per_param = {k: v / probe.result["params"] for k, v in probe.result.items() if k not in ("params", "norm_params")}
    trainer.logger.log_metrics({f"memory/{k}": v for k, v in per_param.items()}, step=0)
    return probe.result


def format_table(results: dict[str, dict[str, int]]) -> str:
    """A markdown table: bytes per parameter of each kind, MiB saved for the backward per step and, on CUDA, the
    step's peak allocated MiB."""
    peak = all("peak_allocated" in r for r in results.values())
    head = (
        "| precision | weights | masters | grads | master grads | optimizer state | total B/param "
        "| activations MiB | weight copies MiB |" + (" peak MiB |" if peak else "")
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        n = r["params"]
        kinds = [r[k] / n for k in ("weights", "masters", "grads", "master_grads", "optimizer_state")]
        mib = [r["activations"], r["weight_copies"]] + ([r["peak_allocated"]] if peak else [])
        cells = [f"{v:.2f}" for v in kinds] + [f"{sum(kinds):.2f}"] + [f"{v / MiB:.2f}" for v in mib]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_fsdp_table(results: dict[str, dict[str, int]]) -> str:
    """A markdown table for FSDP2, per rank: bytes per parameter of the model held at the optimizer step, the half
    compute copy at the step and at its peak in the forward, and the bytes sent per step through the collectives."""
    head = (
        "| precision | fp32 shards (masters) | grad shards | optimizer state | total at the step B/param "
        "| half copy at the step | half copy, forward peak | all-gather B/step | reduce-scatter B/step |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        n = r["params"]
        kinds = [(r["weights"] + r["masters"]) / n, (r["grads"] + r["master_grads"]) / n, r["optimizer_state"] / n]
        copies = [r["gathered_at_step"] / n, r["gathered_peak"] / n]
        cells = [f"{v:.2f}" for v in kinds] + [f"{sum(kinds):.2f}"] + [f"{v:.2f}" for v in copies]
        lines.append(f"| {name} | " + " | ".join(cells + [str(r["all_gather"]), str(r["reduce_scatter"])]) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, dict[str, int]]:
    """Measure every precision; print a table and return the byte counts by precision name."""
    p = example_parser(__doc__, steps=3, precision=None)
    p.add_argument("--model", choices=["bert", "vit", "resnet"], default="bert")
    p.add_argument("--width", type=int, default=64, help="model dim (bert, vit) or first-stage channels (resnet)")
    p.add_argument("--depth", type=int, default=2, help="layers (bert, vit) or blocks per stage (resnet)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (bert, vit)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--precisions",
        nargs="+",
        choices=PRECISIONS,
        default=None,
        help=f"default: all ({', '.join(FSDP_PRECISIONS)} with --strategy fsdp)",
    )
    p.add_argument(
        "--strategy",
        choices=["single", "fsdp"],
        default="single",
        help="fsdp: FSDP2 through ModelParallelStrategy on --devices processes (per-rank numbers)",
    )
    p.add_argument("--devices", type=int, default=2, help="processes (or GPUs) for --strategy fsdp")
    p.add_argument("--json", default=None, help="also write the byte counts to this file (per rank under fsdp)")
    args = parse_args(p, argv, fast={"width": 32, "depth": 1, "heads": 2, "batch_size": 8})
    fsdp = args.strategy == "fsdp"
    if fsdp and args.model == "resnet":
        p.error("--strategy fsdp shards transformer layers: use --model bert or vit")
    args.precisions = args.precisions or list(FSDP_PRECISIONS if fsdp else PRECISIONS)
    if fsdp and set(args.precisions) - set(FSDP_PRECISIONS):
        p.error(f"under --strategy fsdp the precisions are {', '.join(FSDP_PRECISIONS)} (ModelParallelStrategy)")
    version = next_version(args.logdir, "memory_breakdown")
    results = {name: measure(name, args, version) for name in args.precisions}
    n = next(iter(results.values()))
    rank = torch.distributed.get_rank() if fsdp and torch.distributed.is_initialized() else 0
    if args.json:
        path = args.json if rank == 0 else f"{args.json}.rank{rank}"
        with open(f"{path}.tmp", "w") as f:
            json.dump(results, f)
        os.replace(f"{path}.tmp", path)
    if rank == 0:
        where = f", FSDP2 on {args.devices} processes, per rank" if fsdp else ""
        table = format_fsdp_table(results) if fsdp else format_table(results)
        print(
            f"memory_breakdown: {args.model}, {n['params']} parameters ({n['norm_params']} in norm layers), "
            f"batch {args.batch_size}{where}\n{table}"
        )
    return results


if __name__ == "__main__":
    main()
