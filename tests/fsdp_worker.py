"""2-process CPU (gloo) training runs for tests/test_fsdp.py: FSDP2 through Lightning's ``ModelParallelStrategy``.

usage: python fsdp_worker.py OUT SCENARIO [SCENARIO ...]

One launch runs the fits of its scenarios one after the other in the same two processes (Lightning launches rank 1
at the first fit). Every fit writes what each rank saw to ``OUT/<run>/rank<r>.json`` and each rank writes
``OUT/done-rank<r>`` at the end; the test asserts on those files, so gloo's occasional abort at exit cannot fail it.

Scenarios:
  compare     a small transformer, bf16, 12 steps: FSDP2 + MPTPrecision, FSDP2 + Lightning's "bf16-mixed" (same
              sharding and policy), DDP + MPTPrecision; a tiny MLP, fp16 with a dynamic scale: FSDP2, DDP and
              Lightning's GradScaler on FSDP2; with gradient accumulation; with torch's own policy.
  inject      fp16 under FSDP2 with an inf written into rank 1's gradient shard only, at one step.
  guard       the same at two steps in a row, with max_consecutive_skips=2: NonFiniteGradientError on both ranks.
  clip        clipping by norm (FSDP2 and DDP) and by value (FSDP2) of the unscaled gradients, with global norms.
  checkpoint  12 steps straight vs 6 + resume, from a sharded and from a full checkpoint; the saved files.
  crossload   full FSDP2 checkpoint -> DDP model, DDP checkpoint -> FSDP2 model (Lightning's GPU tests, on CPU).
  init        a model created on the meta device, materialized and sharded; the sharded state dict's keys.
  unsharded   a configure_model that shards nothing: the plugin's error, on both ranks.
  memory      benchmarks/memory_fsdp.py --fast in these processes: per-rank bytes per parameter, to OUT/memory.json.
  fp8         the small transformer with fp8 Linear layers but the head (torchao, emulated, fp8_filter), converted in
              configure_model before fully_shard: 2 epochs of 4 steps under FSDP2 with Float8Monitor and a checkpoint
              per epoch, resumed from the first; the same under DDP, where the plugin converts the layers itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from models import Net, quiet_trainer, regression_data, token_data
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_mpt import DynamicLossScaler, MPTPrecision


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def sha(tensors: list[torch.Tensor]) -> str:
    flat = [local(t).detach().float().flatten() for t in tensors if t is not None]
    return hashlib.sha1(torch.cat(flat).numpy().tobytes() if flat else b"", usedforsecurity=False).hexdigest()


# ---------------------------------------------------------------------------------------------------- models


class Sharded(L.LightningModule):
    """Shards ``self.model`` in ``configure_model`` under ModelParallelStrategy (does nothing under DDP).

    ``policy``: "plugin" (the plugin's ``mp_policy``), "torch" (torch's own ``MixedPrecisionPolicy`` with the
    plugin's half format), "fp32" (no policy), or a ``MixedPrecisionPolicy``. ``shard_norms``: shard each
    LayerNorm on its own in fp32 first, so norm weights compute in fp32 as under DDP.
    """

    def __init__(self, policy: Any = "plugin", shard_norms: bool = True, reduce_fp32: bool = False) -> None:
        super().__init__()
        self.policy, self.shard_norms, self.reduce_fp32 = policy, shard_norms, reduce_fp32
        self.losses: list[float] = []

    def blocks(self) -> list[nn.Module]:
        return []

    def mp_policy(self) -> Optional[MixedPrecisionPolicy]:
        plugin = self.trainer.precision_plugin
        half = plugin.half_dtype if isinstance(plugin, MPTPrecision) else torch.bfloat16
        if isinstance(self.policy, MixedPrecisionPolicy):
            return self.policy
        if self.policy == "plugin":
            return plugin.mp_policy
        if self.policy == "torch":
            return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32 if self.reduce_fp32 else half)
        return None

    def configure_model(self) -> None:
        if self.device_mesh is None:  # DDP: nothing to shard
            return
        mesh = self.device_mesh["data_parallel"]
        policy = self.mp_policy()
        kwargs = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
        if self.shard_norms:
            for m in self.model.modules():
                if isinstance(m, nn.LayerNorm):
                    fully_shard(m, mesh=mesh)  # torch's default policy: fp32
        for block in self.blocks():
            fully_shard(block, **kwargs)
        fully_shard(self.model, **kwargs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Seq2Seq(Sharded):
    """:class:`Net` on a sequence copy task."""

    lr = 3e-3

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = Net()

    def blocks(self) -> list[nn.Module]:
        return self.model.blocks()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        src, _ = batch
        loss = nn.functional.cross_entropy(self.model(src).float().flatten(0, 1), src.flatten())
        self.losses.append(loss.item())
        return loss


class Seq2SeqFp8(Seq2Seq):
    """:class:`Seq2Seq` whose Linear layers become fp8 (the plugin's ``fp8=``) before FSDP2 shards them."""

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # under DDP the plugin converts them itself
            self.trainer.precision_plugin.convert_fp8(self, fsdp=True)
        super().configure_model()


class MLP(Sharded):
    """Linear -> LayerNorm -> ReLU -> Linear regression (tiny: fp16 matmuls are slow on CPU)."""

    lr = 1e-2

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))

    def blocks(self) -> list[nn.Module]:
        return [self.model[0]]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x).float(), y)
        self.losses.append(loss.item())
        return loss


