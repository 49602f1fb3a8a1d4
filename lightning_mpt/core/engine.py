"""The mixed-precision optimizer step, framework-free: loss scaling, the skip decision, the step or the skip, and the
guard.

:class:`MixedPrecisionEngine` is what both precision plugins delegate to. One optimizer step:

1. :meth:`~MixedPrecisionEngine.scale_loss` before each backward;
2. :meth:`~MixedPrecisionEngine.decide`: the masters :meth:`~lightning_mpt.core.masters.Masters.prepare` the fp32
   gradients (copied and unscaled by fused kernels, no host sync), then **one host sync** reads whether any gradient
   or loss was non-finite (all-reduced, so every process decides alike) and whether user code edited half weights;
3. the plugin runs its hooks and clipping, which see the unscaled gradients;
4. :meth:`~MixedPrecisionEngine.step` lets the optimizer step the masters, or skips without calling it, so nothing
   changes whatever the optimizer does with its closure. :class:`StepLog` records the outcome, updates the scaler
   and raises :class:`~lightning_mpt.core.steps.NonFiniteGradientError` when the run cannot recover;
5. :meth:`~MixedPrecisionEngine.release_gradients` before the next forward frees what the step kept.

Optimizers that re-evaluate their closure (LBFGS) use :meth:`~MixedPrecisionEngine.step_in_closure` instead.

Example:
    ```python
    from torch import nn
    from lightning_mpt.core.masters.copies import CopyMasters

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    engine = MixedPrecisionEngine(CopyMasters(torch.bfloat16))
    engine.convert(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        engine.scale_loss(loss).backward()
        engine.step(optimizer, engine.decide(optimizer))
        optimizer.zero_grad()
    engine.restore()   # the model is fp32 again, holding the masters
    assert model[0].weight.dtype == torch.float32 and engine.log.steps == 3
    ```
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mpt import _compat
from lightning_mpt.core.masters import Gradients, Masters, distributed
from lightning_mpt.core.numerics import max_abs
from lightning_mpt.core.scaler import DynamicLossScaler
from lightning_mpt.core.steps import StepLog


@dataclass
class PendingStep:
    """An optimizer step whose gradients are unscaled and whose fate is decided, not yet carried out."""

    optimizer: int  # the optimizer's index
    grads: Gradients
    skipped: bool
    loss_finite: bool
    scale: float  # the loss scale the gradients were computed with
    culprits: Optional[Tensor] = None  # on a skip: per-parameter non-finite flags, taken before any clipping


class _SkippedStep(Exception):
    """Raised inside the optimizer's closure to leave ``optimizer.step()`` before it changes anything."""


