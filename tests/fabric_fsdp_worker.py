"""2-process CPU (gloo) Fabric loops under FSDP2 (Fabric's ``ModelParallelStrategy``) for tests/test_fabric_fsdp.py.

usage: python fabric_fsdp_worker.py OUT

One launch runs every run below one after the other in the same two processes (a new ``Fabric`` each). Every run
writes what each rank saw to ``OUT/<run>/rank<r>.json`` and each rank writes ``OUT/done-rank<r>`` at the end; the
test asserts on those files, so gloo's occasional abort at exit cannot fail it.

Both strategies get the same initial weights (one seed on every rank) and the same batches (drawn per rank and step),
so FSDP2 and DDP train the same model. Norm layers are sharded on their own in fp32 under FSDP2, so that they compute
in fp32 as under DDP.

Runs:
  bf16-fsdp, bf16-mixed, bf16-ddp   a small transformer, 12 steps: MPTPrecision("bf16", sharded=True); Fabric's own
                                    "bf16-mixed" with the same sharding and policy; DDP + MPTPrecision("bf16") with
                                    4-byte masters
  fp16-fsdp, fp16-hsdp, fp16-ddp    a tiny MLP, fp16 with a scale that starts too high (skips, back-offs), clipping by
                                    norm; an inf written into rank 1's gradient (its shard under FSDP2) at step 5.
                                    HSDP: replicated over both processes, sharded over one (a 2-D mesh). Each run also
                                    steps a :class:`Shadow`: DDP's clipping and AdamW applied to its own gradients
  accumulate-fsdp, accumulate-ddp   the fp16 MLP, 3 micro-batches per step (fabric.no_backward_sync), clipping by value
  resume-*                          fp16 FSDP2: 10 steps straight; 5, fabric.save, a fresh Fabric, fabric.load, 5 more,
                                    from a sharded (distributed) and from a full checkpoint
  logger-fsdp, logger-hsdp, ...     MixedPrecisionLogger at every step on the fp16 MLP (its reference every other)
  meta                              the MLP created on the meta device, materialized by the strategy
  fp8-fsdp, fp8-ddp                 the small transformer, 6 steps, its Linear layers in fp8 (torchao, emulated):
                                    MPTPrecision("bf16", sharded=True, fp8=True) converts them before the
                                    parallelize_fn shards them (fp8 all-gather); DDP
  unsharded                         sharded=True with a parallelize_fn that shards nothing: the plugin's error
  one-process-mesh                  Fabric's default mesh on one node (1 x 2): fully_shard spans one process: the error
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L
import models
import torch
from lightning.fabric.loggers import TensorBoardLogger
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_mpt import DynamicLossScaler
from lightning_mpt.core.masters.sharded import mixed_precision_policy
from lightning_mpt.fabric import MixedPrecisionLogger, MPTPrecision

STEPS = 12
# Fabric's default mesh on one node is 1 x 2 (data parallel x tensor parallel): FSDP2 over both processes needs 2 x 1
SHARD_OVER_BOTH = {"data_parallel_size": 2, "tensor_parallel_size": 1}
INJECT_STEP = 5
LR = 3e-3  # AdamW's, with its other defaults (tests/test_fabric_fsdp.py derives a bound from them)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a shard: every rank calls it in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def sha(tensors: list[torch.Tensor]) -> str:
    flat = [t.detach().float().flatten() for t in tensors]
    return hashlib.sha1(torch.cat(flat).numpy().tobytes() if flat else b"", usedforsecurity=False).hexdigest()


def masters(fabric: L.Fabric, model: nn.Module) -> list[torch.Tensor]:
    """The fp32 masters in the module's order, whole (gathered from the shards under FSDP2)."""
    plugin = fabric.strategy.precision
    get = plugin.master_of if isinstance(plugin, MPTPrecision) else (lambda p: p)
    return [full(get(p)) for p in model.parameters()]


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors in the order of its parameters, whole."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [full(v) for p in params for _, v in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(v)]


class Shadow:
    """DDP's arithmetic on this run's gradients: whole fp32 copies of the masters, clipped with torch's
    ``clip_grad_norm_`` over the whole gradients and stepped by their own ``AdamW``.

    Fed the run's unscaled gradients, it differs from the run's masters only by what the run computes in another
    order than DDP: under DDP nothing (bitwise equal), under FSDP2 the clipping norm, which sums the squares shard by
    shard and then over the ranks. tests/test_fabric_fsdp.py bounds that difference.
    """

    def __init__(self, fabric: L.Fabric, model: nn.Module, lr: float) -> None:
        self.params = [m.detach().clone() for m in masters(fabric, model)]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)

    def clip(self, fabric: L.Fabric, model: nn.Module, max_norm: float) -> float:
        """Take the run's unscaled fp32 gradients (whole) and clip them as DDP does; return the norm."""
        plugin = fabric.strategy.precision
        for shadow, p in zip(self.params, model.parameters()):
            grad = plugin.master_of(p).grad
            shadow.grad = None if grad is None else full(grad).detach().clone()
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def step(self, skipped: bool) -> None:
        if not skipped:  # a skipped step changes nothing
            self.optimizer.step()
        self.optimizer.zero_grad()

    def max_abs_difference(self, whole: list[torch.Tensor]) -> float:
        return max(float((a - b).abs().max()) for a, b in zip(self.params, whole))