class ClipProbe(MLP):
    """Records the global norm (over all shards) of the unscaled gradients before and after Lightning's clipping."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norms: list[tuple[float, float, float]] = []

    def global_stats(self) -> tuple[float, float]:
        grads = [local(p.grad).float() for p in self.parameters() if p.grad is not None]
        stats = torch.stack([sum(g.pow(2).sum() for g in grads), max(g.abs().max() for g in grads)])
        if isinstance(next(self.parameters()), DTensor):  # shards: sum the squares, max the maxima over ranks
            sq, mx = stats[:1].clone(), stats[1:].clone()
            torch.distributed.all_reduce(sq)
            torch.distributed.all_reduce(mx, op=torch.distributed.ReduceOp.MAX)
            stats = torch.cat([sq, mx])
        return math.sqrt(stats[0].item()), stats[1].item()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        before, _ = self.global_stats()
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        after, max_abs = self.global_stats()
        self.norms.append((before, after, max_abs))


class Unsharded(MLP):
    def configure_model(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------- recording


class Record(L.Callback):
    """Per optimizer step and rank: loss, batch digest, scale, skip, masters' and optimizer state's digests."""

    def __init__(self, out: Path, name: str) -> None:
        self.dir = out / name
        self.rows: list[dict[str, Any]] = []
        self.batch = ""
        self.compute: dict[str, str] = {}  # module type -> dtype of its weight during the forward (FSDP's copy)
        self.weight_types: dict[str, str] = {}  # module type -> type of that weight (torchao's fp8 tensor: fp8 copy)

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        def seen(m: nn.Module, args: Any) -> None:
            self.compute.setdefault(type(m).__name__, str(m.weight.dtype))
            self.weight_types.setdefault(type(m).__name__, type(m.weight).__name__)

        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.LayerNorm)):
                m.register_forward_pre_hook(seen)  # after FSDP's own pre-hook (prepended): sees the gathered weight
        self.param_types = sorted({type(p).__name__ for p in module.parameters()})

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batch = sha(list(batch))

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == (self.rows[-1]["step"] if self.rows else 0):
            return  # no optimizer step in this batch (gradient accumulation, a resumed run's last batch)
        plugin = trainer.precision_plugin
        opt = trainer.optimizers[0]
        row: dict[str, Any] = {"step": trainer.global_step, "loss": module.losses[-1], "batch": self.batch}
        if isinstance(plugin, MPTPrecision):
            last = plugin.last_step
            row.update(
                scale=last.scale,
                skipped=last.skipped,
                skipped_steps=plugin.skipped_steps,
                culprits=last.nonfinite_params,
                loss_scale=plugin.loss_scale,
                last_step_skipped=plugin.last_step_skipped,
                history=len(plugin.history),
            )
            masters = plugin.main_params(opt)
        else:
            scaler = getattr(plugin, "scaler", None)
            row.update(scale=scaler.get_scale() if scaler is not None else 1.0)
            masters = [p for g in opt.param_groups for p in g["params"]]
        state = [v for p in masters for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        row.update(masters=sha(masters), state=sha(state), master_dtypes=sorted({str(m.dtype) for m in masters}))
        self.rows.append(row)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        extra = {"norms": getattr(module, "norms", None), "compute": self.compute, "param_types": self.param_types}
        extra["weight_types"] = self.weight_types
        write(self.dir, trainer.global_rank, {"rows": self.rows, **extra})


def write(folder: Path, rank: int, data: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # atomic: the test never reads a half-written file


class InjectLocal(L.Callback):
    """Writes inf into this rank's shard of one parameter's gradient (after FSDP's reduce-scatter) at one step."""

    def __init__(self, name: str, step: int, rank: int) -> None:
        self.name, self.step, self.rank = name, step, rank

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            grad = dict(module.named_parameters())[self.name].grad
            local(grad).view(-1)[0] = math.inf


# ---------------------------------------------------------------------------------------------------- runs


def fsdp() -> ModelParallelStrategy:
    """Data parallel over both processes: the batches are split as under DDP (``ModelParallelStrategy()``'s default
    would make the 2 processes a tensor-parallel group that sees the same batches)."""
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def run(
    out: Path,
    name: str,
    model: Sharded,
    strategy: Any,
    plugin: Any,
    data: Any,
    steps: int = 12,
    callbacks: tuple = (),
    ckpt_path: Optional[str] = None,
    **kwargs: Any,
) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    kwargs.setdefault("max_steps", steps)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=2,
        plugins=[plugin] if plugin else None,
        callbacks=[Record(out, name), *callbacks],
        **kwargs,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


def seq_data():  # 12 steps of 2 x 8 sequences
    return token_data(n=192, seq=8, vocab=16, batch_size=8)


def mlp_data():
    return regression_data(n=192, batch_size=8)


def compare(out: Path) -> None:
    def seq() -> Seq2Seq:
        L.seed_everything(0, verbose=False)
        return Seq2Seq()

    run(out, "seq-fsdp-mpt", seq(), fsdp(), MPTPrecision("bf16"), seq_data())
    lightning = seq()
    lightning.policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    run(out, "seq-fsdp-lightning", lightning, fsdp(), MixedPrecision("bf16-mixed", "cpu"), seq_data())
    run(out, "seq-ddp-mpt", seq(), "ddp", MPTPrecision("bf16"), seq_data())

    def mlp(**kwargs: Any) -> MLP:
        L.seed_everything(0, verbose=False)
        return MLP(**kwargs)

    def fp16() -> MPTPrecision:  # overflows at the start, then backs off and grows: the scale moves
        return MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**20, growth_interval=4))

    run(out, "mlp-fsdp-mpt16", mlp(), fsdp(), fp16(), mlp_data())
    run(out, "mlp-ddp-mpt16", mlp(), "ddp", fp16(), mlp_data())
    lightning16 = mlp(policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=4)
    run(out, "mlp-fsdp-lightning16", lightning16, fsdp(), MixedPrecision("16-mixed", "cpu", scaler), mlp_data())
    # gradient accumulation: FSDP reduce-scatters every micro-batch into fp32 shards, DDP all-reduces once
    run(out, "mlp-fsdp-accum", mlp(), fsdp(), fp16(), mlp_data(), steps=6, accumulate_grad_batches=2)
    run(out, "mlp-ddp-accum", mlp(), "ddp", fp16(), mlp_data(), steps=6, accumulate_grad_batches=2)
    # torch's own policy with the plugin's half format and fp32 gradient reduction
    run(out, "mlp-fsdp-mpt16-torchpolicy", mlp(policy="torch", reduce_fp32=True), fsdp(), fp16(), mlp_data())
    # norm layers left inside their group: all-gathered in the half format
    run(out, "mlp-fsdp-mpt16-halfnorms", mlp(shard_norms=False), fsdp(), MPTPrecision("fp16"), mlp_data(), steps=2)


