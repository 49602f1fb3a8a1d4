"""Where the set-up of the module that the Fabric plugin converted stands, apart from the plugin's hooks.

Fabric calls the plugin's ``convert_module`` before it moves the module to its device and before the strategy wraps
it, and has no hook after either. So the plugin finishes the set-up at the first call that needs it: the masters
follow the parameters to their device (*ready*, at the first forward, backward, step or optimizer load), and under DDP
every process takes rank 0's masters (*synced*, at the first backward, where all ranks meet). Until the first backward
the load guards give the optimizers that hold the module's parameters the hooks that load their state into the fp32
masters (:mod:`lightning_mpt.fabric._load_guards`); at their first step the optimizers are adopted by the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_mpt._plugin import MixedPrecisionPlugin, supported_strategies, unwrap
from lightning_mpt._pretrained import SavedAsMasters
from lightning_mpt.core.engine import MixedPrecisionEngine
from lightning_mpt.core.masters import distributed, is_fully_sharded
from lightning_mpt.core.masters.copies import CopyMasters
from lightning_mpt.fabric._load_guards import LoadGuards, warn_if_rounded
from lightning_mpt.fabric._module import ForwardModule, UnmarkedCalls

__all__ = ["ModuleHooks", "ModuleSetUp"]


class ModuleSetUp:
    """The module a Fabric plugin converted, what Fabric runs for it, and how far its set-up has gone.

    Args:
        engine: the plugin's engine; its masters are the module's.
        half: the half-precision format.
        sharded: FSDP2 shards the module after set-up (``MPTPrecision(sharded=True)``): its shards become the masters
            when the set-up completes.
        on_device: called when the set-up completes, with the device of the module's parameters.

    Example:
        ```python
        from lightning_mpt.core.masters.copies import CopyMasters

        engine = MixedPrecisionEngine(CopyMasters(torch.float16))
        devices = []
        setup = ModuleSetUp(engine, torch.float16, sharded=False, on_device=devices.append)
        forward = setup.converted(engine.convert(torch.nn.Linear(2, 2)), with_masters=True)  # convert_module
        setup.ensure_ready()  # the first forward, backward or step
        assert setup.ready and devices == [torch.device("cpu")] and forward.module is setup.module
        setup.close()
        engine.restore()
        ```
    """

    def __init__(
        self,
        engine: MixedPrecisionEngine,
        half: torch.dtype,
        sharded: bool,
        on_device: Callable[[torch.device], None],
    ) -> None:
        self._engine = engine
        self._half = half
        self._sharded = sharded
        self._on_device = on_device
        self.module: Optional[Module] = None  # the converted module
        self.forward: Optional[ForwardModule] = None  # what convert_module returned for it (one device, DDP)
        self._params: set[Tensor] = set()  # its parameters at conversion, to notice a strategy that replaced them
        self.ready = False  # masters moved next to their parameters (Fabric moves the module after converting it)
        self.synced = True  # masters made equal across processes (at the first backward, where all ranks meet)
        self._adopted: list[Optimizer] = []
        # optimizer state loads into the masters also before the first step, which adopts the optimizer
        self.loads = LoadGuards(engine.masters, half, self.ensure_ready)
        self.unmarked = UnmarkedCalls(half)  # an unmarked method's call of a half layer: the method to mark
        self.saves = SavedAsMasters(half)  # Hugging Face models' save_pretrained says fp32, as the masters saved are

    def run_for(self, module: Module) -> Optional[Module]:
        """What Fabric runs for ``module`` when it is the converted module (or that already), ``None`` when no module
        is converted yet; a second module is refused, since the plugin holds the masters of one."""
        if self.module is None:
            return None
        if module is self.module or module is self.forward:
            return self.forward or self.module
        raise ValueError(
            f"MPTPrecision holds the fp32 masters of one module and already converted a "
            f"{type(self.module).__name__}; `fabric.setup` was called with a second one ({type(module).__name__}). "
            "Set the models up as one module (for example an nn.ModuleDict with both) or call "
            "`fabric.strategy.precision.restore()` when done with the first."
        )

    def converted(self, module: Module, with_masters: bool) -> ForwardModule:
        """Hold ``module``, cast by the engine; return what Fabric runs for it (``with_masters``: it has fp32 masters,
        which optimizer loads and Hugging Face saves are kept exact for)."""
        self.module, self.ready = module, False
        self._params = set(module.parameters())
        self.synced = not distributed()
        if with_masters:
            self.loads.watch(module)
            self.saves.watch(module)
        self.unmarked.watch(module)
        self.forward = ForwardModule(module)
        return self.forward

    def held_for_sharding(self, module: Module) -> None:
        """Hold ``module``, left fp32 for FSDP2 to shard: nothing to cast, no replica to make equal across
        processes."""
        self.module, self.ready = module, False
        self._params, self.synced = set(), True

    def ensure_ready(self) -> None:
        """Once after set-up: take FSDP2's shards as the masters (``sharded``), or refuse a strategy that replaced
        the parameters and move the masters next to them."""
        if self.ready or self.module is None:
            return
        if self._sharded:  # sharded by now: check how (a clear error for a module left unsharded), learn the names
            self._engine.convert(self.module)
            self._params = set(self.module.parameters())
        params = list(self.module.parameters())
        if any(p not in self._params for p in params):
            raise ValueError(_replaced(self.forward or self.module, self._half))  # what the strategy got
        if isinstance(self._engine.masters, CopyMasters):  # Fabric moves the module after converting it
            self._engine.masters.follow_devices()
        if params:
            self._on_device(params[0].device)
        self.ready = True

    def before_backward(self, model: Optional[Module], accumulate_fp32: bool) -> bool:
        """Complete the set-up at the first backward (no more loads before training, the masters equal everywhere);
        return whether this backward reduces gradients across processes (``False`` inside
        ``fabric.no_backward_sync``: with ``accumulate_fp32`` the fp32 sum goes back to the half format for DDP's
        reducer there)."""
        self.ensure_ready()
        self.loads.stop()
        if not self.synced:
            # DDP made the half weights equal at set-up (rank 0's): they are left alone, a forward's graph may hold them
            if isinstance(self._engine.masters, CopyMasters):
                self._engine.masters.broadcast(refresh=False)
            self.synced = True
        if self._sharded or not distributed():
            return True
        sync = getattr(model, "require_backward_grad_sync", None)
        if sync is not None:
            return bool(sync)
        if accumulate_fp32:
            raise ValueError(
                "MPTPrecision(accumulate_fp32=True) under DDP needs the model in each backward, to see whether it "
                "synchronises gradients (fabric.no_backward_sync): call fabric.backward(loss, model=model)."
            )
        return True  # fp16's fp32 sums of micro-batches then go back to the half format at every backward

    def adopt(self, optimizer: object) -> Optimizer:
        """The torch optimizer behind ``optimizer`` (Fabric's wrapper or itself), adopted by the engine."""
        raw = unwrap(optimizer)
        self.ensure_ready()
        if any(raw is known for known in self._adopted):
            return raw  # type: ignore[no-any-return]
        if not isinstance(raw, Optimizer):
            raise ValueError(
                f"MPTPrecision steps torch optimizers; the strategy handed it a {type(raw).__name__}. "
                f"{supported_strategies('fabric')}"
            )
        warn_if_rounded(raw, self._engine.masters, self._half)
        self._engine.adopt(raw)
        self._adopted.append(raw)
        self.loads.release(raw)
        return raw

    def close(self) -> None:
        """Forget the module (the engine restored it): hooks removed, nothing adopted."""
        self.loads.close()
        self.unmarked.close()
        self.saves.close()
        self.module, self.forward = None, None
        self._params = set()
        self._adopted.clear()
        self.ready, self.synced = False, True


class ModuleHooks(MixedPrecisionPlugin):
    """The Fabric plugin's methods around its module: convert it, adopt its optimizers and LR schedulers, restore it
    (its state: a :class:`ModuleSetUp`).

    Example:
        ```python
        from lightning_mpt.fabric import MPTPrecision

        assert issubclass(MPTPrecision, ModuleHooks)
        ```
    """

    _setup: ModuleSetUp
    sharded: bool

    def convert_module(self, module: Module) -> Module:
        """Cast ``module`` to the half format in place (``fabric.setup`` calls it first); its fp32 tensors become the
        masters. With ``sharded=True`` the module stays fp32 for FSDP2 to shard; the plugin takes its shards as the
        masters at the first forward.

        Returns:
            With ``sharded=True`` the module itself (the strategy's ``parallelize_fn`` receives it). Otherwise a thin
            wrapper whose ``forward`` calls it: Fabric then sends methods marked with ``mark_forward_method`` through
            the plugin's autocast on one device too, as it does under DDP. The wrapper's ``state_dict``,
            ``load_state_dict`` and attributes are the module's.
        """
        held = self._setup.run_for(module)  # set up already (a second module is refused)
        if held is not None:
            return held
        if self.sharded:  # the strategy shards it next: nothing to cast, no replica to make equal across processes
            module = self.convert_fp8(module, fsdp=True)  # before the strategy's parallelize_fn shards it
            self._engine.masters = self._sharded_masters("fabric")
            self._setup.held_for_sharding(module)
            return module
        module = self._convert_fp8(module)  # Float8Linear keeps the Linear's parameters: they get masters next
        self._engine.convert(module)
        return self._setup.converted(module, with_masters=self.master_weights)

    def adopt(self, *optimizers: Optimizer) -> None:
        """Take charge of ``optimizers`` now rather than at their first step (optional).

        Optimizer state loads into the fp32 masters exactly without it: the plugin finds the optimizers holding the
        module's parameters at ``fabric.setup`` and when the model's or its own entry of the state loads. Only an
        optimizer made after set-up and restored by ``fabric.load`` before both entries needs it before the load.
        ``fabric.setup``'s wrapped optimizers are accepted.

        Example:
            ```python
            import lightning as L
            from torch import nn
            from lightning_mpt.fabric import MPTPrecision

            mpt = MPTPrecision("bf16")
            fabric = L.Fabric(accelerator="cpu", plugins=[mpt])
            model = nn.Linear(4, 4)
            model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters()))
            mpt.adopt(optimizer)  # then fabric.load(path, {"model": model, "optimizer": optimizer, "mpt": mpt})
            mpt.restore()
            ```
        """
        for optimizer in optimizers:
            self._setup.adopt(optimizer)

    def setup_schedulers(self, *schedulers: Any) -> None:
        """Hand the plugin the LR schedulers, which Fabric does not: with ``skipped_steps_advance_schedulers=False`` a
        scheduler's ``step()`` then does nothing when every step of its optimizer since its last ``step()`` was
        skipped (with ``True`` nothing changes). Call it after ``fabric.setup``; it adopts their optimizers.

        Args:
            schedulers: torch LR schedulers of optimizers this plugin steps (made with the raw or the set-up ones).

        Example:
            ```python
            import lightning as L
            from torch import nn
            from lightning_mpt.fabric import MPTPrecision

            mpt = MPTPrecision("fp16", skipped_steps_advance_schedulers=False)
            fabric = L.Fabric(accelerator="cpu", plugins=[mpt])
            model = nn.Linear(4, 4)
            model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
            mpt.setup_schedulers(scheduler)  # scheduler.step() after a skipped optimizer.step() does nothing
            mpt.restore()
            ```
        """
        if self.skipped_steps_advance_schedulers:
            return
        for scheduler in schedulers:
            optimizer = getattr(scheduler, "optimizer", None)
            if isinstance(unwrap(optimizer), Optimizer):
                self._setup.adopt(optimizer)  # adopted now, so that its index is known
        self._gate_schedulers(list(schedulers))

    def restore(self) -> None:
        """End mixed precision for the module: it gets fp32 parameters equal to the masters (edits of its half weights
        since the last step adopted first), the optimizers step it directly again, and the plugin forgets it.

        Fabric has no end-of-training hook, so call it when training is done (``fabric.strategy.precision.restore()``);
        Fabric's ``strategy.teardown()`` calls it too. The plugin's counters and scaler are kept.
        """
        self._engine.restore()
        self._setup.close()

    def teardown(self) -> None:
        """Fabric's teardown hook (``strategy.teardown()``): :meth:`restore`."""
        self.restore()


def _replaced(module: Module, dtype: torch.dtype) -> str:
    """Why the module's parameters are not those the plugin converted, and what to do."""
    if is_fully_sharded(module):
        return (
            f"MPTPrecision: the module was sharded with FSDP2 (fully_shard) after the plugin had cast it to {dtype}, "
            "so FSDP2 holds half-precision shards and the plugin's fp32 masters no longer match. Under "
            "ModelParallelStrategy create the plugin with MPTPrecision(..., sharded=True): set-up then leaves the "
            "model fp32 and FSDP2's fp32 shards are the masters; pass mp_policy=plugin.mp_policy to fully_shard."
        )
    return (
        "MPTPrecision: the module's parameters were replaced after it was converted, by a sharding strategy "
        "(or by code that swapped them after fabric.setup); its fp32 masters no longer match. "
        + supported_strategies("fabric")
    )
