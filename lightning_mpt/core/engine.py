"""The mixed-precision optimizer step, framework-free: fp32 masters, loss scaling, the skip decision and the guard.

:class:`MixedPrecisionEngine` is what a precision plugin delegates to, whatever runs the loop (Lightning's Trainer,
Lightning Fabric, a plain torch loop). Per optimizer step:

1. :meth:`~MixedPrecisionEngine.scale_loss` before backward;
2. :meth:`~MixedPrecisionEngine.decide`: the gradients are copied into fp32 and unscaled (fused kernels), weights
   edited in place since the last step are adopted by their masters, and the step is decided in one host sync,
   all-reduced across processes, before the optimizer runs;
3. the framework runs its hooks and clipping (they see the unscaled gradients);
4. :meth:`~MixedPrecisionEngine.finish` steps the masters with the optimizer, or skips: a skipped step does not call
   the optimizer at all, so nothing changes, whatever the optimizer does with its closure.

Optimizers that re-evaluate their closure (LBFGS) use :meth:`~MixedPrecisionEngine.step_in_closure` instead.

Example:
    ```python
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    engine = MixedPrecisionEngine(torch.bfloat16)
    engine.convert(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        engine.scale_loss(loss).backward()
        engine.finish(optimizer, engine.decide(optimizer))
        optimizer.zero_grad()
    engine.restore()   # the model is fp32 again, holding the masters
    assert model[0].weight.dtype == torch.float32 and engine.policy.steps == 3
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mpt import _compat
from lightning_mpt.core.masters.copies import DEFAULT_KEEP_FP32, MasterWeights, PreparedGrads, distributed
from lightning_mpt.core.policy import StepPolicy
from lightning_mpt.core.scaler import DynamicLossScaler


@dataclass
class PendingStep:
    """An optimizer step whose gradients are unscaled and whose fate is decided, not yet carried out."""

    optimizer: int  # the optimizer's index
    prepared: PreparedGrads
    skipped: bool
    loss_finite: bool
    scale: float
    culprits: Optional[Tensor] = None  # on a skip: per-parameter non-finite flags, taken before any clipping


class Masters(Protocol):
    """What the engine (and a plugin) asks of the fp32 masters of a half-precision model. Two implementations:
    :class:`~lightning_mpt.core.masters.copies.MasterWeights`, an fp32 copy of each half parameter (one device, DDP),
    and :class:`~lightning_mpt.core.masters.sharded.ShardedMasters`, FSDP2's own sharded fp32 parameters (no copy)."""

    def convert(self, module: nn.Module, restored: bool = False) -> nn.Module: ...
    def restore(self) -> None: ...
    def adopt_optimizer(self, optimizer: Optimizer) -> list[Any]: ...
    def prepare(self, optimizer: Optimizer, scale: float, check_edits: bool = True) -> PreparedGrads: ...
    def adopt_edits(self, prepared: PreparedGrads, flags: list[float]) -> list[str]: ...
    def enter(self, optimizer: Optimizer, prepared: PreparedGrads) -> None: ...
    def exit(self, optimizer: Optimizer, prepared: PreparedGrads, stepped: bool) -> None: ...
    def discard(self, prepared: PreparedGrads) -> None: ...
    def release_stepped(self, drop_module_grads: bool) -> None: ...
    def rescale(self, prepared: PreparedGrads, scale: float) -> None: ...
    def accumulate_in_fp32(self, sync: bool) -> None: ...
    def name_of(self, param: Tensor) -> str: ...
    def master_of(self, param: Tensor) -> Tensor: ...
    def main_params(self, params: Iterable[Tensor]) -> list[Tensor]: ...
    def named_masters(self) -> Iterator[tuple[str, Tensor, Tensor]]: ...
    def follow_devices(self) -> None: ...
    def broadcast(self, src: int = 0) -> None: ...
    def refresh(self) -> None: ...


class _SkippedStep(Exception):
    """Raised inside the optimizer's closure to leave ``optimizer.step()`` before it changes anything."""