def inject(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=1024.0, growth_interval=3))
    run(
        out,
        "inject",
        MLP(),
        fsdp(),
        plugin,
        mlp_data(),
        steps=8,
        callbacks=(InjectLocal("model.0.weight", step=3, rank=1),),
    )


def guard(out: Path) -> None:
    """Two skipped steps in a row with ``max_consecutive_skips=2``: the guard stops the run on both ranks."""
    from lightning_mpt import NonFiniteGradientError

    L.seed_everything(0, verbose=False)
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=1024.0), max_consecutive_skips=2)
    injects = (InjectLocal("model.3.weight", step=2, rank=1), InjectLocal("model.3.weight", step=3, rank=1))
    try:
        run(out, "guard", MLP(), fsdp(), plugin, mlp_data(), steps=6, callbacks=injects)
    except NonFiniteGradientError as err:
        write(out / "guard-error", torch.distributed.get_rank(), {"error": str(err), "steps": len(plugin.history)})


def clip(out: Path) -> None:
    for name, strategy, algorithm in (
        ("clip-fsdp-norm", fsdp(), "norm"),
        ("clip-ddp-norm", "ddp", "norm"),
        ("clip-fsdp-value", fsdp(), "value"),
    ):
        L.seed_everything(0, verbose=False)
        run(
            out,
            name,
            ClipProbe(),
            strategy,
            MPTPrecision("fp16"),
            mlp_data(),
            steps=6,
            gradient_clip_val=0.05 if algorithm == "norm" else 0.002,
            gradient_clip_algorithm=algorithm,
        )