# ---------------------------------------------------------------------------------------------------- models


class Net(models.Net):
    """The shared small transformer, with its batches and loss."""

    @staticmethod
    def batch(rank: int, step: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        return (torch.randint(0, 16, (8, 8), generator=g),)

    @staticmethod
    def loss(model: nn.Module, src: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(src).float().flatten(0, 1), src.flatten())


class MLP(nn.Module):
    """Linear -> LayerNorm -> ReLU -> Linear regression (tiny: fp16 matmuls are slow on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))

    def blocks(self) -> list[nn.Module]:
        return [self.model[0]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @staticmethod
    def batch(rank: int, step: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)

    @staticmethod
    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x).float(), y)


def parallelize_with(
    policy: Any, shard_anything: bool = True, hsdp: bool = False
) -> Callable[[nn.Module, Any], nn.Module]:
    """A ``parallelize_fn``: each LayerNorm on its own in fp32, then the blocks and the root with ``policy``.
    ``hsdp``: on a 2-D mesh of its own, replicated over both processes and sharded over one (HSDP)."""

    def parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
        if not shard_anything:
            return model
        mesh = device_mesh["data_parallel"]
        if hsdp:
            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                fully_shard(m, mesh=mesh)
        for block in model.blocks():
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    return parallelize


# ---------------------------------------------------------------------------------------------------- a run


def make(strategy: str, precision: Any, model_cls: type, out: Optional[Path] = None, **strategy_kwargs: Any) -> Any:
    """A Fabric with ``precision`` (a plugin or a name) under ``strategy`` ("fsdp", "hsdp" or "ddp"), the model set
    up."""
    plugin = precision if isinstance(precision, MPTPrecision) else None
    if strategy in ("fsdp", "hsdp"):
        policy = plugin.mp_policy if plugin is not None else mixed_precision_policy(torch.bfloat16)
        parallelize = parallelize_with(policy, hsdp=strategy == "hsdp")
        kwargs = {"parallelize_fn": parallelize, **SHARD_OVER_BOTH, **strategy_kwargs}
        strat: Any = ModelParallelStrategy(**kwargs)
    else:
        strat = DDPStrategy()
    loggers = [TensorBoardLogger(str(out), name="", version=0)] if out is not None else []
    fabric = L.Fabric(
        accelerator="cpu",
        devices=2,
        strategy=strat,
        plugins=[plugin] if plugin is not None else None,
        precision=None if plugin is not None else precision,
        loggers=loggers,
    )
    fabric.launch()
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    model = fabric.setup_module(model_cls())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    return fabric, model, optimizer


def train(
    fabric: L.Fabric,
    model: Any,
    optimizer: Any,
    model_cls: Any,
    steps: range,
    clip: Optional[float] = None,
    inject: Optional[int] = None,
    logger: Optional[MixedPrecisionLogger] = None,
    accumulate: int = 1,
    clip_val: Optional[float] = None,
    shadow: Optional[Shadow] = None,
) -> list[dict[str, Any]]:
    """Train ``steps``; per step: the loss, the batch's digest, the plugin's record, the masters' and the optimizer
    state's digests (gathered), and the clipping norm. With ``logger``: its fp32 reference every other step.
    ``accumulate``: micro-batches per step, all but the last under ``fabric.no_backward_sync``; ``clip_val``: clip by
    value. With ``shadow`` (and ``clip``): also its norm of the same gradients, the largest absolute difference
    between its copies and the masters, and the largest absolute master."""
    plugin = fabric.strategy.precision
    rows = []
    for step in steps:
        for micro in range(accumulate - 1):
            with fabric.no_backward_sync(model):
                fabric.backward(model_cls.loss(model, *model_cls.batch(fabric.global_rank, 100 + step * 10 + micro)))
        batch = model_cls.batch(fabric.global_rank, step)
        if logger is not None and step % 2 == 0:
            logger.reference(model_cls.loss, *batch)
        loss = model_cls.loss(model, *batch)
        fabric.backward(loss)
        if step == inject and fabric.global_rank == 1:
            grad = model.module.model[3].weight.grad if isinstance(model.module, MLP) else None
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.view(-1)[0] = math.inf  # this rank's part only (its shard under FSDP2)
        if logger is not None:
            logger.after_backward()
        extra: dict[str, Any] = {}
        if shadow is not None and clip is not None:
            plugin.unscale_gradients(optimizer)  # decided once: clip_gradients below reuses the decision
            extra["shadow_norm"] = shadow.clip(fabric, model, clip)
        norm = fabric.clip_gradients(model, optimizer, max_norm=clip) if clip is not None else None
        if clip_val is not None:
            fabric.clip_gradients(model, optimizer, clip_val=clip_val)
        if logger is not None:
            logger.step(optimizer)
        else:
            optimizer.step()
        optimizer.zero_grad()
        record = plugin.last_step if isinstance(plugin, MPTPrecision) else None
        whole = masters(fabric, model)
        if shadow is not None:
            shadow.step(record.skipped)
            extra["shadow_difference"] = shadow.max_abs_difference(whole)
            extra["max_abs_master"] = max(float(m.abs().max()) for m in whole)
        rows.append({
            "step": step,
            "loss": loss.item(),
            "batch": sha(list(batch)),
            "scale": record.scale if record else None,
            "skipped": record.skipped if record else False,
            "culprits": sorted(record.nonfinite_params) if record else [],
            "norm": None if norm is None else float(full(norm)),
            "masters": sha(whole),
            "state": sha(optimizer_state(optimizer)),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            **extra,
        })
    return rows


def write(out: Path, name: str, fabric: L.Fabric, data: dict[str, Any]) -> None:
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / f"rank{fabric.global_rank}.json").write_text(json.dumps(data))
    fabric.barrier()


# ---------------------------------------------------------------------------------------------------- scenarios


def compare_bf16(out: Path) -> None:
    for name, strategy, precision in [
        ("bf16-fsdp", "fsdp", MPTPrecision("bf16", sharded=True)),
        ("bf16-mixed", "fsdp", "bf16-mixed"),
        # 4-byte masters, as FSDP2's fp32 shards: the default's remainders round ties away from zero, torch's cast
        # (FSDP2's all-gather) to even
        ("bf16-ddp", "ddp", MPTPrecision("bf16", master_remainders=False, chunked_step=False)),
    ]:
        fabric, model, optimizer = make(strategy, precision, Net)
        rows = train(fabric, model, optimizer, Net, range(STEPS))
        write(out, name, fabric, {"rows": rows})


def compare_fp16(out: Path) -> None:
    for name, strategy in [("fp16-fsdp", "fsdp"), ("fp16-hsdp", "hsdp"), ("fp16-ddp", "ddp")]:
        scaler = DynamicLossScaler(init_scale=2.0**20, growth_interval=3)
        plugin = MPTPrecision("fp16", scaler=scaler, sharded=strategy != "ddp")
        fabric, model, optimizer = make(strategy, plugin, MLP)
        shadow = Shadow(fabric, model, LR)
        rows = train(fabric, model, optimizer, MLP, range(STEPS), clip=0.05, inject=INJECT_STEP, shadow=shadow)
        numel = sum(p.numel() for p in shadow.params)
        data = {"rows": rows, "skipped_steps": plugin.skipped_steps, "loss_scale": plugin.loss_scale, "numel": numel}
        write(out, name, fabric, data)


def accumulated(out: Path) -> None:
    for name, strategy in [("accumulate-fsdp", "fsdp"), ("accumulate-ddp", "ddp")]:
        scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=2)
        plugin = MPTPrecision("fp16", scaler=scaler, sharded=strategy != "ddp")
        fabric, model, optimizer = make(strategy, plugin, MLP)
        rows = train(fabric, model, optimizer, MLP, range(6), accumulate=3, clip_val=1e-3)
        write(out, name, fabric, {"rows": rows})


def resume(out: Path) -> None:
    def plugin() -> MPTPrecision:
        return MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**20, growth_interval=2), sharded=True)

    mpt = plugin()
    fabric, model, optimizer = make("fsdp", mpt, MLP)
    straight = train(fabric, model, optimizer, MLP, range(10))
    write(out, "resume-straight", fabric, {"rows": straight})
    for kind, distributed in [("sharded", True), ("full", False)]:
        path = out / f"ckpt-{kind}"
        mpt = plugin()
        fabric, model, optimizer = make("fsdp", mpt, MLP, save_distributed_checkpoint=distributed)
        first = train(fabric, model, optimizer, MLP, range(5))
        fabric.save(path, {"model": model, "optimizer": optimizer, "mpt": mpt})
        saved = {"dir": path.is_dir(), "scale": mpt.loss_scale, "skipped": mpt.skipped_steps}
        mpt = plugin()
        torch.manual_seed(123)  # different initial weights: the checkpoint must overwrite them
        fabric, model, optimizer = make("fsdp", mpt, MLP, save_distributed_checkpoint=distributed)
        mpt.adopt(optimizer)
        state = {"model": model, "optimizer": optimizer, "mpt": mpt}
        fabric.load(path, state)
        # Lightning's sharded-checkpoint path hands back the saved state of objects other than modules and optimizers
        # in `state` instead of loading it (its full-checkpoint path calls load_state_dict): docs/fabric.md
        replaced = state["mpt"] is not mpt
        if replaced:
            mpt.load_state_dict(state["mpt"])
        loaded = {"scale": mpt.loss_scale, "skipped": mpt.skipped_steps, "replaced": replaced}
        rest = train(fabric, model, optimizer, MLP, range(5, 10))
        write(out, f"resume-{kind}", fabric, {"rows": first + rest, "saved": saved, "loaded": loaded})


def logged(out: Path) -> None:
    for name, strategy in [("logger-fsdp", "fsdp"), ("logger-hsdp", "hsdp"), ("logger-ddp", "ddp")]:
        scaler = DynamicLossScaler(init_scale=2.0**24, growth_interval=3)
        plugin = MPTPrecision("fp16", scaler=scaler, sharded=strategy != "ddp")
        fabric, model, optimizer = make(strategy, plugin, MLP, out=out / name)
        logger = MixedPrecisionLogger(fabric, model, every_n_steps=1, histograms_every_n_steps=2)
        rows = train(fabric, model, optimizer, MLP, range(8), logger=logger)
        logger.finalize()
        write(out, name, fabric, {"rows": rows, "syncs": logger.recorder.syncs})


def meta_init(out: Path) -> None:
    """The model created on the meta device (``fabric.init_module(empty_init=True)``): the strategy materializes it
    after sharding, in fp32, and the plugin trains it."""
    plugin = MPTPrecision("bf16", sharded=True)
    strategy = ModelParallelStrategy(parallelize_with(plugin.mp_policy), **SHARD_OVER_BOTH)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    with fabric.init_module(empty_init=True):
        module = MLP()
    meta = all(p.is_meta for p in module.parameters())
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    rows = train(fabric, model, optimizer, MLP, range(4))
    write(out, "meta", fabric, {"rows": rows, "meta": meta})


def fp8(out: Path) -> None:
    for name, strategy, sharded in [("fp8-fsdp", "fsdp", True), ("fp8-ddp", "ddp", False)]:
        plugin = MPTPrecision("bf16", sharded=sharded, fp8=True, fp8_emulate=True)
        fabric, model, optimizer = make(strategy, plugin, Net)
        gathered: dict[str, str] = {}  # layer -> type of its weight in the forward (FSDP2's all-gathered copy)

        def seen(name: str, layer: nn.Module, args: Any) -> None:  # after FSDP2's own pre-hook: the gathered weight
            gathered.setdefault(name, type(layer.weight).__name__)

        for layer_name, layer in model.named_modules():
            if type(layer).__name__ == "Float8Linear":
                layer.register_forward_pre_hook(functools.partial(seen, layer_name))
        rows = train(fabric, model, optimizer, Net, range(6))
        write(out, name, fabric, {"rows": rows, "gathered": gathered})


def misconfigured(out: Path) -> None:
    """``unsharded``: a parallelize_fn that shards nothing; ``one-process-mesh``: Fabric's default mesh on one node
    (data parallel 1 x tensor parallel 2), over which fully_shard shards nothing across processes."""
    for name, strategy in [
        ("unsharded", ModelParallelStrategy(parallelize_with(None, False), **SHARD_OVER_BOTH)),
        ("one-process-mesh", ModelParallelStrategy(parallelize_with(mixed_precision_policy(torch.float16)))),
    ]:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[MPTPrecision("fp16", sharded=True)])
        fabric.launch()
        model = fabric.setup_module(MLP())
        try:
            model(torch.randn(2, 16))
            error = ""
        except ValueError as e:
            error = str(e)
        write(out, name, fabric, {"error": error})


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    try:
        for scenario in (compare_bf16, compare_fp16, accumulated, resume, logged, meta_init, fp8, misconfigured):
            scenario(out)
    except BaseException:
        (out / f"error-rank{rank()}").write_text(traceback.format_exc())
        raise
    (out / f"done-rank{rank()}").write_text("ok")


def rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", "0"))


if __name__ == "__main__":
    main()
