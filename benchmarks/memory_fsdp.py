"""Per-rank bytes per parameter under FSDP2 (Lightning's ``ModelParallelStrategy``), at the optimizer step and at
the training step's peak, for Lightning's precisions and ``MPTPrecision``, side by side.

    python benchmarks/memory_fsdp.py                 # 2 CPU processes (gloo), the benchmark transformer, batch 1
    python benchmarks/memory_fsdp.py --fast          # a 1-layer transformer, seconds (what the tests run)
    python benchmarks/memory_fsdp.py --devices 4     # N processes: the sharded parts divide by N

Every mode trains the transformer of ``benchmarks/memory.py`` (AdamW, same hyper-parameters) for a few steps in the
same N processes, sharded in ``configure_model`` as our docs recommend: each LayerNorm on its own in fp32, each
block, then the root (embeddings, tied head) with the precision's ``MixedPrecisionPolicy`` (``plugin.mp_policy``
for ``MPTPrecision``, bf16 gather and reduce for ``"bf16-mixed"``, none for ``"32-true"``). The last step is
measured on every rank, counting the tensors themselves (a ``DTensor`` by its local shard, each storage once, as
``memory.py`` does), in bytes per *global* parameter:

* **sharded weights**: FSDP2's fp32 parameter shards. Under ``MPTPrecision`` these are the masters (the optimizer
  steps them); ``masters`` counts fp32 copies *besides* them (none under FSDP2).
* **unsharded weights**: the all-gathered compute copies registered on the module at that moment (half under a
  policy, fp32 under ``"32-true"``); **unsharded grads**: their gradients, before FSDP reduce-scatters them.
* **grad shards**: the reduce-scattered fp32 gradient shards; **optimizer state**: AdamW's moments (local shards).

**At the step** is ``on_before_optimizer_step``. **The peak** is the largest sum of those tensors seen at hooks
through the whole training step (a CPU has no allocator peak statistics): every module's forward pre- and post-hook
(after FSDP's all-gather, before and after its reshard), a hook on each unsharded parameter right after autograd
accumulates its gradient (before FSDP's post-backward reduce-scatters and frees it), ``on_after_backward``,
``on_before_optimizer_step`` and ``on_train_batch_end``. Transients between hooks are not in it: FSDP's flat
all-gather and reduce-scatter buffers, activations. **The step's peak** is ``memory.StepPeak``: the state at the end
of the backward plus the CPU allocator's events replayed to the end of the optimizer step (temporaries included).

A mode the plugin refuses under FSDP2 (``master_weights=False``: the fp32 shards are the masters) raises its
``ValueError`` on every rank when the plugin converts the sharded model; the table shows the message.

ZeRO-3's ideal is 16/N bytes per parameter per rank with AdamW (4 fp32 weights + 4 fp32 grads + 8 moments, all
sharded); the table gives each row's ratio to it and to ``"bf16-mixed"`` of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import memory  # noqa: E402
from common import GPT_SIZES, gpt_data  # noqa: E402
from tensor_bytes import is_shard, nbytes  # noqa: E402

from lightning_mpt import MPTPrecision  # noqa: E402

MODES: dict[str, Any] = {  # name: a fresh precision (a Trainer ``precision`` string or an MPTPrecision)
    "32-true": lambda: "32-true",
    "bf16-mixed": lambda: "bf16-mixed",
    "mpt-bf16": lambda: MPTPrecision("bf16"),
    "mpt-fp16": lambda: MPTPrecision("fp16"),
    "mpt-bf16 master_weights=False": lambda: MPTPrecision("bf16", master_weights=False),
}
KINDS = ("sharded_weights", "unsharded_weights", "masters", "sharded_grads", "unsharded_grads", "optimizer_state")


class ShardedLM(memory.LM):
    """The benchmark transformer, sharded with FSDP2 in ``configure_model`` (norms, blocks, root)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        plugin = self.trainer.precision_plugin
        if isinstance(plugin, MPTPrecision):
            policy: dict[str, Any] = {"mp_policy": plugin.mp_policy}
        elif plugin.precision == "bf16-mixed":  # what Lightning's docs pass for bf16 under ModelParallelStrategy
            policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}
        else:
            policy = {}
        mesh = self.device_mesh["data_parallel"]
        for m in self.modules():  # fp32 norm weights, as under DDP (docs/distributed.md)
            if isinstance(m, nn.LayerNorm):
                fully_shard(m, mesh=mesh)
        for block in self.blocks:
            fully_shard(block, mesh=mesh, **policy)
        fully_shard(self, mesh=mesh, **policy)