def checkpoint(out: Path) -> None:
    """2 epochs of 6 steps straight, and resumed from the checkpoint of the first epoch. The scale moves: skips (an
    inf on rank 1's shard) at steps 1 and 5, so the checkpoint holds a pending hysteresis, and growth every 3 clean
    steps."""

    def plugin() -> MPTPrecision:
        return MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2))

    def injects() -> tuple:
        return (InjectLocal("model.0.weight", step=1, rank=1), InjectLocal("model.0.weight", step=5, rank=1))

    data = regression_data(n=96, batch_size=8)  # 6 steps per epoch on 2 ranks
    for kind, distributed in (("sharded", True), ("full", False)):
        ckpt_dir = out / f"ckpt-{kind}"
        saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
        strategy = ModelParallelStrategy(2, 1, save_distributed_checkpoint=distributed)
        L.seed_everything(0, verbose=False)
        run(
            out,
            f"straight-{kind}",
            MLP(),
            strategy,
            plugin(),
            data,
            callbacks=(saver, *injects()),
            enable_checkpointing=True,
            max_steps=-1,
            max_epochs=2,
        )
        path = str(ckpt_dir / "epoch=0.ckpt")
        strategy = ModelParallelStrategy(2, 1, save_distributed_checkpoint=distributed)
        L.seed_everything(0, verbose=False)
        trainer = run(
            out,
            f"resumed-{kind}",
            MLP(),
            strategy,
            plugin(),
            data,
            callbacks=injects(),
            ckpt_path=path,
            max_steps=-1,
            max_epochs=2,
        )
        if kind == "full" and trainer.global_rank == 0:
            saved = torch.load(path, weights_only=False)
            write(
                out / "full-file",
                0,
                {
                    "state_dict": {k: [str(v.dtype), list(v.shape)] for k, v in saved["state_dict"].items()},
                    "plugin": {k: v for k, v in saved["MPTPrecision"].items() if k != "scaler"},
                    "scaler": saved["MPTPrecision"]["scaler"],
                },
            )
        if kind == "sharded" and trainer.global_rank == 0:
            meta = torch.load(Path(path) / "meta.pt", weights_only=False)
            write(
                out / "sharded-files",
                0,
                {
                    "files": sorted(os.listdir(path)),
                    "meta": sorted(meta),
                    "plugin_steps": meta["MPTPrecision"]["steps"],
                },
            )


def crossload(out: Path) -> None:
    """Lightning's test_load_full_state_checkpoint_into_regular_model and
    test_load_standard_checkpoint_into_distributed_model (GPU-only there), on CPU under MPTPrecision."""
    L.seed_everything(0, verbose=False)
    full = ModelParallelStrategy(2, 1, save_distributed_checkpoint=False)
    trainer = run(out, "cross-fsdp", MLP(), full, MPTPrecision("bf16"), mlp_data(), steps=4)
    path = trainer.strategy.broadcast(str(out / "fsdp-full.ckpt"))
    trainer.save_checkpoint(path)
    fsdp_model = trainer.strategy.lightning_module_state_dict()  # full, on rank 0
    L.seed_everything(0, verbose=False)
    trainer = run(out, "cross-into-ddp", MLP(), "ddp", MPTPrecision("bf16"), mlp_data(), steps=4, ckpt_path=path)
    # resumed at step 4 of 4: nothing trains, the loaded weights are the module's
    ddp_model = trainer.strategy.lightning_module_state_dict()
    if trainer.global_rank == 0:
        write(
            out / "cross-full-into-ddp-result",
            0,
            {
                "keys_equal": list(fsdp_model) == list(ddp_model),
                # nothing trained after loading (resumed at its last step): copies of the saved values
                "equal": all(torch.equal(fsdp_model[k].float(), ddp_model[k].float()) for k in fsdp_model),
                "dtypes": sorted({str(v.dtype) for v in fsdp_model.values()}),
            },
        )
    ddp_path = trainer.strategy.broadcast(str(out / "ddp.ckpt"))
    trainer.save_checkpoint(ddp_path)
    L.seed_everything(0, verbose=False)
    trainer = run(
        out,
        "cross-ddp-into-fsdp",
        MLP(),
        ModelParallelStrategy(2, 1, save_distributed_checkpoint=False),
        MPTPrecision("bf16"),
        mlp_data(),
        steps=4,
        ckpt_path=ddp_path,
    )
    back = trainer.strategy.lightning_module_state_dict()
    if trainer.global_rank == 0:
        write(
            out / "cross-ddp-into-fsdp-result",
            0,
            {
                "equal": all(torch.equal(ddp_model[k].float(), back[k].float()) for k in ddp_model),
                "keys_equal": list(ddp_model) == list(back),
            },
        )