class MixedPrecisionEngine:
    """The optimizer step of a half-precision model with fp32 masters: scale, decide, step or skip, guard.

    Args:
        masters: the fp32 masters (:class:`~lightning_mpt.core.masters.copies.CopyMasters`, or FSDP2's shards,
            :class:`~lightning_mpt.core.masters.sharded.ShardedMasters`); a plugin may replace :attr:`masters` before
            :meth:`convert`.
        scaler: the loss scaler, ``None`` for no scaling (a non-finite gradient still skips the step).
        max_consecutive_skips: the guard's limit of skipped steps in a row of one optimizer.
        accumulate_fp32: sum the gradients of micro-batches in fp32 (torch >= 2.13); see :meth:`scale_loss`.
        fp32_when_accumulating: sum them in fp32 from the second backward into the same gradients on (the first
            leaves them in the half format, as a step of one backward needs no more); see :meth:`scale_loss`.
        on_edits: called with the names of parameters whose half weights user code edited in place outside the step
            (the masters adopt the edits either way).
    """

    def __init__(
        self,
        masters: Masters,
        scaler: Optional[DynamicLossScaler] = None,
        max_consecutive_skips: int = 50,
        accumulate_fp32: bool = False,
        on_edits: Optional[Callable[[list[str]], None]] = None,
        fp32_when_accumulating: bool = False,
    ) -> None:
        self.masters = masters
        if on_edits is not None:
            self.on_edits = on_edits
        # the loop's zero_grad sets the gradients to None (Lightning's automatic optimization with torch's default):
        # what a step leaves may then be dropped; otherwise it stays a tensor (zeros after a skip), as under "32-true"
        self.zero_grad_drops = False
        self.log = StepLog(scaler, max_consecutive_skips)
        self.accumulate_fp32 = accumulate_fp32
        self.fp32_when_accumulating = fp32_when_accumulating
        self.backward_scale = self.loss_scale  # the scale of the latest backward
        self._loss_finite: Optional[Tensor] = None  # whether every loss since the last decision was finite (device)
        self._pending: dict[Optimizer, PendingStep] = {}
        # per optimizer, the gradients of its latest step taken with no backward since: true values, not scaled
        self._taken: dict[Optimizer, Gradients] = {}
        self._optimizers: dict[Optimizer, list[Any]] = {}  # adopted optimizers, in order -> their hook handles
        self._stepping = False  # inside :meth:`step` or :meth:`step_in_closure`: the optimizer's step is the engine's

    @property
    def on_edits(self) -> Optional[Callable[[list[str]], None]]:
        """Called with the names of parameters whose in-place edits the masters adopted, wherever they were found: at
        a decision, before a checkpoint or a weight average, when the module is restored (the masters' own)."""
        return self.masters.on_edits

    @on_edits.setter
    def on_edits(self, report: Optional[Callable[[list[str]], None]]) -> None:
        self.masters.on_edits = report

    @property
    def loss_scale(self) -> float:
        """The scale in force now (1.0 without a scaler)."""
        return self.log.scaler.scale if self.log.scaler is not None else 1.0

    # ------------------------------------------------------------------ set-up and teardown
    def convert(self, module: nn.Module, restored: bool = False) -> nn.Module:
        """Cast ``module`` to the half format in place; its fp32 tensors become the masters."""
        return self.masters.convert(module, restored)

    def adopt(self, optimizer: Optimizer) -> int:
        """The index of ``optimizer`` (its position among the optimizers seen), adopting it on first sight."""
        if optimizer not in self._optimizers:
            handles = self.masters.adopt(optimizer)
            if self.masters.separate:
                handles.append(optimizer.register_step_pre_hook(self._refuse_direct_step))
            self._optimizers[optimizer] = handles
        return list(self._optimizers).index(optimizer)

    def _refuse_direct_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """A step of an adopted optimizer that the engine did not start would update the half weights it holds,
        bypassing the masters (fp16's gradients still scaled): refused, with what to call instead."""
        if not self._stepping:
            raise RuntimeError(
                f"MPTPrecision: {type(optimizer).__name__}.step() was called on the torch optimizer itself, outside "
                "the precision plugin. Between steps it holds the half-precision parameters, so it would update them "
                "directly, bypassing the fp32 masters (with fp16, by gradients still multiplied by the loss scale). "
                "Step through the wrapper instead: in a LightningModule `opt = self.optimizers()` (not "
                "`use_pl_optimizer=False`) and `opt.step()`; with Fabric the optimizer that `fabric.setup` returned."
            )

    def index_of(self, optimizer: Optimizer) -> Optional[int]:
        """The index of ``optimizer`` if it was adopted, else ``None``."""
        return list(self._optimizers).index(optimizer) if optimizer in self._optimizers else None

    def restore(self) -> None:
        """End of a stage: drop optimizer hooks and anything half done, give the module its fp32 masters back."""
        for handles in self._optimizers.values():
            for h in handles:
                h.remove()
        self._optimizers.clear()
        self.log.gate.release()
        self.drop_pending()
        self._taken.clear()
        self.masters.restore()

    # ------------------------------------------------------------------ backward
    def scale_loss(self, loss: Tensor, sync: bool = True) -> Tensor:
        """The loss to backpropagate, multiplied by the scale; notes (on the device) whether it was finite.

        New gradients make a decided step stale: its gradients are scaled again, to be accumulated into and decided
        again at the step. With ``accumulate_fp32``, or ``fp32_when_accumulating`` and a backward since the last
        decision (this one adds to its gradients: a scaled fp16 sum could overflow where each term does not, and
        Lightning's "16-mixed" sums in fp32), the gradients are summed in fp32; ``sync`` says whether this backward
        reduces gradients across processes (``False`` for the micro-batches DDP runs under ``no_sync``): until then.
        """
        accumulating = self._loss_finite is not None  # a backward since the last decision left these gradients
        self.drop_pending(rescale=True)
        self.release_gradients(drop=False)
        if self.accumulate_fp32 or (accumulating and self.fp32_when_accumulating):
            # lazily, no zeros: a parameter no backward reached yet keeps no gradient (hooks see None, as under
            # "16-mixed"), and one that this backward makes is a single micro-batch's, exact in the half format
            self.masters.accumulate_in_fp32(sync=sync and distributed(), zeros=self.accumulate_fp32)
        finite = torch.isfinite(loss.detach()).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        self.backward_scale = self.loss_scale
        return loss * self.backward_scale if self.log.scaler is not None else loss

    def release_gradients(self, drop: bool) -> None:
        """Before a forward or a backward: free the fp32 gradients kept since the last step.

        ``drop``: the module's gradients go too (Lightning's automatic optimization zeroes them before the backward
        anyway). Otherwise the gradients a step left (unscaled) are multiplied by the scale in force, so that the next
        backward accumulates into them as under "32-true".
        """
        if drop:
            self._taken.clear()
        elif self._taken:
            self._rescale_taken()
        self.masters.release(drop)

    def _rescale_taken(self) -> None:
        scale = self.loss_scale
        for grads in self._taken.values():
            self.masters.rescale(grads, scale)
        self._taken.clear()
        self.backward_scale = scale

    # ------------------------------------------------------------------ the step
    def decided(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s step is decided and not carried out yet."""
        return optimizer in self._pending

    def decide(self, optimizer: Optimizer) -> PendingStep:
        """Unscale ``optimizer``'s gradients and decide its step: the step's one host sync. Until the step is carried
        out, later calls return the same decision (clipping then stepping costs one sync)."""
        pending = self._pending.get(optimizer)
        if pending is not None:
            return pending
        index = self.adopt(optimizer)
        # stepping again with no backward since: the gradients are the true ones the last step left, as under "32-true"
        taken = self._taken.pop(optimizer, None)
        grads = self.masters.prepare(optimizer, self.backward_scale if taken is None else taken.left_scale)
        scaler = self.log.scaler
        measure = scaler is not None and scaler.measuring and taken is None  # init_scale="auto": the gradients' range
        fp32 = grads.fp32_grads() if measure else []
        amax = max_abs(fp32).max() if fp32 else None
        skipped, loss_finite, edited = self._sync(grads.found_inf, grads.edited, amax)
        if any(edited):
            self.masters.absorb_edits(grads, edited)  # reported by the masters
        pending = PendingStep(index, grads, skipped, loss_finite, self.backward_scale)
        if skipped:
            pending.culprits = grads.nonfinite_mask()  # now, before hooks or clipping touch the gradients
        self._pending[optimizer] = pending
        return pending

    def _sync(
        self, found_inf: Optional[Tensor], edited: Optional[Tensor], amax: Optional[Tensor] = None
    ) -> tuple[bool, bool, list[float]]:
        """``(skip, loss_finite, edit flags)`` in one host sync (:func:`read_flags`); a scaler still measuring
        (``init_scale="auto"``) chooses its scale from ``amax`` after a clean step."""
        loss_finite, self._loss_finite = self._loss_finite, None
        values = read_flags(found_inf, loss_finite, edited, amax)
        if values is None:
            return False, True, []
        skip, rest = values[0] > 0, values[2:]
        if amax is not None:
            measured, rest = rest[0], rest[1:]
            scaler = self.log.scaler
            if scaler is not None and not skip and math.isfinite(measured) and measured > 0:
                scaler.choose(measured, torch.finfo(self.masters.dtype).max)
        return skip, values[1] == 0, rest

    def step(
        self, optimizer: Optimizer, pending: PendingStep, closure: Optional[Callable[[], Any]] = None, **kwargs: Any
    ) -> Any:
        """Carry out a decided step: the optimizer steps the masters (``closure`` is handed to it), or, for a skip,
        is not called at all. Returns what ``optimizer.step`` returned (``None`` for a skip)."""
        self._pending.pop(optimizer, None)
        if pending.skipped:
            _compat.mark_optimizer_stepped(optimizer)  # LR schedulers: a skipped step is a step, as with GradScaler
            self._skip(optimizer, pending)
            return None
        steps = self.masters.steps(optimizer, pending.grads)  # once, or once per chunk of parameters
        self._stepping = True
        try:
            for _ in steps:
                output = optimizer.step(closure=closure, **kwargs) if closure is not None else optimizer.step(**kwargs)
        finally:
            self._stepping = False
            steps.close()  # a failed step gives the optimizer its parameters back
        self._taken[optimizer] = pending.grads
        self.log.taken(pending.optimizer, pending.scale, pending.loss_finite)
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
                self.masters.exit(optimizer, pending.grads, stepped=False)
            result = closure()
            if result is None:  # no backward ran (training_step returned None): nothing to step
                after()
                return result
            if pending is None:
                pending = self.decide(optimizer)
            else:
                grads = self.masters.prepare(optimizer, self.backward_scale, check_edits=False)
                pending = PendingStep(pending.optimizer, grads, False, True, self.backward_scale)
                self._pending[optimizer] = pending
            state["pending"] = pending
            after()
            self._pending.pop(optimizer, None)
            if pending.skipped:
                self._skip(optimizer, pending)
                raise _SkippedStep
            self.masters.enter(optimizer, pending.grads)
            return result

        stepped = False
        self._stepping = True
        try:
            output = optimizer.step(closure=wrapped, **kwargs)
            stepped = True
        except _SkippedStep:
            return None
        finally:
            self._stepping = False
            pending = state["pending"]
            if pending is not None and pending.grads.entered:
                self.masters.exit(optimizer, pending.grads, stepped=stepped)
        pending = state["pending"]
        if pending is not None:
            self._taken[optimizer] = pending.grads
            self.log.taken(pending.optimizer, pending.scale, pending.loss_finite)
        return output

    def give_up(self, optimizer: Optimizer, pending: PendingStep) -> None:
        """Abandon a step decided skipped before it is carried out, to compute its gradients again: the scale backs
        off, the gradients are dropped and the overflow is recorded as a skipped step (the guard looks), as for any
        skip; the optimizer is not called and the LR schedulers are not told of a step."""
        self._pending.pop(optimizer, None)
        self._skip(optimizer, pending)

    def _skip(self, optimizer: Optimizer, pending: PendingStep) -> None:
        """Carry out a skipped step: nothing moves, the gradients are dropped, the scale backs off, the guard looks."""
        grads = pending.grads
        if grads.entered:
            self.masters.exit(optimizer, grads, stepped=False)
        names = [self.masters.name_of(p) for p in grads.all_params()]
        self.masters.discard(grads, zero=not self.zero_grad_drops)
        self.log.skipped(pending.optimizer, pending.scale, pending.loss_finite, names, pending.culprits)

    def drop_pending(self, rescale: bool = False) -> None:
        """Forget decided steps not carried out (new gradients arrived, or the run failed inside a step);
        ``rescale``: their (unscaled) gradients are scaled again for the next backward."""
        for optimizer, pending in self._pending.items():
            if pending.grads.entered:
                self.masters.exit(optimizer, pending.grads, stepped=False)
            if rescale:
                self.masters.rescale(pending.grads, self.loss_scale)
        self._pending.clear()


def read_flags(
    found_inf: Optional[Tensor], loss_finite: Optional[Tensor], edited: Optional[Tensor], amax: Optional[Tensor]
) -> Optional[list[float]]:
    """The step's flags in one host sync: ``[non-finite gradient, non-finite loss, (amax), *edit flags]``, ``None``
    when there are none. The first two and ``amax`` (the largest unscaled gradient magnitude of a scaler still
    measuring) are all-reduced (max) across processes, so every rank takes the same decision and chooses the same
    scale (FSDP2's shards see parts of the gradients); the edit flags are this process's own.

    Example:
        ```python
        values = read_flags(torch.tensor(1.0), torch.tensor(True), torch.tensor([False, True]), None)
        assert values == [1.0, 0.0, 0.0, 1.0]  # a non-finite gradient, a finite loss, the second weight edited
        ```
    """
    present = [t for t in (found_inf, loss_finite, edited) if t is not None]
    if not present:
        return None
    device = present[0].device
    zero = torch.zeros((), device=device)
    flags = torch.stack([
        zero if found_inf is None else (found_inf.to(device) > 0).float(),
        zero if loss_finite is None else (~loss_finite).float().to(device),
        *(() if amax is None else (amax.to(device=device, dtype=torch.float32),)),
    ])
    if distributed():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if edited is not None:
        flags = torch.cat([flags, edited.to(device=device, dtype=flags.dtype).reshape(-1)])
    return flags.tolist()  # the one host sync
