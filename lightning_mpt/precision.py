"""``MPTPrecision``: a Lightning precision plugin with a half-precision model, fp32 master weights owned by the
optimizer, and a configurable dynamic loss scaler.

Lightning's hooks only: each delegates to the torch-only engine,
:class:`~lightning_mpt.core.engine.MixedPrecisionEngine` (docs/architecture.md traces one step).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from contextlib import contextmanager
from functools import partial
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

from lightning_mpt import _averaging, _compat, _retries
from lightning_mpt._gradscaler import find_gradscaler_state
from lightning_mpt._plugin import MixedPrecisionPlugin, lbfgs_unsupported, supported_strategies, unwrap
from lightning_mpt._pretrained import SavedAsMasters
from lightning_mpt.core.config import MasterOptions, SkipPolicy
from lightning_mpt.core.masters import DEFAULT_KEEP_FP32, is_fully_sharded
from lightning_mpt.core.masters.chunked import ChunkedGrads
from lightning_mpt.core.masters.copies import CopyMasters
from lightning_mpt.core.scaler import DynamicLossScaler
from lightning_mpt.core.steps import NonFiniteGradientError, StepRecord

__all__ = ["MPTPrecision", "NonFiniteGradientError", "StepRecord", "check_strategy"]


# Lightning types ``main_params`` as an iterator of Parameters; ours returns the fp32 masters (plain tensors), in a list
class MPTPrecision(MixedPrecisionPlugin, Precision):  # type: ignore[misc]
    """Mixed precision with a half-precision model, fp32 master weights and dynamic loss scaling.

    The model's parameters live in fp16/bf16 (norm layers stay fp32) and the forward runs under autocast. The
    optimizer steps fp32 masters taken from the weights before they were cast; its state is fp32. The loss is
    scaled before backward; at each optimizer step the half gradients are copied into fp32, unscaled with fused
    kernels, and the step is decided (one host sync) before the optimizer runs: a step with a non-finite gradient is
    skipped and changes nothing.

    Args:
        precision: ``"fp16"`` or ``"bf16"``.
        scaler: ``None`` for the default (a :class:`DynamicLossScaler` for fp16, no scaling for bf16), a
            :class:`DynamicLossScaler`, or a number for a static scale.
        master_weights: keep fp32 masters. ``False`` steps the half weights directly (same scaler), the
            configuration that shows what master weights buy.
        keep_fp32: module types whose parameters and buffers stay fp32, a class or a tuple of classes. The norm
            layers and ``ParametrizationList`` (the parametrized tensors) stay fp32 by default; types of your own are
            kept in addition to them. A tuple that names a default type is the whole list (``()``: none).
        max_consecutive_skips: raise :class:`NonFiniteGradientError` after this many skipped steps in a row of one
            optimizer.
        accumulate_fp32: with gradient accumulation, sum the micro-batches' gradients in fp32 rather than in the half
            format (Megatron's ``main_grad``), for long accumulations where half-precision sums lose small
            contributions. Costs 2 bytes per parameter more during the backward. Needs torch >= 2.13.
        chunked_step: step the masters a chunk of parameters at a time, so the step holds one chunk of fp32
            gradients instead of all: ``True`` for chunks of about a sixteenth of the model (between ``2**18`` and
            ``2**24`` elements), a number of elements, or ``False`` for the whole step. Default (``None``): chunks
            for bf16, the whole step for fp16 (hooks and clipping then see unscaled fp32 gradients; with chunks the
            half gradients, in fp16 still scaled: docs/memory.md). Exact (the masters of a whole step) for torch's
            built-in optimizers; others take the whole step.
        master_remainders: store each bf16 parameter's fp32 master as its 16 low bits beside the weight between
            steps (2 bytes instead of 4), rebuilt exactly for the step, a chunk at a time with ``chunked_step``.
            Default (``None``): on for bf16 with chunks (14 bytes per parameter at the step with AdamW). bf16 only;
            the half weights round ties away from zero instead of to even (``False`` gives torch's rounding back).
        overflow_retries: in automatic optimization, run a batch whose gradients overflowed again at the backed-off
            scale, up to this many times, instead of skipping its step (fairseq's ``amp_batch_retries``). Each
            retry runs ``training_step`` and the backward again, with their side effects (docs/scaler.md). ``0``
            (the default): skip the step. Needs a dynamic scale and ``accumulate_grad_batches=1``.
        skipped_steps_advance_schedulers: ``True`` (Lightning's behaviour): a step skipped for non-finite gradients
            counts for the LR schedulers. ``False`` (Megatron-LM's and DeepSpeed's): a scheduler's ``step()`` does
            nothing when every step of its optimizer since its last ``step()`` was skipped, so that warm-up and decay
            follow the updates actually applied (docs/scaler.md).
        skips: the skip options in one object, :class:`~lightning_mpt.SkipPolicy` (``max_consecutive``, ``retries``,
            ``advance_schedulers``), instead of ``max_consecutive_skips``, ``overflow_retries`` and
            ``skipped_steps_advance_schedulers``.
        fp8: run eligible ``Linear`` layers' matmuls in fp8 with torchao's float8 training (``bf16`` only; needs
            ``pip install lightning-mpt[fp8]``): ``True`` (torchao's default, tensorwise scaling), a recipe name
            (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``), a ``torchao.float8.Float8LinearConfig``, or
            the fp8 options in one :class:`~lightning_mpt.Fp8Options` (``recipe``, ``filter``, ``emulate``) instead of
            ``fp8_filter`` and ``fp8_emulate``. Layers whose dimensions are not multiples of 16 stay bf16. See
            docs/fp8.md.
        fp8_filter: ``fn(module, fqn) -> bool``: convert only the eligible layers it accepts (e.g. keep a layer that
            saturates in bf16: ``lambda module, fqn: fqn != "head"``).
        masters: the options of the masters in one object, :class:`~lightning_mpt.MasterOptions` (``enabled``,
            ``remainders``, ``chunk``, ``accumulate_fp32``), instead of ``master_weights``, ``master_remainders``,
            ``chunked_step`` and ``accumulate_fp32``.
        fp8_emulate: emulate the fp8 matmuls (CPU, GPUs without fp8 Tensor Cores): slow, for tests and debugging.
            Without it such a device is an error, never a silent emulation.

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
        keep_fp32: Union[type[Module], tuple[type[Module], ...]] = DEFAULT_KEEP_FP32,
        max_consecutive_skips: int = 50,
        accumulate_fp32: bool = False,
        chunked_step: Union[bool, int, None] = None,
        master_remainders: Optional[bool] = None,
        masters: Optional[MasterOptions] = None,
        overflow_retries: int = 0,
        skipped_steps_advance_schedulers: bool = True,
        skips: Optional[SkipPolicy] = None,
        fp8: Any = None,
        fp8_filter: Optional[Callable[[Module, str], bool]] = None,
        fp8_emulate: bool = False,
    ) -> None:
        self._init_plugin(
            precision,
            scaler,
            master_weights,
            keep_fp32,
            max_consecutive_skips,
            accumulate_fp32,
            skipped_steps_advance_schedulers,
            fp8,
            fp8_filter,
            fp8_emulate,
            chunked_step,
            master_remainders,
            masters,
            overflow_retries,
            skips,
        )
        self._copy_masters = self._engine.masters  # one device and DDP; FSDP2 has its own shards (convert_module)
        self._automatic = True  # the module's automatic_optimization, read at connect()
        self._averaging: list[_averaging.Adapted] = []  # weight-averaging callbacks pointed at the masters
        self._pretrained = SavedAsMasters(self._dtype)  # Hugging Face models' save_pretrained says fp32 in training

    _access = "trainer.precision_plugin"

    # ------------------------------------------------------------------ model set-up and teardown
    def convert_module(self, module: Module) -> Module:
        trainer = _compat.attached_trainer(module)
        strategy = trainer.strategy if trainer is not None else None
        if strategy is not None:
            check_strategy(strategy)
        sharded = _sharded(module, strategy)
        if sharded:
            self._engine.masters = self._sharded_masters("trainer")
        else:
            self._engine.masters, self.options = self._copy_masters, self._given.resolved(self._dtype)
        # Float8Linear keeps the Linear's parameters: they get masters next (under FSDP2 it is converted before
        # fully_shard, in configure_model, and only checked here)
        module = self._convert_fp8(module, sharded)
        # Lightning loads a checkpoint's weights before it converts the module (strategies that restore after set-up
        # load them into the converted module, where the load hook sees them)
        module = self._engine.convert(module, restored=trainer is not None and trainer.ckpt_path is not None)
        if self.master_weights:
            self._pretrained.watch(module)
        return module

    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        for optimizer in optimizers:
            if self.scaler is not None:
                _check_optimizer(optimizer)
            self._engine.adopt(optimizer)
        if not self.skipped_steps_advance_schedulers:  # Lightning's scheduler configs, or schedulers
            self._gate_schedulers([getattr(config, "scheduler", config) for config in lr_schedulers])
        first = next(model.parameters(), None)
        if first is not None:
            self.device = first.device.type
            self._check_fp8_device(first.device)
        lightning_module = getattr(model, "module", model)  # DDP wraps it
        self._automatic = getattr(lightning_module, "automatic_optimization", True)
        self._engine.zero_grad_drops = self._automatic and _zero_grad_drops(lightning_module, optimizers)
        masters = self._engine.masters
        if isinstance(masters, CopyMasters):  # FSDP2's shards are on their devices, and not replicas
            masters.follow_devices()
            masters.broadcast()
        trainer = _compat.attached_trainer(lightning_module)
        if trainer is not None and self.master_weights:
            self._averaging = _averaging.adapt(trainer.callbacks, masters)
        if self.overflow_retries and trainer is not None and trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                f"MPTPrecision(overflow_retries={self.overflow_retries}) runs the batch of an overflowing step again, "
                f"but with accumulate_grad_batches={trainer.accumulate_grad_batches} the step's gradients come from "
                "several batches. Use overflow_retries=0 with gradient accumulation."
            )
        return model, optimizers, lr_schedulers

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a run of Lightning's "16-mixed" resumed: no state of this plugin, its GradScaler's scale is taken over
        if type(self).__qualname__ not in checkpoint:
            saved = find_gradscaler_state(checkpoint)
            if saved is not None:
                self.load_state_dict(saved)

    def teardown(self) -> None:
        for adapted in self._averaging:
            adapted.release()
        self._averaging.clear()
        self._pretrained.close()
        self._engine.restore()

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
        # the last step's fp32 gradients are not needed past this point
        self._engine.release_gradients(drop=self._engine.zero_grad_drops)
        with self.forward_context():
            yield

    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        trainer = _compat.attached_trainer(module)
        wrapper = trainer.strategy.model if trainer is not None else None
        sync = getattr(wrapper, "require_backward_grad_sync", True)  # False inside DDP's no_sync (accumulating)
        return super().pre_backward(self._engine.scale_loss(tensor, sync=sync), module)

    # ------------------------------------------------------------------ optimizer step
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale ``optimizer``'s gradients into the fp32 masters and decide its step (once per step).

        Lightning calls it before clipping; it is public so that manual optimization can inspect true gradients
        before ``opt.step()``. ``optimizer`` may be Lightning's ``LightningOptimizer`` wrapper.
        """
        self._engine.decide(unwrap(optimizer))

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        optimizer = unwrap(optimizer)
        if clip_val > 0:
            self._engine.decide(optimizer)  # clip true gradients, never scaled ones
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        grads = self._engine.decide(unwrap(optimizer)).grads
        if isinstance(grads, ChunkedGrads):  # the masters get their gradients chunk by chunk, clipped then
            grads.clip_by_norm(float(clip_val))
        else:
            super().clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        grads = self._engine.decide(unwrap(optimizer)).grads
        if isinstance(grads, ChunkedGrads):
            grads.clip_by_value(float(clip_val))
        else:
            super().clip_grad_by_value(optimizer, clip_val)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: Union[pl.LightningModule, Module],
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        optimizer = unwrap(optimizer)
        automatic = getattr(model, "automatic_optimization", False)
        after = partial(_compat.after_closure, self, model, optimizer)  # on_before_optimizer_step, then clipping
        chunked = isinstance(self._engine.masters, CopyMasters) and self._engine.masters.in_chunks(optimizer)
        if self.scaler is None and (automatic or isinstance(optimizer, LBFGS)) and not chunked:
            # as Lightning without a scaler: the optimizer runs the closure (LBFGS re-evaluates it)
            return self._engine.step_in_closure(optimizer, closure, after, **kwargs)
        # as Lightning's MixedPrecision with a scaler: run the closure, decide, hooks and clipping, then step or skip
        if self.scaler is not None:
            _check_optimizer(optimizer)
        retries = self.overflow_retries if automatic else 0
        before = _retries.TryState(model) if retries else None  # what a discarded try logs is taken back
        closure_result = closure()
        # training_step returned None, or an overridden optimizer_step ran the closure itself and steps without one:
        # with a scaler Lightning's MixedPrecision takes no step then; without one (bf16's chunks) "bf16-mixed" lets
        # the optimizer step whatever gradients there are
        if closure_result is None and automatic and self.scaler is not None:
            after()
            return None
        pending = self._engine.decide(optimizer)
        # a lower scale can help a finite loss only
        while before is not None and pending.skipped and pending.loss_finite and retries > 0:
            retries -= 1
            self._engine.give_up(optimizer, pending)  # the scale backs off
            before.restore()  # the epoch's logged values and the module's metrics count the batch once
            closure_result = closure()  # zero_grad, training_step and backward again, on the same batch
            if closure_result is None:
                after()
                return None
            pending = self._engine.decide(optimizer)
        after()  # the hooks and clipping see unscaled gradients
        return self._engine.step(optimizer, pending, lambda: closure_result, **kwargs)


def _zero_grad_drops(module: Module, optimizers: list[Optimizer]) -> bool:
    """Whether Lightning's automatic optimization will set the gradients to ``None`` before each backward: the
    LightningModule keeps Lightning's ``optimizer_zero_grad`` and every optimizer's ``zero_grad`` has torch's default
    ``set_to_none=True``, on their classes and not replaced on the objects. Only then may the plugin drop a step's
    gradients early: under ``set_to_none=False`` a parameter unused in the next step keeps a zero gradient, which
    momentum and weight decay act on."""
    if getattr(type(module), "optimizer_zero_grad", None) is not pl.LightningModule.optimizer_zero_grad:
        return False
    if "optimizer_zero_grad" in vars(module):
        return False
    for optimizer in optimizers:
        if "zero_grad" in vars(optimizer) or "zero_grad" in vars(unwrap(optimizer)):
            return False
        try:
            default = inspect.signature(type(unwrap(optimizer)).zero_grad).parameters["set_to_none"].default
        except (KeyError, TypeError, ValueError):  # a zero_grad of its own, without torch's argument
            return False
        if default is not True:
            return False
    return True


def _check_optimizer(optimizer: Optimizer) -> None:
    if isinstance(optimizer, LBFGS):
        raise MisconfigurationException(lbfgs_unsupported("trainer"))


def check_strategy(strategy: Any) -> None:
    """Raise a clear error unless ``strategy`` is one that :class:`MPTPrecision` supports: one device, DDP, or
    ``ModelParallelStrategy`` with FSDP2 (``fully_shard``)."""
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
        SingleDeviceXLAStrategy,
        XLAStrategy,
    )

    supported = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy))
    if not supported or isinstance(strategy, (DeepSpeedStrategy, XLAStrategy, SingleDeviceXLAStrategy)):
        raise ValueError(
            f"MPTPrecision does not support the {type(strategy).__name__} strategy. {supported_strategies('trainer')}"
        )


def _sharded(module: Module, strategy: Any) -> bool:
    """Whether FSDP2 shards ``module``: under ``ModelParallelStrategy``, or sharded with ``fully_shard`` by hand."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy) or is_fully_sharded(module)