def init(out: Path) -> None:
    """Lightning's test_module_init_context and test_strategy_state_dict (GPU-only there), on CPU: a model created
    on the meta device under ``trainer.init_module(empty_init=True)`` is materialized, sharded and trained; the
    strategy's sharded state dict has the keys of the plain model and fp32 shards."""
    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(
        strategy=fsdp(), devices=2, max_steps=3, plugins=[MPTPrecision("bf16")], callbacks=[Record(out, "meta-init")]
    )
    with trainer.init_module(empty_init=True):
        model = MLP()
    on_meta = model.model[0].weight.is_meta
    trainer.fit(model, mlp_data())
    state = trainer.strategy.lightning_module_state_dict()
    write(
        out / "meta-init-result",
        trainer.global_rank,
        {
            "was_meta": on_meta,
            "keys_equal": list(state) == list(MLP().state_dict()),
            "types": sorted({f"{type(v).__name__} {v.dtype}" for v in state.values()}),
        },
    )


def unsharded(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    try:
        run(out, "unsharded", Unsharded(), fsdp(), MPTPrecision("bf16"), mlp_data(), steps=1)
    except ValueError as err:
        write(out / "unsharded-error", torch.distributed.get_rank(), {"error": str(err)})


def memory_bytes(out: Path) -> None:
    """The memory benchmark's fast run, in the processes this launch has started already (their start-up is most of
    a launch's time)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import memory_fsdp

    modes = ["bf16-mixed", "mpt-bf16", "mpt-bf16 master_weights=False"]
    memory_fsdp.main(["--fast", "--modes", *modes, "--json", str(out / "memory.json")])


def fp8(out: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_mpt.callbacks import Float8Monitor

    def plugin() -> MPTPrecision:  # the head stays bf16: the filter sees the LightningModule's names on both paths
        return MPTPrecision("bf16", fp8=True, fp8_emulate=True, fp8_filter=lambda module, fqn: fqn != "model.out")

    data = token_data(n=64, seq=8, vocab=16, batch_size=8)  # 4 steps per epoch on 2 ranks
    saver = ModelCheckpoint(dirpath=out / "ckpt-fp8", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    monitor = Float8Monitor(every_n_steps=1)
    logger = TensorBoardLogger(out / "tb-fp8", name="", version="run")
    epochs: dict[str, Any] = {"max_steps": -1, "max_epochs": 2}
    L.seed_everything(0, verbose=False)
    kept = {"callbacks": (saver, monitor), "logger": logger, "enable_checkpointing": True}
    run(out, "fp8-fsdp", Seq2SeqFp8(), fsdp(), plugin(), data, **kept, **epochs)
    path = str(out / "ckpt-fp8" / "epoch=0.ckpt")
    L.seed_everything(0, verbose=False)
    run(out, "fp8-fsdp-resumed", Seq2SeqFp8(), fsdp(), plugin(), data, ckpt_path=path, **epochs)
    L.seed_everything(0, verbose=False)
    run(out, "fp8-ddp", Seq2SeqFp8(), "ddp", plugin(), data, **epochs)


SCENARIOS = {
    "compare": compare,
    "inject": inject,
    "guard": guard,
    "clip": clip,
    "checkpoint": checkpoint,
    "crossload": crossload,
    "init": init,
    "unsharded": unsharded,
    "memory": memory_bytes,
    "fp8": fp8,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("scenarios", nargs="+", choices=list(SCENARIOS))
    args = p.parse_args()
    torch.set_num_threads(1)
    for name in args.scenarios:
        SCENARIOS[name](args.out)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (args.out / f"done-rank{rank}").write_text("")


if __name__ == "__main__":
    main()