class MixedPrecisionEngine:
    """FP32 master weights, a loss scale and the skip policy for a half-precision model.

    Args:
        dtype: the half-precision format, ``torch.float16`` or ``torch.bfloat16``.
        scaler: the loss scaler, ``None`` for no scaling.
        master_weights: keep fp32 masters (``False`` steps the half weights directly).
        keep_fp32: module types whose parameters stay fp32.
        max_consecutive_skips: the guard's limit of skipped steps in a row of one optimizer.
        accumulate_fp32: sum the gradients of micro-batches in fp32 (torch >= 2.13); see :meth:`scale_loss`.
        on_edits: called with the names of parameters whose half weights were edited in place outside the step
            (the edits are adopted by the masters either way).
        masters: the masters implementation; ``None`` for :class:`MasterWeights` with the arguments above. A plugin
            may also assign :attr:`masters` before :meth:`convert` (the FSDP2 path does, once it sees the module).
    """

    def __init__(
        self,
        dtype: torch.dtype,
        scaler: Optional[DynamicLossScaler] = None,
        master_weights: bool = True,
        keep_fp32: tuple[type[nn.Module], ...] = DEFAULT_KEEP_FP32,
        max_consecutive_skips: int = 50,
        accumulate_fp32: bool = False,
        on_edits: Optional[Callable[[list[str]], None]] = None,
        masters: Optional[Masters] = None,
    ) -> None:
        if masters is None:
            masters = MasterWeights(dtype, keep_fp32, enabled=master_weights)
        self.masters: Masters = masters
        self.accumulate_fp32 = accumulate_fp32
        self.policy = StepPolicy(scaler, max_consecutive_skips)
        self.on_edits = on_edits
        self._pending: dict[Optimizer, PendingStep] = {}
        # per optimizer, the gradients of its latest step taken with no backward since: true values, not scaled
        self._taken: dict[Optimizer, PreparedGrads] = {}
        self._optimizers: dict[Optimizer, list[Any]] = {}  # adopted optimizers, in order -> their hook handles

    # ------------------------------------------------------------------ set-up and teardown
    def convert(self, module: nn.Module, restored: bool = False) -> nn.Module:
        """Cast ``module`` to the half format in place; its fp32 tensors become the masters (``restored``: see
        :meth:`MasterWeights.convert`)."""
        return self.masters.convert(module, restored)

    def adopt(self, optimizer: Optimizer) -> int:
        """The index of ``optimizer`` (its position among the optimizers seen), adopting it on first sight."""
        if optimizer not in self._optimizers:
            self._optimizers[optimizer] = self.masters.adopt_optimizer(optimizer)
        return list(self._optimizers).index(optimizer)

    def restore(self) -> None:
        """End of a stage: drop optimizer hooks and anything half done, give the module its fp32 masters back."""
        for handles in self._optimizers.values():
            for h in handles:
                h.remove()
        self._optimizers.clear()
        self.drop_pending()
        self._taken.clear()
        self.masters.restore()

    # ------------------------------------------------------------------ backward
    def scale_loss(self, loss: Tensor, sync: bool = True) -> Tensor:
        """The loss to backpropagate: multiplied by the scale. New gradients make a decided step stale: its
        gradients go back to their scaled state, to be accumulated into and decided again at the step.

        With ``accumulate_fp32``, ``sync`` says whether this backward reduces gradients across processes (``False``
        for the micro-batches DDP runs under ``no_sync``): until then the gradients are summed in fp32.
        """
        self.drop_pending(rescale=True)
        self.release_gradients(drop=False)
        if self.accumulate_fp32:
            self.masters.accumulate_in_fp32(sync=sync and distributed())
        return self.policy.scale_loss(loss)

    def release_gradients(self, drop: bool) -> None:
        """Before a forward or a backward: free the fp32 gradients kept since the last step.

        ``drop``: the module's gradients go too (Lightning's automatic optimization zeroes them before the backward
        anyway). Otherwise the gradients a step left (unscaled) are multiplied by the scale in force, in the half
        format, so that the next backward accumulates into them as under "32-true".
        """
        if drop:
            self._taken.clear()
        elif self._taken:
            scale = self.policy.loss_scale
            for prepared in self._taken.values():
                self.masters.rescale(prepared, scale)
            self._taken.clear()
            self.policy.backward_scale = scale
        self.masters.release_stepped(drop_module_grads=drop)

    # ------------------------------------------------------------------ the step
    def decide(self, optimizer: Optimizer) -> PendingStep:
        """Unscale ``optimizer``'s gradients and decide its step: the step's one host sync. Until the step is carried
        out, later calls return the same decision (clipping then stepping costs one sync)."""
        pending = self._pending.get(optimizer)
        if pending is not None:
            return pending
        index = self.adopt(optimizer)
        scale = self.policy.backward_scale
        # stepping again with no backward since: the gradients are the true ones the last step left, as under "32-true"
        repeat = self._taken.pop(optimizer, None) is not None
        prepared = self.masters.prepare(optimizer, 1.0 if repeat else scale)
        skipped, loss_finite, edited = self.policy.sync(prepared.found_inf, prepared.edited)
        names = self.masters.adopt_edits(prepared, edited)
        if names and self.on_edits is not None:
            self.on_edits(names)
        pending = PendingStep(index, prepared, skipped, loss_finite, scale)
        if skipped:
            pending.culprits = prepared.nonfinite_mask()  # now, before hooks or clipping touch the gradients
        self._pending[optimizer] = pending
        return pending

    def finish(
        self, optimizer: Optimizer, pending: PendingStep, closure: Optional[Callable[[], Any]] = None, **kwargs: Any
    ) -> Any:
        """Carry out a decided step: the optimizer steps the masters (``closure`` is handed to it), or, for a skip,
        is not called at all. Returns what ``optimizer.step`` returned (``None`` for a skip)."""
        self._pending.pop(optimizer, None)
        if pending.skipped:
            _compat.mark_optimizer_stepped(optimizer)  # LR schedulers: a skipped step is a step, as with GradScaler
            self._skip(optimizer, pending)
            return None
        self.masters.enter(optimizer, pending.prepared)
        stepped = False
        try:
            output = optimizer.step(closure=closure, **kwargs) if closure is not None else optimizer.step(**kwargs)
            stepped = True
        finally:
            self.masters.exit(optimizer, pending.prepared, stepped=stepped)
        self._stepped(optimizer, pending)
        return output

    def step_in_closure(
        self, optimizer: Optimizer, closure: Callable[[], Any], after: Callable[[], None], **kwargs: Any
    ) -> Any:
        """A step whose closure the optimizer runs (no loss scaler: LBFGS, or Lightning's automatic optimization).

        The optimizer calls the closure first thing in ``step()``: there the gradients are computed, ``after`` runs
        (hooks, clipping), the step is decided, and unless it is skipped the optimizer holds the masters for the
        update that follows. A skip leaves ``step()`` through an exception, before the optimizer changed anything.
        Re-evaluations (LBFGS's line search) see the masters' current values and are not decided again.
        """
        state: dict[str, Optional[PendingStep]] = {"pending": None}

        def wrapped() -> Any:
            pending = state["pending"]
            if pending is not None:  # re-evaluation: the forward must see the masters' current values
                self.masters.exit(optimizer, pending.prepared, stepped=False)
            result = closure()
            if result is None:  # no backward ran (training_step returned None): nothing to step
                after()
                return result
            if pending is None:
                pending = self.decide(optimizer)
            else:
                prepared = self.masters.prepare(optimizer, self.policy.backward_scale, check_edits=False)
                pending = PendingStep(pending.optimizer, prepared, False, True, self.policy.backward_scale)
                self._pending[optimizer] = pending
            state["pending"] = pending
            after()
            self._pending.pop(optimizer, None)
            if pending.skipped:
                self._skip(optimizer, pending)
                raise _SkippedStep
            self.masters.enter(optimizer, pending.prepared)
            return result

        stepped = False
        try:
            output = optimizer.step(closure=wrapped, **kwargs)
            stepped = True
        except _SkippedStep:
            return None
        finally:
            pending = state["pending"]
            if pending is not None and pending.prepared.entered:
                self.masters.exit(optimizer, pending.prepared, stepped=stepped)
        if state["pending"] is not None:
            self._stepped(optimizer, state["pending"])
        return output

    def _stepped(self, optimizer: Optimizer, pending: PendingStep) -> None:
        self._taken[optimizer] = pending.prepared
        self.policy.record(False, pending.loss_finite, pending.optimizer, pending.scale)
        self.policy.stepped(pending.optimizer)

    def _skip(self, optimizer: Optimizer, pending: PendingStep) -> None:
        """Carry out a skipped step: nothing moves, the gradients are dropped, the scale backs off, the guard looks."""
        prepared = pending.prepared
        if prepared.entered:
            self.masters.exit(optimizer, prepared, stepped=False)
        record = self.policy.record(True, pending.loss_finite, pending.optimizer, pending.scale)
        record.blame([self.masters.name_of(p) for p in prepared.all_params()], pending.culprits)
        self.masters.discard(prepared)
        self.policy.check_guard(record)

    def drop_pending(self, rescale: bool = False) -> None:
        """Forget decided steps not carried out (new gradients arrived, or the run failed inside a step);
        ``rescale``: their (unscaled) gradients are scaled again for the next backward."""
        for optimizer, pending in self._pending.items():
            if pending.prepared.entered:
                self.masters.exit(optimizer, pending.prepared, stepped=False)
            if rescale:
                self.masters.rescale(pending.prepared, self.policy.loss_scale)
        self._pending.clear()
