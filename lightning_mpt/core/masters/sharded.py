"""FSDP2: mixed precision on torch's ``fully_shard``, whose sharded fp32 parameters are the masters (pure torch).

Under Lightning's ``ModelParallelStrategy`` the LightningModule's ``configure_model`` shards the model with
``torch.distributed.fsdp.fully_shard``, passing the plugin's policy (:func:`mixed_precision_policy`,
``MPTPrecision.mp_policy``). Then every piece of a mixed-precision step is torch's own, and
:class:`ShardedMasters` only unscales, decides and names:

* **masters**: FSDP2 keeps each parameter as an fp32 shard (a ``DTensor``) and the optimizer steps those shards.
  There is no second fp32 copy.
* **half format**: the policy's ``param_dtype``. Before a block's forward (and backward) FSDP all-gathers its
  parameters in that format, the compute copy, and frees them after use. The gradients are reduce-scattered in
  ``reduce_dtype`` (half by default) and FSDP keeps each rank's gradient shard in fp32.
* **scaling and skipping** (docs/guarantees.md#how-a-step-is-decided): the loss is scaled before backward. At the step
  :meth:`ShardedMasters.prepare` unscales the fp32 gradient shards in place with torch's fused AMP kernel, on each
  rank's local shards. The step policy all-reduces the non-finite flag (max) in the step's one collective, so
  every rank skips the same steps and holds the same scale.
* **culprits**: on a skipped step the per-parameter non-finite flags of the local shards are all-reduced (one more
  collective, on skipped steps only) and named by the module's own parameter names, which FSDP2 keeps.
* **clipping**: Lightning clips the plugin's ``main_params``, which here are the sharded parameters. torch's
  ``clip_grad_norm_`` computes the total norm of ``DTensor`` gradients over all shards.
* **checkpoints**: the module's state dict holds the fp32 shards. Lightning's ``ModelParallelStrategy`` saves them
  sharded (distributed checkpoint) or gathered into one file (``save_distributed_checkpoint=False``).

:func:`check_sharding` says what is wrong with a sharding the plugin cannot use, and how to fix it;
:class:`CollectiveBytes` counts the bytes that FSDP's all-gathers and reduce-scatters move.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mpt import _compat
from lightning_mpt.core.masters import (
    DEFAULT_KEEP_FP32,
    HALF_DTYPES,
    Gradients,
    distributed,
    params_of,
    whole_step,
)

__all__ = [
    "ShardedGrads",
    "ShardedMasters",
    "check_sharding",
    "compute_dtypes",
    "mixed_precision_policy",
]


@dataclass(frozen=True)
class _Loop:
    """Where the user shards the model and reaches the plugin, for messages that say how to fix a sharding."""

    shards_in: str  # where fully_shard is called
    policy: str  # the expression for the plugin's policy there
    how: str


_LOOPS = {
    "trainer": _Loop(
        "configure_model",
        "self.trainer.precision_plugin.mp_policy",
        "In the LightningModule's configure_model, shard the blocks and then the model's root module with torch's "
        "fully_shard and the plugin's policy:\n"
        "    policy = self.trainer.precision_plugin.mp_policy\n"
        "    mesh = self.device_mesh['data_parallel']\n"
        "    for block in self.model.blocks:\n"
        "        fully_shard(block, mesh=mesh, mp_policy=policy)\n"
        "    fully_shard(self.model, mesh=mesh, mp_policy=policy)",
    ),
    "fabric": _Loop(
        "the parallelize_fn of ModelParallelStrategy",
        "fabric.strategy.precision.mp_policy",
        "In the parallelize_fn given to Fabric's ModelParallelStrategy, shard the blocks and then the model's root "
        "module with torch's fully_shard and the plugin's policy:\n"
        "    def parallelize(model, device_mesh):\n"
        "        policy, mesh = plugin.mp_policy, device_mesh['data_parallel']  # plugin: the MPTPrecision\n"
        "        for block in model.blocks:\n"
        "            fully_shard(block, mesh=mesh, mp_policy=policy)\n"
        "        fully_shard(model, mesh=mesh, mp_policy=policy)\n"
        "        return model\n"
        "On one device and under DDP leave sharded=True out: the plugin keeps an fp32 copy there.",
    ),
}


def mixed_precision_policy(dtype: torch.dtype, reduce_dtype: Optional[torch.dtype] = None) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` for a half format: parameters all-gathered and computed in ``dtype``,
    gradients reduce-scattered in ``reduce_dtype`` (``dtype`` by default; ``torch.float32`` is the other choice).

    Example:
        ```python
        policy = mixed_precision_policy(torch.bfloat16)
        assert policy.param_dtype == policy.reduce_dtype == torch.bfloat16
        assert mixed_precision_policy(torch.float16, torch.float32).reduce_dtype == torch.float32
        ```
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    reduce_dtype = dtype if reduce_dtype is None else reduce_dtype
    if reduce_dtype not in (dtype, torch.float32):
        raise ValueError(f"reduce_dtype must be {dtype} or torch.float32, got {reduce_dtype}")
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)


def check_sharding(
    module: nn.Module,
    dtype: torch.dtype,
    keep_fp32: tuple[type[nn.Module], ...] = DEFAULT_KEEP_FP32,
    loop: Literal["trainer", "fabric"] = "trainer",
) -> list[str]:
    """Check that ``module`` is sharded with FSDP2 as the plugin needs; raise a ``ValueError`` that says how to fix
    it otherwise. Returns the names of ``keep_fp32`` modules (norm layers) whose parameters FSDP all-gathers in the
    half format, with the block they belong to.

    What is checked: some module was sharded; every trainable parameter is an fp32 shard (the masters); the mesh
    spans more than one process when several run (else nothing reduces the gradients); each
    ``fully_shard`` group all-gathers in ``dtype``, or in fp32 if it holds ``keep_fp32`` modules only (a norm layer
    sharded on its own); gradients are reduced in ``dtype`` or fp32.

    Example:
        ```python
        try:
            check_sharding(nn.Linear(2, 2), torch.bfloat16)
        except ValueError as err:
            assert "no FSDP2 module" in str(err)
        ```
    """
    where = _LOOPS[loop]
    groups = {name: m for name, m in module.named_modules() if isinstance(m, FSDPModule)}
    if not groups:
        raise ValueError(
            f"MPTPrecision under FSDP2 needs a model sharded with torch's fully_shard, and {type(module).__name__} has "
            f"no FSDP2 module: {where.shards_in} did not shard anything. {where.how}\n"
            "MPTPrecision supports one device, the DDP family and ModelParallelStrategy with FSDP2 (fully_shard). "
            "Tensor parallelism without fully_shard, FSDP1 ('fsdp') and DeepSpeed are not supported."
        )
    kept = {name for name, m in module.named_modules() if isinstance(m, keep_fp32)}
    members: dict[str, list[tuple[str, bool]]] = defaultdict(list)  # group name -> (parameter name, in a kept module)
    unsharded, not_fp32 = [], []
    for name, p in module.named_parameters():
        owner = name.rpartition(".")[0]
        group = _nearest(owner, groups)
        if not p.requires_grad:
            continue
        if group is None or not isinstance(p, DTensor):
            unsharded.append(name)
        elif p.dtype != torch.float32:
            not_fp32.append(f"{name} ({p.dtype})")
        else:
            members[group].append((name, _nearest(owner, kept) is not None))
    if unsharded:
        raise ValueError(
            f"MPTPrecision under FSDP2: the parameters {_listed(unsharded)} are not sharded by fully_shard, so nothing "
            f"would reduce their gradients across processes. Call fully_shard on the root module last. {where.how}"
        )
    spans = {p.device_mesh.size() for p in module.parameters() if isinstance(p, DTensor)}
    if distributed() and spans == {1}:
        world = dist.get_world_size()
        raise ValueError(
            f"MPTPrecision under FSDP2: fully_shard's device mesh spans 1 of the {world} processes, so nothing would "
            "reduce gradients across them and each process would train its own copy of the model. Shard over every "
            f"process: ModelParallelStrategy(data_parallel_size={world}, tensor_parallel_size=1) (its defaults on one "
            "node make the processes a tensor-parallel group) and fully_shard(..., mesh=device_mesh['data_parallel'])."
        )
    if not_fp32:
        raise ValueError(
            f"MPTPrecision under FSDP2: the sharded parameters {_listed(not_fp32)} are not fp32. FSDP2 shards the "
            "parameters as they are when fully_shard is called, and those shards are the fp32 master weights: build "
            "the model in fp32 (no .half()/.bfloat16(), no '-true' precision); the plugin's policy sets the half "
            "format."
        )
    name_of = "fp16" if dtype == torch.float16 else "bf16"
    half_kept = []
    for group, params in members.items():
        policy = _compat.fsdp_mp_policy(groups[group])
        if policy is None:  # a torch that hides the policy: nothing to check
            continue
        param_dtype = policy.param_dtype or torch.float32
        reduce_dtype = policy.reduce_dtype or param_dtype
        call = f"fully_shard({group or '<root>'}, mp_policy={policy})"
        only_kept = all(k for _, k in params)
        if param_dtype == torch.float32 and not only_kept:
            raise ValueError(
                f"MPTPrecision('{name_of}') under FSDP2: {call} all-gathers {_listed([n for n, k in params if not k])} "
                f"in fp32, so they would compute in fp32. Pass the plugin's policy, "
                f"mp_policy={where.policy} (param_dtype={dtype}). Only modules of keep_fp32 "
                "types (norm layers) may be sharded on their own in fp32."
            )
        if param_dtype not in (dtype, torch.float32) or reduce_dtype not in (dtype, torch.float32):
            raise ValueError(
                f"MPTPrecision('{name_of}') under FSDP2: {call} contradicts the plugin, whose half format is {dtype}. "
                f"Use param_dtype={dtype} and reduce_dtype={dtype} or torch.float32, e.g. "
                f"mp_policy={where.policy}."
            )
        if param_dtype == dtype:
            half_kept += sorted({near for n, k in params if k and (near := _nearest(n.rpartition(".")[0], kept))})
    return half_kept


def compute_dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    """The dtype each parameter of ``module`` is computed in under FSDP2, by name: its ``fully_shard`` group's
    ``param_dtype`` (the format FSDP all-gathers it in), or the parameter's own dtype outside any group or where the
    policy cannot be read. The diagnostics measure the parameters computed in the half format.

    Example:
        ```python
        assert compute_dtypes(nn.Linear(2, 2)) == {"weight": torch.float32, "bias": torch.float32}
        ```
    """
    groups = {name: m for name, m in module.named_modules() if isinstance(m, FSDPModule)}
    out: dict[str, torch.dtype] = {}
    for name, p in module.named_parameters():
        group = _nearest(name.rpartition(".")[0], groups)
        policy = _compat.fsdp_mp_policy(groups[group]) if group is not None else None
        out[name] = (policy.param_dtype if policy is not None else None) or p.dtype
    return out


def _nearest(name: str, names: Any) -> Optional[str]:
    """The longest of ``name``, its parents (``a.b`` -> ``a``) and the root ``""`` that is in ``names``."""
    while True:
        if name in names:
            return name
        if not name:
            return None
        name = name.rpartition(".")[0]


def _listed(names: list[str], limit: int = 8) -> str:
    """The first ``limit`` of ``names`` for a message, and how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _local(t: Tensor) -> Tensor:
    """This rank's shard of ``t`` (the tensor itself, not a copy: in-place ops on it change ``t``)."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class ShardedGrads(Gradients):
    """The fp32 gradient shards of one optimizer, unscaled in place. FSDP's parameters are their own masters, so
    they are all in ``own_params``."""

    def fp32_grads(self) -> list[Tensor]:
        """This process's shards of the gradients, aligned with :meth:`all_params`."""
        return [_local(p.grad) for p in self.own_params if p.grad is not None]


