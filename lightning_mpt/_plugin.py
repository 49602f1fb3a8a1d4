"""What the Trainer plugin and the Fabric plugin share, defined once: their arguments and public attributes, their
checkpoint state, the masters they pick, and the texts of their errors and notices.

Both delegate the step to :class:`~lightning_mpt.core.engine.MixedPrecisionEngine`; the diagnostics read the attributes
defined here, whatever runs the loop. This module sits below both front-ends and imports neither.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_mpt import _compat
from lightning_mpt._fp8_plugin import Float8Plugin
from lightning_mpt._gradscaler import is_gradscaler_state, take_over
from lightning_mpt.core.config import LIGHTNING_NAMES, MasterOptions, SkipPolicy, named_as_given, read_arguments
from lightning_mpt.core.engine import MixedPrecisionEngine
from lightning_mpt.core.masters import Masters, params_of
from lightning_mpt.core.masters.build import build_masters
from lightning_mpt.core.scaler import DynamicLossScaler
from lightning_mpt.core.schedules import ScheduleGate
from lightning_mpt.core.steps import StepRecord

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

Loop = Literal["trainer", "fabric"]

# Lightning's optimizer wrappers (``self.optimizers()``'s LightningOptimizer, what ``fabric.setup`` returns): classes
# made on the fly in these modules, subclassing the wrapped optimizer's class and holding it in ``_optimizer``
_WRAPPER_MODULES = ("lightning.pytorch.core.optimizer", "lightning.fabric.wrappers")


class MixedPrecisionPlugin(Float8Plugin):
    """Mixin of both plugins: their arguments, public attributes and checkpoint state, read from the engine.

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
    skipped_steps_advance_schedulers: bool
    options: MasterOptions
    skips: SkipPolicy
    overflow_retries: int

    def _init_plugin(self, precision: Any, *arguments: Any) -> None:
        """The plugins' ``__init__``: check the arguments (those of :func:`read_arguments`, in its order; a clear error
        for each), keep them, build the engine."""
        args = read_arguments(precision, *arguments)
        dtype, self.skips = args.dtype, args.skips  # the skip options as they apply
        self._fp8 = args.fp8
        self.precision = LIGHTNING_NAMES[precision]
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # autocast device type; set from the module
        self.master_weights = args.masters.enabled
        self.keep_fp32 = args.keep_fp32
        self.max_consecutive_skips = args.skips.max_consecutive
        self.accumulate_fp32 = args.masters.accumulate_fp32
        self.skipped_steps_advance_schedulers = args.skips.advance_schedulers
        self.overflow_retries = args.skips.retries
        self._dtype = dtype
        self._reported_edits = set()
        # the options as given (None: the format's default, which FSDP2 resolves its own way) and as they apply here
        self._given, self._given_object = args.masters, args.masters_object
        with named_as_given("masters", self._given_object):
            self.options = self._given.resolved(dtype)
        self._engine = MixedPrecisionEngine(
            build_masters(self.options, dtype, args.keep_fp32, chunks_asked=self._given.chunk is not None),
            args.scaler,
            self.max_consecutive_skips,
            self.accumulate_fp32,
            on_edits=self._report_edits,
            # fp16's whole step holds fp32 gradients anyway: summing micro-batches in fp32 costs nothing at its peak
            # and keeps a scaled sum from overflowing where "16-mixed" (fp32 gradients) does not
            fp32_when_accumulating=dtype == torch.float16
            and self.options.enabled
            and _compat.GRAD_DTYPE
            and not self.options.chunk
            and not self.options.remainders,
        )
        self._engine.log.gate = ScheduleGate(enabled=not self.skipped_steps_advance_schedulers)

    @property
    def chunked_step(self) -> Union[bool, int]:
        """The chunked step in force off FSDP2: ``False``, ``True`` (chunks of ``2**24`` elements) or a size."""
        return self.options.chunk  # type: ignore[return-value]

    @property
    def master_remainders(self) -> bool:
        """Whether bf16 masters sleep as 16-bit remainders between steps (off FSDP2)."""
        return bool(self.options.remainders)

    def _check_under_fsdp2(self, asked: str = "") -> None:
        """A clear error for the options given that FSDP2 cannot take, named as they were given (``asked``: the
        plugin's arguments that asked for FSDP2, for the message); the options FSDP2 applies."""
        with named_as_given("masters", self._given_object):
            for option, value in (("chunked_step", self._given.chunk), ("master_remainders", self._given.remainders)):
                if value not in (None, False):
                    raise ValueError(
                        f"MPTPrecision({option}=...) is not supported under FSDP2 (ModelParallelStrategy): FSDP2's "
                        "fp32 shards are the masters, and its step holds 1/N of the gradients per process already. "
                        f"Leave {option} unset."
                    )
            check_sharded(self.master_weights, asked)
        self.options = self._given.resolved(self._dtype, sharded=True)

    def _sharded_masters(self, loop: Loop) -> Masters:
        """FSDP2's own fp32 shards as the masters, or a clear error where they cannot be."""
        self._check_under_fsdp2("sharded=True, " if loop == "fabric" else "")
        return build_masters(self.options, self._dtype, self.keep_fp32, loop, report_half_kept)

    # ------------------------------------------------------------------ public attributes
    @property
    def scaler(self) -> Optional[DynamicLossScaler]:
        """The loss scaler, ``None`` when not scaling."""
        return self._engine.log.scaler

    @property
    def loss_scale(self) -> float:
        """The loss scale in force now (1.0 when not scaling)."""
        return self._engine.loss_scale

    @property
    def backward_scale(self) -> float:
        """The loss scale the pending gradients were computed with (the scale of the latest backward).

        It differs from :attr:`loss_scale` between an optimizer step that changed the scale and the next backward.
        """
        return self._engine.backward_scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients since the start of training."""
        return self._engine.log.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest optimizer step was skipped."""
        history = self._engine.log.history
        return bool(history) and history[-1].skipped

    def last_step_skipped_for(self, optimizer: Optimizer) -> bool:
        """Whether the latest step of ``optimizer`` was skipped (``False`` before its first step): the per-optimizer
        view of :attr:`last_step_skipped`, for several optimizers.

        Args:
            optimizer: a torch optimizer the plugin steps, or Lightning's wrapper of one.

        Example:
            ```python
            from lightning_mpt.fabric import MPTPrecision

            plugin = MPTPrecision("fp16")
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            assert not plugin.last_step_skipped_for(optimizer)  # it has not stepped yet
            ```
        """
        index = self._engine.index_of(unwrap(optimizer))
        return index is not None and self._engine.log.consecutive.get(index, 0) > 0

    def _gate_schedulers(self, schedulers: list[Any]) -> None:
        """Apply ``skipped_steps_advance_schedulers=False`` to ``schedulers``, each of an optimizer it steps."""
        gate = self._engine.log.gate
        for scheduler in schedulers:
            optimizer = unwrap(getattr(scheduler, "optimizer", None))
            if not isinstance(optimizer, Optimizer):
                raise TypeError(
                    f"MPTPrecision: {type(scheduler).__name__} has no torch optimizer in `.optimizer`; LR schedulers "
                    "that skipped steps do not advance are those of torch.optim.lr_scheduler (or subclasses)."
                )
            gate.attach(scheduler, self._engine.adopt(optimizer))

    @property
    def history(self) -> deque[StepRecord]:
        """One :class:`~lightning_mpt.StepRecord` per optimizer step (the latest 1024)."""
        return self._engine.log.history

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
            ```
        """
        from lightning_mpt.core.masters.sharded import mixed_precision_policy

        return mixed_precision_policy(self._dtype)

    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 tensor the optimizer steps for the module parameter ``param``: its master, or ``param`` itself
        when it has none (norm layers, frozen parameters, ``master_weights=False``).

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
        masters = self._engine.masters
        return [masters.master_of(p) for p in params_of(unwrap(optimizer))]

    def master_storage(self) -> list[Tensor]:
        """The tensors that hold the masters now, without waking any: fp32 masters, or with ``master_remainders`` the
        int16 remainders of those asleep (what a memory count should see, also inside an optimizer step).

        Example:
            ```python
            from lightning_mpt.fabric import MPTPrecision

            plugin = MPTPrecision("bf16")
            model = plugin.convert_module(torch.nn.Linear(4, 4))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            assert [t.dtype for t in plugin.master_storage()] == [torch.float32, torch.float32]
            ```
        """
        return self._engine.masters.storage()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The scaler and the counters (Lightning saves them in a checkpoint; Fabric when the plugin is in the
        state)."""
        return {"precision": self.precision, "master_weights": self.master_weights, **self._engine.log.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a warning says what could not be restored as saved. A ``torch.amp.GradScaler``'s
        state (a run of Lightning's ``"16-mixed"`` resumed under this plugin) gives the scaler its scale."""
        if is_gradscaler_state(state_dict):
            take_over(self.scaler, state_dict)
            return
        warning = self._engine.log.load_state_dict(state_dict)
        if warning:
            rank_zero_warn(f"MPTPrecision: {warning}")

    def _report_edits(self, names: list[str]) -> None:
        """Say once per parameter that in-place edits of its half weights were adopted by its master."""
        new = [n for n in names if n not in self._reported_edits]
        if new:
            self._reported_edits.update(new)
            rank_zero_info(
                f"MPTPrecision: the half-precision weights of {', '.join(new)} were edited in place outside the "
                "optimizer step (a clamp, a renormalisation, a weight average); the edits were copied into the fp32 "
                "masters, rounded to the half format. To edit at full precision, edit "
                f"`{self._access}.master_of(param)` instead."
            )

    def __repr__(self) -> str:
        name = "fp16" if self._dtype == torch.float16 else "bf16"
        memory = (("chunked_step", self._given.chunk), ("master_remainders", self._given.remainders))
        chosen = "".join(f", {option}={value!r}" for option, value in memory if value is not None)  # as given
        return f"{type(self).__name__}({name!r}, scaler={self.scaler!r}, master_weights={self.master_weights}{chosen})"


def unwrap(optimizer: Any) -> Any:
    """The torch optimizer behind Lightning's wrappers (``self.optimizers()``, what ``fabric.setup`` returns)."""
    if type(optimizer).__module__ in _WRAPPER_MODULES:
        inner = vars(optimizer).get("_optimizer")  # both wrappers keep it there; other classes of those modules do not
        if isinstance(inner, Optimizer):
            return inner
    return optimizer


def check_sharded(master_weights: bool, asked: str = "") -> None:
    """Raise a clear error where FSDP2's fp32 shards cannot be the masters (``asked``: the plugin's arguments that
    asked for them, for the message)."""
    if not master_weights:
        raise ValueError(
            f"MPTPrecision({asked}master_weights=False) is not supported under FSDP2: FSDP2 keeps fp32 parameter "
            "shards, which are the master weights. Use master_weights=True (the default)."
        )
    try:
        import torch.distributed.fsdp

        torch.distributed.fsdp.fully_shard  # public from torch 2.6
    except (ImportError, AttributeError) as err:
        raise ImportError(
            f"MPTPrecision under FSDP2 ({asked.rstrip(', ') or 'ModelParallelStrategy'}) needs torch >= 2.6 (FSDP2); "
            f"this is torch {torch.__version__}."
        ) from err


def lbfgs_unsupported(loop: Loop) -> str:
    """Why a loss scaler cannot drive LBFGS, and what works instead."""
    lightning = "Lightning's" if loop == "trainer" else "Fabric's"
    return (
        "MPTPrecision with a loss scaler does not support torch.optim.LBFGS: LBFGS re-evaluates the loss inside "
        f"step(), where scaled gradients cannot be checked and unscaled (as with {lightning} '16-mixed'). Use "
        "MPTPrecision('bf16') (no scaler), a first-order optimizer (SGD, Adam, AdamW, ...), or '32-true'."
    )


def supported_strategies(loop: Loop) -> str:
    """The strategies the plugins support, in the words of the Trainer or of Fabric."""
    if loop == "trainer":
        return (
            "Supported: a single device ('auto' on one device), the DDP family ('ddp', 'ddp_spawn', 'ddp_fork', "
            "'ddp_notebook') and FSDP2: ModelParallelStrategy with fully_shard in configure_model (see "
            "docs/distributed.md). DeepSpeed and FSDP1 ('fsdp') bring their own mixed precision: use "
            "Trainer(precision='16-mixed' or 'bf16-mixed') with them, or move to FSDP2."
        )
    return (
        "Supported: a single device, the DDP family (Fabric(strategy='ddp'), 'ddp_spawn', 'ddp_fork', 'ddp_notebook') "
        "and FSDP2: ModelParallelStrategy with fully_shard in its parallelize_fn and MPTPrecision(..., sharded=True). "
        "FSDP1 ('fsdp') and DeepSpeed bring their own mixed precision: use Fabric(precision='16-mixed' or "
        "'bf16-mixed') with them."
    )


_HALF_KEPT_SAID: set[str] = set()  # the notes said in this process


def report_half_kept(names: list[str]) -> None:
    """Say which norm layers FSDP2 all-gathers in the half format with their block, once per process for the same
    layers (each fit of the same model converts it again)."""
    shown = ", ".join(names[:8]) + (" and more" if len(names) > 8 else "")
    note = (
        f"MPTPrecision: FSDP2 all-gathers the parameters of {shown} in the half format with the block they belong to "
        "(one policy per fully_shard group). Their fp32 masters, gradients, optimizer state and buffers stay fp32 "
        "and autocast runs norm ops in fp32. To compute with fp32 weights too, shard each of them on its own before "
        "its block: fully_shard(norm, mesh=mesh)."
    )
    if note not in _HALF_KEPT_SAID:
        _HALF_KEPT_SAID.add(note)
        rank_zero_info(note)