class Live(L.Callback):
    """The per-rank bytes of each kind (:data:`KINDS`) at the optimizer step of ``at_step`` (``at_step``) and at
    the hook of that training step where their sum was largest (``peak``, with ``peak_where``)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.result: dict[str, Any] = {}
        self._on = False
        self._handles: list[Any] = []
        self._hooked: set[int] = set()  # unsharded parameters with an accumulate-grad hook (FSDP2 keeps the objects)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trainer, self.module = trainer, pl_module
        self.shards = [p for p in pl_module.parameters() if is_shard(p)]  # all sharded between steps
        self.result["params"] = sum(p.numel() for p in self.shards)  # a DTensor's numel is the global one
        self.result["unsharded_params"] = sum(p.numel() for p in pl_module.parameters() if not is_shard(p))
        for m in pl_module.modules():
            self._handles += [
                m.register_forward_pre_hook(lambda *_: self.sample("forward pre")),
                m.register_forward_hook(lambda *_: self.sample("forward, before reshard"), prepend=True),
                m.register_forward_hook(lambda *_: self.sample("forward, after reshard")),
            ]

    def _hook_unsharded(self) -> None:
        for p in self.module.parameters():
            if not is_shard(p) and p.requires_grad and id(p) not in self._hooked:
                self._hooked.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(lambda _: self.sample("grad accumulated")))

    def counts(self) -> dict[str, int]:
        """Bytes of each kind held now by this rank, each storage once."""
        trainer, registered = self.trainer, list(self.module.parameters())
        unsharded = [p for p in registered if not is_shard(p)]
        ids = {id(p) for p in self.shards}
        opts = trainer.optimizers
        masters = [m for o in opts for m in trainer.precision_plugin.main_params(o) if id(m) not in ids]
        state = [v for o in opts for s in o.state.values() for v in s.values() if isinstance(v, Tensor)]
        seen: set[Any] = set()
        return {
            "sharded_weights": nbytes(self.shards, seen),
            "unsharded_weights": nbytes(unsharded, seen),
            "masters": nbytes(masters + [m.grad for m in masters], seen),
            "sharded_grads": nbytes((p.grad for p in self.shards), seen),
            "unsharded_grads": nbytes((p.grad for p in unsharded), seen),
            "optimizer_state": nbytes(state, seen),
        }

    def sample(self, where: str) -> None:
        if not self._on:
            return
        self._hook_unsharded()  # a group just all-gathered: its unsharded parameters exist now
        now = self.counts()
        if sum(now.values()) > sum(self.result.get("peak", {}).values()):
            self.result["peak"], self.result["peak_where"] = now, where

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._on = trainer.global_step == self.at_step
        self.sample("batch start")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sample("after backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._on:
            self.result["at_step"] = self.counts()
        self.sample("before optimizer step")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.sample("batch end")
        self._on = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for h in self._handles:
            h.remove()


def measure(name: str, config: Any, steps: int, devices: int) -> dict[str, Any]:
    """Train ``name`` (a key of :data:`MODES`) under FSDP2 on ``devices`` processes; this rank's bytes."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    L.seed_everything(0, verbose=False)
    precision = MODES[name]()
    live, peak = Live(at_step=steps - 1), memory.StepPeak(at_step=steps - 1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[live, peak],
        **({"plugins": [precision]} if isinstance(precision, MPTPrecision) else {"precision": precision}),
    )
    trainer.fit(ShardedLM(config, "AdamW", steps), gpt_data(config, steps * devices))
    return {**live.result, "step_peak": peak.result["peak"], "step_start": peak.result["start"]}