class ShardedMasters:
    """The masters of a model sharded with FSDP2: its own fp32 parameter shards, with no copy. The optimizer steps
    the shards and FSDP all-gathers them in the half format for the next forward, so the verbs of
    :class:`~lightning_mpt.core.masters.Masters` that hand masters to the optimizer or refresh half weights have
    nothing to move here.

    Args:
        dtype: the half-precision format, ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types whose parameters may be sharded on their own in fp32 (norm layers).
        on_half_kept: called at :meth:`convert` with the names of ``keep_fp32`` modules that FSDP all-gathers in the
            half format with their block (see :func:`check_sharding`).
        loop: what runs the loop, ``"trainer"`` or ``"fabric"``: where the messages say to call ``fully_shard``.

    Example:
        ```python
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from lightning_mpt.core.engine import MixedPrecisionEngine
        from lightning_mpt.core.scaler import DynamicLossScaler

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process, for the example
        try:
            model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
            fully_shard(model, mp_policy=mixed_precision_policy(torch.bfloat16))
            engine = MixedPrecisionEngine(ShardedMasters(torch.bfloat16), DynamicLossScaler(init_scale=1024.0))
            engine.convert(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # steps the fp32 shards
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(torch.randn(8, 4)).float().pow(2).mean()
                engine.scale_loss(loss).backward()
                engine.step(optimizer, engine.decide(optimizer))
                optimizer.zero_grad()
            engine.restore()
            assert model[0].weight.dtype == torch.float32 and engine.log.steps == 3
        finally:
            dist.destroy_process_group()
        ```
    """

    separate = False  # the optimizer holds the fp32 shards, the masters themselves

    def __init__(
        self,
        dtype: torch.dtype,
        keep_fp32: tuple[type[nn.Module], ...] = DEFAULT_KEEP_FP32,
        on_half_kept: Optional[Callable[[list[str]], None]] = None,
        loop: Literal["trainer", "fabric"] = "trainer",
    ) -> None:
        if dtype not in HALF_DTYPES:
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        self.keep_fp32 = tuple(keep_fp32)
        self.on_half_kept = on_half_kept
        self.on_edits: Optional[Callable[[list[str]], None]] = None  # never called: a shard's edit is its master's
        self.loop: Literal["trainer", "fabric"] = loop
        self._names: dict[Tensor, str] = {}

    # ------------------------------------------------------------------ set-up and teardown
    def convert(self, module: nn.Module, restored: bool = False) -> nn.Module:
        """Check how ``module`` was sharded (:func:`check_sharding`) and learn its parameter names. Nothing is cast:
        FSDP casts, per its policy, when it all-gathers."""
        half_kept = check_sharding(module, self.dtype, self.keep_fp32, self.loop)
        if half_kept and self.on_half_kept is not None:
            self.on_half_kept(half_kept)
        self._names = {p: name for name, p in module.named_parameters()}
        return module

    def restore(self) -> None:
        """Nothing to give back: the module's parameters are the fp32 masters all along."""
        self._names.clear()

    def adopt(self, optimizer: Optimizer) -> list[Any]:
        """No hooks: the optimizer holds the fp32 shards, so its state is fp32 and loads exactly."""
        return []

    # ------------------------------------------------------------------ queries
    def master_of(self, param: Tensor) -> Tensor:
        """``param`` itself: the fp32 shard is the master."""
        return param

    def storage(self) -> list[Tensor]:
        """None besides the parameters: each fp32 shard is its parameter."""
        return []

    def name_of(self, param: Tensor) -> str:
        return self._names.get(param, f"<unnamed {tuple(param.shape)}>")

    def named_masters(self) -> Iterator[tuple[str, Tensor, Tensor]]:
        """``(name, parameter, master)`` for each parameter; parameter and master are the same fp32 shard."""
        for p, name in self._names.items():
            yield name, p, p

    # ------------------------------------------------------------------ the optimizer step
    def prepare(self, optimizer: Optimizer, scale: float, check_edits: bool = True) -> ShardedGrads:
        """Unscale ``optimizer``'s fp32 gradient shards in place by ``1/scale`` (fused kernel on the local shards, no
        host sync). ``found_inf`` is a tensor on every rank, so the policy's all-reduce runs on every rank.
        ``check_edits`` is moot: a weight edited in place is edited in its master."""
        order = params_of(optimizer)
        out = ShardedGrads(optimizer=optimizer, own_params=[p for p in order if p.grad is not None])
        grads = out.fp32_grads()
        if any(g.is_sparse for g in grads):
            raise RuntimeError("MPTPrecision does not support sparse gradients; use dense embeddings (sparse=False).")
        if not order:
            return out
        device = grads[0].device if grads else _local(order[0]).device
        out.found_inf = torch.zeros((), device=device)
        by_device: dict[torch.device, list[Tensor]] = defaultdict(list)
        for g in grads:
            by_device[g.device].append(g)
        for dev, group in by_device.items():
            found = torch.zeros((), device=dev)
            _compat.unscale_(group, found, torch.full((), 1.0 / scale, device=dev))
            out.found_inf += found.to(device)
        return out

    def absorb_edits(self, grads: Gradients, flags: list[float]) -> list[str]:
        """Not called: an edit of a shard is an edit of its master (``prepare`` flags none)."""
        return []

    def enter(self, optimizer: Optimizer, grads: Gradients) -> None:
        grads.entered = True  # the optimizer holds the shards, which are the masters

    def exit(self, optimizer: Optimizer, grads: Gradients, stepped: bool) -> None:
        grads.entered = False  # FSDP all-gathers the half compute copy from the shards at the next forward

    def steps(self, optimizer: Optimizer, grads: Gradients) -> Generator[None, None, None]:
        return whole_step(self, optimizer, grads)

    def discard(self, grads: Gradients, zero: bool = False) -> None:
        """A skipped step: drop its gradient shards. Whatever ``zero`` says: FSDP2 leaves ``None`` (so after
        ``zero_grad(set_to_none=False)`` a parameter unused in the next step has no gradient, not zeros)."""
        for p in grads.all_params():
            p.grad = None

    def release(self, drop: bool) -> None:
        """Nothing kept past the step: the gradient shards are the parameters' own."""

    def rescale(self, grads: Gradients, scale: float) -> None:
        """Before a backward: the unscaled gradient shards that ``grads`` left (a step decided but not taken, or
        taken and not zeroed) are multiplied by ``scale``, the new backward's, so FSDP accumulates the next
        reduce-scatter into them consistently."""
        shards = [_local(p.grad) for p in grads.own_params if p.grad is not None]
        if shards and scale != 1.0:
            _compat.foreach_mul_(shards, scale)

    def accumulate_in_fp32(self, sync: bool, zeros: bool = True) -> None:
        """Nothing to do: FSDP2 accumulates the reduce-scattered gradients in the fp32 shards already."""
