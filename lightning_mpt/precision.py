"""``MPTPrecision``: a Lightning precision plugin with a half-precision model, fp32 master weights owned by the
optimizer, and a configurable dynamic loss scaler."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mpt.master import DEFAULT_KEEP_FP32, MasterWeights, PreparedGrads
from lightning_mpt.scaler import DynamicLossScaler

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_LIGHTNING_NAMES = {"fp16": "16-mixed", "bf16": "bf16-mixed"}
_HISTORY = 1024  # optimizer steps kept in ``MPTPrecision.history``


class NonFiniteGradientError(RuntimeError):
    """Raised when training keeps producing non-finite gradients (see ``MPTPrecision(max_consecutive_skips=...)``)."""


@dataclass
class StepRecord:
    """What happened at one optimizer step under :class:`MPTPrecision`.

    ``scale`` is the loss scale the step's gradients were computed with. For a skipped step the names of the
    parameters whose gradients were non-finite are computed on first access of :attr:`nonfinite_params` (one host
    sync), so recording them costs nothing when nobody asks.
    """

    step: int  # optimizer steps taken by the plugin before this one (skipped ones included)
    scale: float
    skipped: bool
    loss_finite: bool = True
    _names: list[str] = field(default_factory=list, repr=False)
    _mask: Optional[Tensor] = field(default=None, repr=False)

    @property
    def nonfinite_params(self) -> list[str]:
        """Names of the parameters whose gradients held inf or NaN at this step (empty for a clean step)."""
        if self._mask is not None:
            self._names = [n for n, bad in zip(self._names, self._mask.tolist()) if bad]
            self._mask = None
        return self._names


class MPTPrecision(Precision):
    """Mixed precision with a half-precision model, fp32 master weights and dynamic loss scaling.

    The model's parameters live in fp16/bf16 (norm layers stay fp32) and the forward runs under autocast. The
    optimizer steps fp32 masters taken from the weights before they were cast; its state is fp32. The loss is
    scaled before backward; at each optimizer step the half gradients are copied into fp32, unscaled with fused
    kernels (one host sync per step), and a step with a non-finite gradient is skipped.

    Args:
        precision: ``"fp16"`` or ``"bf16"``.
        scaler: ``None`` for the default (a :class:`DynamicLossScaler` for fp16, no scaling for bf16), a
            :class:`DynamicLossScaler`, or a number for a static scale.
        master_weights: keep fp32 masters. ``False`` steps the half weights directly (same scaler), the
            configuration that shows what master weights buy.
        keep_fp32: module types whose parameters and buffers stay fp32 (all norm layers by default).
        max_consecutive_skips: raise :class:`NonFiniteGradientError` after this many skipped steps in a row.

    Example:
        ```python
        import lightning as L
        from lightning_mpt import DynamicLossScaler, MPTPrecision

        trainer = L.Trainer(plugins=[MPTPrecision("fp16", scaler=DynamicLossScaler(growth_interval=1000))])
        ```
    """

    def __init__(
        self,
        precision: Literal["fp16", "bf16"] = "fp16",
        *,
        scaler: Union[DynamicLossScaler, float, None] = None,
        master_weights: bool = True,
        keep_fp32: tuple[type[Module], ...] = DEFAULT_KEEP_FP32,
        max_consecutive_skips: int = 50,
    ) -> None:
        if precision not in _DTYPES:
            raise ValueError(f"MPTPrecision(precision={precision!r}): precision must be one of 'fp16', 'bf16'.")
        if scaler is None:
            scaler = DynamicLossScaler() if precision == "fp16" else None
        elif isinstance(scaler, (int, float)) and not isinstance(scaler, bool):
            if not (math.isfinite(scaler) and scaler > 0):
                raise ValueError(f"MPTPrecision(scaler={scaler!r}): a static scale must be a finite number > 0.")
            scaler = DynamicLossScaler.static(float(scaler))
        elif not isinstance(scaler, DynamicLossScaler):
            raise TypeError(
                f"MPTPrecision(scaler={scaler!r}): expected None, a DynamicLossScaler or a number (a static scale)."
            )
        keep_fp32 = tuple(keep_fp32)
        bad = [k for k in keep_fp32 if not (isinstance(k, type) and issubclass(k, Module))]
        if bad:
            raise TypeError(f"MPTPrecision(keep_fp32=...): expected torch.nn.Module subclasses, got {bad!r}.")
        if not (isinstance(max_consecutive_skips, int) and max_consecutive_skips >= 1):
            raise ValueError(
                f"MPTPrecision(max_consecutive_skips={max_consecutive_skips!r}): expected an int >= 1."
            )
        self.precision = _LIGHTNING_NAMES[precision]  # type: ignore[assignment]
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # autocast device type; set again in connect()
        self.scaler: Optional[DynamicLossScaler] = scaler
        self.master_weights = master_weights
        self.keep_fp32 = keep_fp32
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.history: deque[StepRecord] = deque(maxlen=_HISTORY)
        self._dtype = _DTYPES[precision]
        self._masters = MasterWeights(self._dtype, keep_fp32, enabled=master_weights)
        self._consecutive_skips = 0
        self._steps = 0
        self._pending: dict[Optimizer, PreparedGrads] = {}
        self._backward_scale = self.loss_scale
        self._loss_finite: Optional[Tensor] = None
        self._optimizer_hooks: dict[Optimizer, list[Any]] = {}

    # ------------------------------------------------------------------ public state
    @property
    def loss_scale(self) -> float:
        """The loss scale in force now (1.0 when not scaling)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def last_step(self) -> Optional[StepRecord]:
        """The record of the latest optimizer step, or ``None`` before the first."""
        return self.history[-1] if self.history else None

    @property
    def backward_scale(self) -> float:
        """The loss scale the pending gradients were computed with (the scale of the latest backward).

        It differs from :attr:`loss_scale` between an optimizer step that changed the scale and the next backward.
        """
        return self._backward_scale

    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 tensor the optimizer steps for the module parameter ``param``: its master, or ``param`` itself
        when it has none (norm layers, ``master_weights=False``).

        Example:
            ```python
            from torch import nn

            plugin = MPTPrecision("bf16")
            model = plugin.convert_module(nn.Linear(2, 2))
            assert plugin.master_of(model.weight).dtype == torch.float32 and model.weight.dtype == torch.bfloat16
            plugin.teardown()
            ```
        """
        return self._masters.master_of(param)

    @property
    def half_dtype(self) -> torch.dtype:
        """The half-precision format of the model's weights: ``torch.float16`` or ``torch.bfloat16``."""
        return self._dtype

    def named_masters(self) -> Iterator[tuple[str, Tensor, Tensor]]:
        """``(name, half parameter, fp32 master)`` for each parameter with a master (during a stage).

        Example:
            ```python
            from torch import nn

            plugin = MPTPrecision("fp16")
            plugin.convert_module(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))  # what Trainer does at setup
            for name, param, master in plugin.named_masters():
                print(name, param.dtype, master.dtype)  # 0.weight torch.float16 torch.float32 (LayerNorm stays fp32)
            plugin.teardown()
            ```
        """
        return self._masters.named_masters()

    def main_params(self, optimizer: Optimizer) -> list[Tensor]:  # type: ignore[override]
        """The fp32 tensors that ``optimizer`` steps: masters of half parameters, fp32 parameters themselves."""
        return self._masters.main_params(p for group in optimizer.param_groups for p in group["params"])

    # ------------------------------------------------------------------ model set-up and teardown
    def convert_module(self, module: Module) -> Module:
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            check_strategy(trainer.strategy)
        return self._masters.convert(module)

    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        for optimizer in optimizers:
            if self.scaler is not None:
                _check_optimizer(optimizer)
            self._adopt(optimizer)
        first = next(model.parameters(), None)
        if first is not None:
            self.device = first.device.type
        self._masters.follow_devices()
        self._masters.broadcast()
        return model, optimizers, lr_schedulers

    def teardown(self) -> None:
        for handles in self._optimizer_hooks.values():
            for h in handles:
                h.remove()
        self._optimizer_hooks.clear()
        self._drop_pending()  # a run that failed inside a step leaves it half done
        self._loss_finite = None
        self._masters.restore()

    def _adopt(self, optimizer: Optimizer) -> None:
        if optimizer not in self._optimizer_hooks:
            self._optimizer_hooks[optimizer] = self._masters.adopt_optimizer(optimizer)

    # ------------------------------------------------------------------ forward and backward
    def autocast_context_manager(self) -> torch.autocast:
        return torch.autocast(self.device, dtype=self._dtype, cache_enabled=False)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Run the forward under autocast: matmuls in half precision, softmax/losses/norms in fp32."""
        with self.autocast_context_manager():
            yield

    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        self._masters.drop_stepped_grads()  # the last step's fp32 gradients are not needed past this point
        with self.forward_context():
            yield

    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        finite = torch.isfinite(tensor.detach()).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        self._backward_scale = self.loss_scale
        self._drop_pending()  # new gradients arrive: anything unscaled before is stale
        if self.scaler is not None:
            tensor = tensor * self._backward_scale
        return super().pre_backward(tensor, module)

    # ------------------------------------------------------------------ optimizer step
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale ``optimizer``'s gradients into the fp32 masters (at most once per step)."""
        if optimizer in self._pending:
            return
        self._adopt(optimizer)
        self._pending[optimizer] = self._masters.prepare(optimizer, self.backward_scale)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0:
            self.unscale_gradients(optimizer)  # clip true gradients, never scaled ones
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: Union[pl.LightningModule, Module],
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.scaler is None:
            # as Lightning without a scaler: the optimizer runs the closure (LBFGS re-evaluates it)
            return _MasterStep(self, optimizer, closure, partial(self._after_closure, model, optimizer))(**kwargs)
        # as Lightning's MixedPrecision with a scaler: run the closure, unscale, hooks and clipping, then step
        _check_optimizer(optimizer)
        closure_result = closure()
        # a training_step that returned None skipped backward: nothing to step
        skip = closure_result is None and getattr(model, "automatic_optimization", False)
        if not skip:
            self.unscale_gradients(optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step and clipping see unscaled gradients
        if skip:
            return closure_result
        return _MasterStep(self, optimizer, lambda: closure_result)(**kwargs)

    def _after_closure(self, model: Union[pl.LightningModule, Module], optimizer: Optimizer) -> None:
        """Lightning's order, with the masters swapped in between ``on_before_optimizer_step`` (which sees the
        half parameters holding unscaled gradients) and clipping (which acts on the fp32 gradients that get
        stepped, as under ``"16-mixed"``)."""
        trainer = model.trainer
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        prepared = self._pending.get(optimizer)
        if prepared is not None and not prepared.entered:
            # a user's configure_gradient_clipping may walk self.parameters(): show it the fp32 gradients stepped
            show = isinstance(model, pl.LightningModule) and is_overridden("configure_gradient_clipping", model)
            self._masters.enter(optimizer, prepared, show_on_module=show)
        self._clip_gradients(
            model, optimizer, trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
        )

    def _decide(self, optimizer: Optimizer) -> PreparedGrads:
        """Take the step's prepared gradients and decide, with the one host sync, whether to skip the step.

        Raises :class:`_SkippedStep` for a skipped step, :class:`NonFiniteGradientError` when the guard trips.
        """
        prepared = self._pending.pop(optimizer)
        found_inf, loss_finite = self._sync_flags(prepared.found_inf)
        record = StepRecord(step=self._steps, scale=self.backward_scale, skipped=found_inf, loss_finite=loss_finite)
        self._steps += 1
        self.history.append(record)
        self.last_step_skipped = found_inf
        if not found_inf:
            self._masters.sync_edits(prepared)  # clipping hooks may have edited half gradients (torch < 2.13)
            return prepared
        record._names = [self._masters.name_of(p) for p in prepared.all_params()]
        record._mask = prepared.nonfinite_mask()
        if prepared.entered:
            self._masters.exit(optimizer, prepared, stepped=False)
        MasterWeights.release(prepared, clear_grads=True)
        self.skipped_steps += 1
        self._consecutive_skips += 1
        at_floor = self.scaler is not None and not self.scaler.is_static and record.scale <= self.scaler.min_scale
        if self.scaler is not None:
            self.scaler.update(True)
        if at_floor or self._consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteGradientError(self._guard_message(record, at_floor))
        raise _SkippedStep

    def _stepped(self) -> None:
        self._consecutive_skips = 0
        if self.scaler is not None:
            self.scaler.update(False)

    def _sync_flags(self, found_inf: Optional[Tensor]) -> tuple[bool, bool]:
        """The step's one host sync: whether any gradient (on any rank) was non-finite, and whether every loss
        backpropagated since the last step was finite."""
        loss_finite, self._loss_finite = self._loss_finite, None
        if found_inf is None and loss_finite is None:
            return False, True
        device = (found_inf if found_inf is not None else loss_finite).device  # type: ignore[union-attr]
        zero = torch.zeros((), device=device)
        flags = torch.stack(
            [
                zero if found_inf is None else found_inf.float(),
                zero if loss_finite is None else (~loss_finite).float().to(device),
            ]
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank takes the same decision
        inf, loss_bad = flags.tolist()
        return inf > 0, loss_bad == 0

    def _drop_pending(self) -> None:
        for optimizer, prepared in self._pending.items():
            if prepared.entered:
                self._masters.exit(optimizer, prepared, stepped=False)
            MasterWeights.release(prepared, clear_grads=False)
        self._pending.clear()

    def _guard_message(self, record: StepRecord, at_floor: bool) -> str:
        names = record.nonfinite_params
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        recent = list(self.history)[-12:]
        trail = ", ".join(f"{r.scale:g}{'*' if r.skipped else ''}" for r in recent)
        why = (
            f"an overflow happened at the minimum loss scale ({record.scale:g})"
            if at_floor
            else f"{self._consecutive_skips} optimizer steps in a row were skipped"
        )
        return (
            f"MPTPrecision stopped training: {why} because of non-finite gradients.\n"
            f"  step {record.step}: parameters with non-finite gradients: {shown or '(none found)'}\n"
            f"  the loss itself was {'finite' if record.loss_finite else 'NON-FINITE (inf/NaN in the forward pass)'}\n"
            f"  recent loss scales (* = skipped): {trail}\n"
            "  hint: lower the learning rate, clip gradients (Trainer(gradient_clip_val=...)), check the data and the "
            "loss for inf/NaN, or use MPTPrecision('bf16'), whose range does not overflow."
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "master_weights": self.master_weights,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self._consecutive_skips,
            "steps": self._steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scaler_state = state_dict.get("scaler")
        if self.scaler is not None and scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        elif (self.scaler is None) != (scaler_state is None):
            rank_zero_warn(
                f"MPTPrecision: the checkpoint was saved {'with' if scaler_state else 'without'} a loss scaler and this "
                f"plugin has {'none' if self.scaler is None else 'one'}; the scaler state is not restored."
            )
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._consecutive_skips = int(state_dict.get("consecutive_skips", 0))
        self._steps = int(state_dict.get("steps", 0))
        self._backward_scale = self.loss_scale

    def __repr__(self) -> str:
        name = "fp16" if self._dtype == torch.float16 else "bf16"
        return f"MPTPrecision({name!r}, scaler={self.scaler!r}, master_weights={self.master_weights})"


class _SkippedStep(Exception):
    """Raised inside the optimizer's closure to leave ``optimizer.step()`` before it changes anything."""


class _MasterStep:
    """One optimizer step on the masters. The optimizer calls :meth:`closure` first thing in ``step()``; there the
    step is decided and, unless skipped, the optimizer holds the masters for the update that follows."""

    def __init__(
        self,
        plugin: MPTPrecision,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        after: Optional[Callable[[], None]] = None,
    ) -> None:
        self.plugin, self.optimizer, self.user_closure, self.after = plugin, optimizer, closure, after
        self.prepared: Optional[PreparedGrads] = None

    def closure(self) -> Any:
        plugin, masters, optimizer = self.plugin, self.plugin._masters, self.optimizer
        if self.prepared is not None:  # re-evaluation inside the step (LBFGS): the forward must see the masters
            masters.exit(optimizer, self.prepared, stepped=False)
        result = self.user_closure()
        plugin.unscale_gradients(optimizer)
        if self.after is not None:
            self.after()  # hooks, masters in, clipping
        if self.prepared is None:
            self.prepared = plugin._decide(optimizer)
        else:
            self.prepared = plugin._pending.pop(optimizer)
        if not self.prepared.entered:
            masters.enter(optimizer, self.prepared, show_on_module=False)
        return result

    def __call__(self, **kwargs: Any) -> Any:
        stepped = False
        try:
            output = self.optimizer.step(closure=self.closure, **kwargs)
            stepped = True
        except _SkippedStep:
            return None
        finally:
            if self.prepared is not None and self.prepared.entered:
                self.plugin._masters.exit(self.optimizer, self.prepared, stepped=stepped)
        if self.prepared is not None:
            self.plugin._stepped()
        return output


def _check_optimizer(optimizer: Optimizer) -> None:
    if isinstance(optimizer, LBFGS):
        raise MisconfigurationException(
            "MPTPrecision with a loss scaler does not support torch.optim.LBFGS: LBFGS re-evaluates the loss inside "
            "step(), where scaled gradients cannot be checked and unscaled (as with Lightning's '16-mixed'). Use "
            "MPTPrecision('bf16') (no scaler), a first-order optimizer (SGD, Adam, AdamW, ...), or '32-true'."
        )


def check_strategy(strategy: Any) -> None:
    """Raise a clear error unless ``strategy`` is one that :class:`MPTPrecision` supports (one device or DDP)."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
    from lightning.pytorch.strategies import SingleDeviceXLAStrategy, XLAStrategy

    supported = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
    if not supported or isinstance(strategy, (DeepSpeedStrategy, XLAStrategy, SingleDeviceXLAStrategy)):
        raise ValueError(
            f"MPTPrecision does not support the {type(strategy).__name__} strategy. Supported: a single device "
            "('auto' on one device) and the DDP family ('ddp', 'ddp_spawn', 'ddp_fork', 'ddp_notebook'). "
            "Sharded strategies (FSDP, DeepSpeed, model parallel) bring their own mixed precision: use "
            "Trainer(precision='16-mixed' or 'bf16-mixed') with them."
        )
