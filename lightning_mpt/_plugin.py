"""The public state of a mixed-precision plugin, read from its :class:`~lightning_mpt.core.engine.MixedPrecisionEngine`.

One definition for every plugin that delegates to the engine (the Trainer plugin and the Fabric plugin), so that the
names and their meaning cannot drift apart: the diagnostics read these attributes, whatever runs the loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_mpt.core.config import LIGHTNING_NAMES, check_arguments
from lightning_mpt.core.engine import MixedPrecisionEngine
from lightning_mpt.core.policy import StepRecord
from lightning_mpt.core.scaler import DynamicLossScaler

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


class EngineAttributes:
    """Mixin: the public attributes of a plugin whose ``_engine`` is a :class:`MixedPrecisionEngine`.

    Example:
        ```python
        from lightning_mpt.fabric import MPTPrecision

        plugin = MPTPrecision("fp16")
        assert plugin.loss_scale == 2.0**16 and plugin.skipped_steps == 0 and plugin.last_step is None
        ```
    """

    _engine: MixedPrecisionEngine
    _dtype: torch.dtype
    _reported_edits: set[str]
    precision: Any
    device: str
    master_weights: bool
    keep_fp32: tuple[type[Module], ...]
    max_consecutive_skips: int
    accumulate_fp32: bool
    #: how user code reaches the plugin, for messages
    _access: str = "the precision plugin"

    def _set_up(
        self,
        precision: Any,
        scaler: Any,
        master_weights: Any,
        keep_fp32: Any,
        max_consecutive_skips: Any,
        accumulate_fp32: Any,
    ) -> None:
        """The plugins' ``__init__``: check the arguments (a clear error for each), keep them, build the engine."""
        dtype, checked_scaler, kept = check_arguments(
            precision, scaler, master_weights, keep_fp32, max_consecutive_skips, accumulate_fp32
        )
        self.precision = LIGHTNING_NAMES[precision]
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # autocast device type; set from the module
        self.master_weights = master_weights
        self.keep_fp32 = kept
        self.max_consecutive_skips = max_consecutive_skips
        self.accumulate_fp32 = accumulate_fp32
        self._dtype = dtype
        self._reported_edits = set()
        self._engine = MixedPrecisionEngine(
            dtype, checked_scaler, master_weights, kept, max_consecutive_skips, accumulate_fp32, self._report_edits
        )

    @property
    def scaler(self) -> Optional[DynamicLossScaler]:
        """The loss scaler, ``None`` when not scaling."""
        return self._engine.policy.scaler

    @property
    def loss_scale(self) -> float:
        """The loss scale in force now (1.0 when not scaling)."""
        return self._engine.policy.loss_scale

    @property
    def backward_scale(self) -> float:
        """The loss scale the pending gradients were computed with (the scale of the latest backward).

        It differs from :attr:`loss_scale` between an optimizer step that changed the scale and the next backward.
        """
        return self._engine.policy.backward_scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients since the start of training."""
        return self._engine.policy.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest optimizer step was skipped."""
        return self._engine.policy.last_step_skipped

    @property
    def history(self) -> deque[StepRecord]:
        """One :class:`~lightning_mpt.StepRecord` per optimizer step (the latest 1024)."""
        return self._engine.policy.history

    @property
    def last_step(self) -> Optional[StepRecord]:
        """The record of the latest optimizer step, or ``None`` before the first."""
        history = self.history
        return history[-1] if history else None

    @property
    def half_dtype(self) -> torch.dtype:
        """The half-precision format of the model's weights: ``torch.float16`` or ``torch.bfloat16``."""
        return self._dtype

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's mixed-precision policy for this plugin: pass it to ``fully_shard`` under ``ModelParallelStrategy``
        (in the LightningModule's ``configure_model`` with the Trainer, in the ``parallelize_fn`` with Fabric).

        Parameters are all-gathered and computed in the plugin's half format and gradients reduce-scattered in it
        (half the bytes of fp32); FSDP keeps the fp32 shards, which are the masters. For fp32 gradient reduction pass
        ``dataclasses.replace(plugin.mp_policy, reduce_dtype=torch.float32)`` instead. See docs/distributed.md.

        Example:
            ```python
            from lightning_mpt.fabric import MPTPrecision

            plugin = MPTPrecision("bf16", sharded=True)
            assert plugin.mp_policy.param_dtype == plugin.mp_policy.reduce_dtype == torch.bfloat16
            # Trainer, in configure_model: fully_shard(block, mp_policy=self.trainer.precision_plugin.mp_policy)
            # Fabric, in parallelize_fn:   fully_shard(block, mp_policy=plugin.mp_policy)
            ```
        """
        from lightning_mpt.core.masters.sharded import mixed_precision_policy

        return mixed_precision_policy(self._dtype)

    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 tensor the optimizer steps for the module parameter ``param``: its master, or ``param`` itself
        when it has none (norm layers, ``master_weights=False``).

        Example:
            ```python
            from torch import nn
            from lightning_mpt.fabric import MPTPrecision

            plugin = MPTPrecision("bf16")
            model = plugin.convert_module(nn.Linear(2, 2))  # what fabric.setup(model) does first
            assert plugin.master_of(model.weight).dtype == torch.float32 and model.weight.dtype == torch.bfloat16
            plugin.restore()
            ```
        """
        return self._engine.masters.master_of(param)

    def named_masters(self) -> Iterator[tuple[str, Tensor, Tensor]]:
        """``(name, half parameter, fp32 master)`` for each parameter with a master, while the module is converted.

        Example:
            ```python
            from torch import nn
            from lightning_mpt.fabric import MPTPrecision

            plugin = MPTPrecision("fp16")
            plugin.convert_module(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
            assert [(name, p.dtype, m.dtype) for name, p, m in plugin.named_masters()] == [
                ("0.weight", torch.float16, torch.float32), ("0.bias", torch.float16, torch.float32)
            ]  # the LayerNorm stays fp32: its parameters are their own masters
            plugin.restore()
            ```
        """
        return self._engine.masters.named_masters()

    def main_params(self, optimizer: Optimizer) -> list[Tensor]:
        """The fp32 tensors that ``optimizer`` steps: masters of half parameters, fp32 parameters themselves."""
        return self._engine.masters.main_params(_params_of(optimizer))

    def _report_edits(self, names: list[str]) -> None:
        """Say once per parameter that in-place edits of its half weights were adopted by its master."""
        new = [n for n in names if n not in self._reported_edits]
        if new:
            self._reported_edits.update(new)
            rank_zero_info(
                f"MPTPrecision: the half-precision weights of {', '.join(new)} were edited in place outside the "
                "optimizer step (a clamp, a renormalisation, a weight average); the edits were copied into the fp32 "
                "masters, rounded to the half format. To edit at full precision, edit "
                f"`{self._access}.master_of(param)` "
                "instead."
            )

    def __repr__(self) -> str:
        name = "fp16" if self._dtype == torch.float16 else "bf16"
        return f"{type(self).__name__}({name!r}, scaler={self.scaler!r}, master_weights={self.master_weights})"


def report_half_kept(names: list[str]) -> None:
    """Say which norm layers FSDP2 all-gathers in the half format with their block (``ShardedMasters``'s
    ``on_half_kept``)."""
    shown = ", ".join(names[:8]) + (" and more" if len(names) > 8 else "")
    rank_zero_info(
        f"MPTPrecision: FSDP2 all-gathers the parameters of {shown} in the half format with the block they belong to "
        "(one policy per fully_shard group). Their fp32 masters, gradients, optimizer state and buffers stay fp32 "
        "and autocast runs norm ops in fp32. To compute with fp32 weights too, shard each of them on its own before "
        "its block: fully_shard(norm, mesh=mesh)."
    )


def _params_of(optimizer: Optimizer) -> Iterable[Tensor]:
    return (p for group in optimizer.param_groups for p in group["params"])