def per_param(counts: dict[str, int], n: int) -> list[float]:
    return [counts[k] / n for k in KINDS]


def format_table(ranks: list[dict[str, Any]], refused: dict[str, str]) -> str:
    """Markdown, one row per mode and rank: bytes per global parameter of each kind at the step; totals at the
    step, at the hooks' peak and at the step's allocator peak; ratios to ``"bf16-mixed"`` and to ZeRO-3's 16/N."""
    n_ranks = len(ranks)
    head = (
        "| mode | rank | fp32 shards | unsharded weights | masters | grad shards | unsharded grads | optimizer state "
        "| at the step | peak (hooks) | peak of the optimizer step | step / bf16-mixed | peak / bf16-mixed "
        f"| step / ZeRO-3 (16/{n_ranks}) |"
    )
    lines = [head, "|---|--:|" + "--:|" * (head.count("|") - 3)]
    for name in ranks[0]:
        for rank, results in enumerate(ranks):
            r, ref = results[name], results.get("bf16-mixed")
            n = r["params"]
            step, top = sum(per_param(r["at_step"], n)), sum(per_param(r["peak"], n))
            cells = [f"{v:.2f}" for v in per_param(r["at_step"], n)]
            cells += [f"{step:.2f}", f"{top:.2f}", f"{r['step_peak'] / n:.2f}"]
            if ref is not None:
                cells += [
                    f"{step / sum(per_param(ref['at_step'], n)):.2f}",
                    f"{top / sum(per_param(ref['peak'], n)):.2f}",
                ]
            else:
                cells += ["-", "-"]
            cells.append(f"{step / (16 / n_ranks):.2f}")
            lines.append(f"| {name} | {rank} | " + " | ".join(cells) + " |")
    for name, why in refused.items():
        lines.append(f"| {name} | all | refused: {why} |" + " |" * (head.count("|") - 4))
    return "\n".join(lines)


def format_peaks(ranks: list[dict[str, Any]]) -> str:
    """Where each mode's hooks' peak was, and its breakdown on rank 0."""
    out = []
    for name, r in ranks[0].items():
        n = r["params"]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in zip(KINDS, per_param(r["peak"], n)) if v)
        out.append(f"peak of {name} (rank 0): at '{r['peak_where']}': {parts}")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Measure every mode on every rank; rank 0 prints the table and returns (and with ``--json`` writes) them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fast", action="store_true", help="a 1-layer transformer: seconds")
    p.add_argument("--size", choices=list(GPT_SIZES), default="small", help="the benchmark transformer's size")
    p.add_argument("--batch", type=int, default=1, help="per rank; the bytes per parameter do not depend on it")
    p.add_argument("--steps", type=int, default=2, help="steps per mode; the last one is measured")
    p.add_argument("--devices", type=int, default=2, help="processes (ranks), each holding 1/N of every parameter")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--json", default=None, help="rank 0 writes every rank's byte counts to this file")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = dataclasses.replace(memory.FAST if args.fast else GPT_SIZES[args.size], batch=args.batch)
    results, refused = {}, {}
    for name in args.modes:
        try:
            results[name] = measure(name, config, args.steps, args.devices)
        except ValueError as err:  # the plugin refuses it when it converts the sharded model, on every rank
            refused[name] = str(err)
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, results)
    out = {"ranks": ranks, "refused": refused, "config": dataclasses.asdict(config), "devices": args.devices}
    if dist.get_rank() == 0:
        n = ranks[0][next(iter(ranks[0]))]["params"]
        print(f"memory_fsdp: transformer {config}, {n} parameters, FSDP2 on {args.devices} CPU processes, per rank")
        print(format_table(ranks, refused))
        print(format_peaks(ranks))
        if args.json:
            with open(f"{args.json}.tmp", "w") as f:
                json.dump(out, f)
            os.replace(f"{args.json}.tmp", args.json)
    return out


if __name__ == "__main__":
    main()
