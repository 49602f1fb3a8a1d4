"""The Fabric plugin: :class:`MPTPrecision` (see :mod:`lightning_mpt.fabric` for what each Fabric call does)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

from lightning_mpt._plugin import lbfgs_unsupported
from lightning_mpt.core.config import MasterOptions, SkipPolicy
from lightning_mpt.core.masters import DEFAULT_KEEP_FP32
from lightning_mpt.core.masters.chunked import ChunkedGrads, ChunkedStep
from lightning_mpt.core.masters.copies import CopyMasters
from lightning_mpt.core.scaler import DynamicLossScaler
from lightning_mpt.fabric._setup import ModuleHooks, ModuleSetUp

__all__ = ["MPTPrecision"]


class MPTPrecision(ModuleHooks, Precision):
    """Fabric precision plugin: half-precision model, fp32 master weights, dynamic loss scaling, skipped overflows.

    The same step as the Trainer plugin (:class:`lightning_mpt.MPTPrecision`); :mod:`lightning_mpt.fabric` says what
    each Fabric call does. One module per plugin (put several models in one ``nn.Module``). Strategies: one device,
    DDP, and FSDP2 (``ModelParallelStrategy``) with ``sharded=True``.

    Args:
        precision: ``"fp16"`` or ``"bf16"``.
        scaler: ``None`` for the default (a :class:`~lightning_mpt.DynamicLossScaler` for fp16, no scaling for bf16),
            a :class:`~lightning_mpt.DynamicLossScaler`, or a number for a static scale.
        master_weights: keep fp32 masters. ``False`` steps the half weights directly (same scaler).
        keep_fp32: module types whose parameters and buffers stay fp32, a class or a tuple of classes. The norm
            layers and ``ParametrizationList`` (the parametrized tensors) stay fp32 by default; types of your own are
            kept in addition to them. A tuple that names a default type is the whole list (``()``: none).
        max_consecutive_skips: raise :class:`~lightning_mpt.NonFiniteGradientError` after this many skipped steps in
            a row of one optimizer.
        accumulate_fp32: with gradient accumulation, sum the micro-batches' gradients in fp32 rather than in the half
            format (torch >= 2.13; see the Trainer plugin). Under DDP pass the model to each backward,
            ``fabric.backward(loss, model=model)``, so that the plugin sees which backward synchronises.
        skipped_steps_advance_schedulers: ``True`` (Lightning's behaviour): a skipped step counts for the LR
            schedulers. ``False`` (Megatron-LM's and DeepSpeed's): the ``step()`` of a scheduler handed to
            :meth:`setup_schedulers` does nothing when every step of its optimizer since its last ``step()`` was
            skipped.
        sharded: the model is sharded with FSDP2 after ``fabric.setup_module`` (Fabric's ``ModelParallelStrategy``,
            whose ``parallelize_fn`` calls ``fully_shard(..., mp_policy=plugin.mp_policy)``): set-up leaves it fp32,
            so that FSDP2's fp32 shards are the masters, with no copy. Fabric converts a model before the strategy
            shards it, so the plugin cannot tell by itself.
        fp8: run eligible ``Linear`` layers' matmuls in fp8 with torchao (``bf16`` only): ``True``, a recipe name
            (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``), a ``torchao.float8.Float8LinearConfig`` or
            an :class:`~lightning_mpt.Fp8Options`; see the Trainer plugin and docs/fp8.md. Not with ``sharded=True``.
        fp8_filter: ``fn(module, fqn) -> bool``: convert only the eligible layers it accepts.
        fp8_emulate: emulate the fp8 matmuls (CPU, GPUs without fp8 Tensor Cores), never done silently.
        chunked_step: step the masters a chunk of parameters at a time (see the Trainer plugin and docs/memory.md;
            by default for bf16). Clip with :meth:`clip_gradients`: ``fabric.clip_gradients`` clips fp32 gradients a
            chunked step never holds all at once (it takes a default step whole; one asked for, it refuses).
        master_remainders: store bf16 masters as their 16 low bits between steps (see the Trainer plugin; by default
            for bf16 with chunks).
        masters: the options of the masters in one :class:`~lightning_mpt.MasterOptions` (see the Trainer plugin).
        skips: ``max_consecutive_skips`` and ``skipped_steps_advance_schedulers`` in one
            :class:`~lightning_mpt.SkipPolicy` (its ``retries`` must stay 0: retries are the Trainer's).

    Example:
        ```python
        import lightning as L
        from lightning_mpt import DynamicLossScaler
        from lightning_mpt.fabric import MPTPrecision

        plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(growth_interval=1000))
        fabric = L.Fabric(accelerator="cpu", plugins=[plugin])
        assert fabric.strategy.precision.loss_scale == 2.0**16
        ```
    """

    _access = "fabric.strategy.precision"

    def __init__(
        self,
        precision: Literal["fp16", "bf16"] = "fp16",
        *,
        scaler: Union[DynamicLossScaler, float, None] = None,
        master_weights: bool = True,
        keep_fp32: Union[type[Module], tuple[type[Module], ...]] = DEFAULT_KEEP_FP32,
        max_consecutive_skips: int = 50,
        accumulate_fp32: bool = False,
        skipped_steps_advance_schedulers: bool = True,
        sharded: bool = False,
        fp8: Any = None,
        fp8_filter: Optional[Callable[[Module, str], bool]] = None,
        fp8_emulate: bool = False,
        chunked_step: Union[bool, int, None] = None,
        master_remainders: Optional[bool] = None,
        masters: Optional[MasterOptions] = None,
        skips: Optional[SkipPolicy] = None,
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
            0,
            skips,
        )
        if self.overflow_retries:
            raise ValueError(
                f"MPTPrecision(skips=SkipPolicy(retries={self.overflow_retries})) under Fabric: a retry runs the "
                "Trainer's training_step again on the same batch, and Fabric's loop is your own. Leave retries at 0 "
                "(the step is skipped; precision.last_step_skipped says so, and your loop may run the batch again)."
            )
        if not isinstance(sharded, bool):
            raise TypeError(f"MPTPrecision(sharded={sharded!r}): expected a bool (True or False).")
        if sharded:
            self._check_under_fsdp2("sharded=True, ")
        self.sharded = sharded
        self._said_whole = False  # the note that fabric.clip_gradients takes a whole step
        # the converted module and its set-up, which Fabric lets the plugin finish only at the first forward, backward
        # or step (fabric/_setup.py)
        self._setup = ModuleSetUp(self._engine, self._dtype, sharded, self._found_device)

    # ------------------------------------------------------------------ forward and backward
    def forward_context(self) -> Any:
        """Autocast to the half format (matmuls in half, softmax/losses/norms in fp32), for ``model(x)`` and
        ``fabric.autocast()``."""
        return self._forward_context()

    @contextmanager
    def _forward_context(self) -> Generator[None, None, None]:
        self._setup.ensure_ready()
        self._engine.release_gradients(drop=False)  # the last step's fp32 gradients are not needed past this point
        with self._setup.unmarked.inside(), torch.autocast(self.device, dtype=self._dtype, cache_enabled=False):
            yield

    def convert_output(self, data: Any) -> Any:
        """Floating outputs of the model come back in the default dtype (fp32), so that a loss computed outside the
        model is not computed in half precision."""
        dtype = torch.get_default_dtype()
        return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        """Backpropagate ``tensor`` multiplied by the loss scale (``fabric.backward(loss)``)."""
        sync = self._setup.before_backward(model, self.accumulate_fp32)
        self._engine.scale_loss(tensor, sync=sync).backward(*args, **kwargs)

    # ------------------------------------------------------------------ the optimizer step
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale ``optimizer``'s gradients into fp32 and decide its step (once per step; ``fabric.clip_gradients``
        calls it before clipping).

        On a step decided skipped (a non-finite gradient on some process) the fp32 gradients are zeroed here
        already: clipping by norm then returns 0 instead of raising on the non-finite one, clipping by value has
        nothing to do, and the step is skipped (which drops them). :attr:`last_step` tells afterwards, with the names
        of the parameters at fault.
        """
        optimizer = self._setup.adopt(optimizer)
        masters = self._engine.masters
        stepper = masters.stepper if isinstance(masters, CopyMasters) else None
        if self._given.chunk is None and isinstance(stepper, ChunkedStep) and not self._engine.decided(optimizer):
            # the chunks are the format's default, not asked for: this step is whole, its fp32 gradients on the masters
            stepper.whole_next.add(optimizer)
            self._say_whole_for_clipping()
        pending = self._engine.decide(optimizer)
        if isinstance(pending.grads, ChunkedGrads):
            raise ValueError(
                "fabric.clip_gradients clips the masters' fp32 gradients, and with MPTPrecision(chunked_step=...) the "
                "step never holds them all at once. Clip with `fabric.strategy.precision.clip_gradients(optimizer, "
                "max_norm=...)` (or `clip_val=...`): the same global norm, applied to each chunk at the step."
            )
        if pending.skipped:
            with torch.no_grad():  # a skipped step is rare: no need for a fused kernel
                for grad in pending.grads.fp32_grads():
                    grad.zero_()

    def _say_whole_for_clipping(self) -> None:
        """Say once that ``fabric.clip_gradients`` takes the whole step, and what keeps the chunks."""
        if not self._said_whole:
            self._said_whole = True
            rank_zero_info(
                "MPTPrecision: fabric.clip_gradients clips the fp32 gradients of every master, so a step it clips is "
                "taken whole instead of a chunk at a time (the bf16 default): every fp32 gradient and master at once, "
                "up to 6 bytes per parameter more at the step's peak. `fabric.strategy.precision.clip_gradients("
                "optimizer, max_norm=...)` clips by the same global norm and keeps the chunks (docs/memory.md)."
            )

    def clip_gradients(
        self, optimizer: Any, max_norm: Optional[float] = None, clip_val: Optional[float] = None
    ) -> Optional[Tensor]:
        """Clip ``optimizer``'s true gradients by their global 2-norm (``max_norm``) or by value (``clip_val``) before
        its step, as ``fabric.clip_gradients`` does, also with ``chunked_step``; returns the total norm.

        Example:
            ```python
            import lightning as L

            mpt = MPTPrecision("bf16", chunked_step=True)
            fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mpt])
            model = fabric.setup(torch.nn.Linear(4, 4))
            optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
            fabric.backward(model(torch.randn(2, 4)).float().sum())
            total_norm = mpt.clip_gradients(optimizer, max_norm=1.0)  # before optimizer.step()
            ```
        """
        if (max_norm is None) == (clip_val is None):
            raise ValueError("MPTPrecision.clip_gradients: give exactly one of max_norm and clip_val.")
        optimizer = self._setup.adopt(optimizer)
        grads = self._engine.decide(optimizer).grads
        if not isinstance(grads, ChunkedGrads):
            self.unscale_gradients(optimizer)
            params = self.main_params(optimizer)
            if max_norm is not None:
                return torch.nn.utils.clip_grad_norm_(params, max_norm)
            torch.nn.utils.clip_grad_value_(params, clip_val)  # type: ignore[arg-type]
            return None
        if max_norm is not None:
            return grads.clip_by_norm(float(max_norm))
        grads.clip_by_value(float(clip_val))  # type: ignore[arg-type]
        return None

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step the masters with ``optimizer``, or skip the step when a gradient was non-finite on any process.

        A ``closure`` (``optimizer.step(closure)``) is run first and its gradients decided, so an optimizer that
        ignores it still steps the right gradients; LBFGS, which re-evaluates it, works without a scaler (bf16).
        """
        optimizer = self._setup.adopt(optimizer)
        closure: Optional[Callable[[], Any]] = kwargs.pop("closure", None)
        if closure is None:
            return self._engine.step(optimizer, self._engine.decide(optimizer), **kwargs)
        if isinstance(optimizer, LBFGS):
            if self.scaler is not None:
                raise ValueError(lbfgs_unsupported("fabric"))
            return self._engine.step_in_closure(optimizer, closure, lambda: None, **kwargs)
        result = closure()
        return self._engine.step(optimizer, self._engine.decide(optimizer), lambda: result, **kwargs)

    def main_params(self, optimizer: Optimizer) -> list[Tensor]:  # type: ignore[override]
        """The fp32 tensors that ``optimizer`` steps (what ``fabric.clip_gradients`` clips): masters of half
        parameters, fp32 parameters themselves."""
        self._setup.ensure_ready()
        return super().main_params(optimizer)

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (``fabric.load`` calls it for the plugin's entry in the state; Fabric saves no
        precision state of its own, so put the plugin in ``fabric.save``'s state)."""
        self._setup.loads.scan()  # the optimizer's entry may come next
        super().load_state_dict(state_dict)

    # ------------------------------------------------------------------ internals
    def _found_device(self, device: torch.device) -> None:
        """The set-up completed with the module's parameters on ``device``: autocast for its type."""
        self.device = device.type
        self._check_fp8_device(device)
