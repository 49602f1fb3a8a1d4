"""``MixedPrecisionLogger``: the diagnostics of the Trainer callbacks for a Lightning Fabric loop.

It drives the same :class:`~lightning_mpt.diagnostics.session.DiagnosticSession` and statistic sets as the Trainer
callbacks, at the call points of a Fabric loop: the same tags and numbers, one host sync per logging step, and
``lightning-mpt report`` reads the logs.

Example:
    ```python
    import tempfile

    import lightning as L
    import torch
    from lightning.fabric.loggers import TensorBoardLogger
    from torch import nn
    from torch.nn import functional as F
    from lightning_mpt.fabric import MixedPrecisionLogger, MPTPrecision

    fabric = L.Fabric(accelerator="cpu", plugins=[MPTPrecision("bf16")], loggers=TensorBoardLogger(tempfile.mkdtemp()))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    diagnostics = MixedPrecisionLogger(fabric, model, every_n_steps=1, histograms_every_n_steps=2)

    def compute_loss(module, x, y):
        return F.mse_loss(module(x).float(), y)

    for step in range(4):
        x, y = torch.randn(32, 8), torch.randn(32, 1)
        if step % 2 == 0:
            diagnostics.reference(compute_loss, x, y)   # fp32 re-run with the masters, before the step's forward
        fabric.backward(compute_loss(model, x, y))
        diagnostics.after_backward()                    # the stored half gradients
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        diagnostics.step(optimizer)                     # instead of optimizer.step()
        optimizer.zero_grad()
    diagnostics.finalize()
    assert diagnostics.global_step == 4 and diagnostics.recorder.syncs == 4
    fabric.strategy.precision.restore()
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Optional

from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from lightning.fabric.wrappers import is_wrapped
from torch import Tensor, nn

from lightning_mpt.core.numerics import FP16
from lightning_mpt.diagnostics.cadence import check_every
from lightning_mpt.diagnostics.dashboard import CHARTS, FP8_CHARTS
from lightning_mpt.diagnostics.fp8 import Float8Statistics
from lightning_mpt.diagnostics.histograms import GradientHistograms
from lightning_mpt.diagnostics.loss_scale import ScaleTracker, Suspects
from lightning_mpt.diagnostics.plugin import current_scale, half_format, has_masters, steps_taken
from lightning_mpt.diagnostics.recorder import Recorder
from lightning_mpt.diagnostics.reference import ReferenceStats
from lightning_mpt.diagnostics.replay import reference_gradients, rng_state
from lightning_mpt.diagnostics.session import DiagnosticSession
from lightning_mpt.diagnostics.statistic import Statistic
from lightning_mpt.diagnostics.underflow import UnderflowStatistics

__all__ = ["MixedPrecisionLogger"]


class MixedPrecisionLogger:
    """The "Mixed precision" dashboard for a Fabric loop: loss scale, skipped steps and their culprits, stored-gradient
    fractions, update underflow, gradient and exponent histograms, torchao's fp8 casts (with
    ``MPTPrecision("bf16", fp8=...)``: :class:`~lightning_mpt.callbacks.Float8Monitor`'s tags), and the flush fraction
    from an fp32 reference on demand, under the same tags and with the same numbers as the Trainer callbacks
    (:class:`~lightning_mpt.callbacks.LossScaleMonitor`, :class:`~lightning_mpt.callbacks.UnderflowMonitor`,
    :class:`~lightning_mpt.callbacks.GradientHistogramMonitor`). Everything a step queued is read with one host sync
    in :meth:`step`.

    Call points, per optimizer step::

        diagnostics.reference(compute_loss, *batch)   # optional, on demand: before the step's forward
        loss = compute_loss(model, *batch)
        fabric.backward(loss)
        diagnostics.after_backward()                  # after the backward that completes the step's gradients
        fabric.clip_gradients(model, optimizer, ...)  # optional
        diagnostics.step(optimizer)                   # instead of optimizer.step()
        optimizer.zero_grad()
        ...
        diagnostics.finalize()                        # at the end: the overflow summary

    Works with :class:`lightning_mpt.fabric.MPTPrecision` (``"fp16"``, ``"bf16"``) and with Fabric's own
    ``"16-mixed"`` (a ``torch.amp.GradScaler``: an overflow shows as the scale backing off) and ``"bf16-mixed"`` (no
    loss scale to log), on one device, under DDP and FSDP2; rank 0 writes.

    Args:
        fabric: the ``lightning.Fabric`` whose loggers get the values (a TensorBoard logger for the histograms, texts
            and records; others get the scalars).
        model: the model ``fabric.setup`` returned (or the module it wraps).
        every_n_steps: optimizer steps between stored-gradient fractions and update-underflow measurements.
        histograms_every_n_steps: optimizer steps between gradient and exponent histograms; ``0`` turns them off.
        scale_every_n_steps: log the loss scale every this many steps; skipped steps and scale changes are always
            logged.
        per_parameter: also log each parameter's fractions (and each fp8 layer's cast statistics).
        update_underflow: measure the update underflow (copies the fp32 masters before the step, at those steps).
        group_by: ``"parameter"`` or ``"module"``: one histogram per parameter, or per module.
        bins: buckets of the value histograms.
        max_names: parameter names listed per skipped step in the text (the records hold all).
        strict: re-raise internal errors instead of a warning that turns the failing statistic off (``None``: the
            environment variable ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Attributes:
        global_step: the index of the current optimizer step (0-based, skipped steps included), the x axis of every
            tag; read from ``MPTPrecision``'s step count at the first call (so a run resumed with ``fabric.load``
            continues its axis), counted by :meth:`step` otherwise. Set it to continue another count.
        last_reference: the latest :class:`~lightning_mpt.callbacks.ReferenceStats`, on every process.
        recorder: the :class:`~lightning_mpt.diagnostics.recorder.Recorder` (``recorder.syncs`` counts host reads).
        scale, underflow, histograms: the statistic sets
            (:class:`~lightning_mpt.diagnostics.loss_scale.ScaleTracker`,
            :class:`~lightning_mpt.diagnostics.underflow.UnderflowStatistics`,
            :class:`~lightning_mpt.diagnostics.histograms.GradientHistograms`); a statistic's ``enabled`` is
            ``False`` once it failed (``underflow.reference_stat.enabled``).
    """

    def __init__(
        self,
        fabric: Fabric,
        model: nn.Module,
        every_n_steps: int = 50,
        histograms_every_n_steps: int = 100,
        scale_every_n_steps: int = 1,
        per_parameter: bool = True,
        update_underflow: bool = True,
        group_by: Literal["parameter", "module"] = "parameter",
        bins: int = 32,
        max_names: int = 10,
        strict: Optional[bool] = None,
    ) -> None:
        owner = type(self).__name__
        self.every_n_steps = check_every(owner, "every_n_steps", every_n_steps)
        self.histograms_every_n_steps = check_every(
            owner, "histograms_every_n_steps", histograms_every_n_steps, allow_zero=True
        )
        self.scale_every_n_steps = check_every(owner, "scale_every_n_steps", scale_every_n_steps)
        self.histograms = GradientHistograms(self.histograms_every_n_steps, group_by, bins, owner=owner, strict=strict)
        self.scale = ScaleTracker(self.scale_every_n_steps, check_every(owner, "max_names", max_names), owner, strict)
        self.underflow = UnderflowStatistics(self.every_n_steps, per_parameter, update_underflow, owner, strict)
        self.fp8 = Float8Statistics(self.every_n_steps, per_parameter, owner, strict)
        self.fabric = fabric
        self.module: nn.Module = model.module if is_wrapped(model) and isinstance(model.module, nn.Module) else model
        self.plugin: Any = fabric.strategy.precision
        self.strict = strict
        self.global_step = 0
        self.session = DiagnosticSession.for_loggers(
            fabric.loggers, TensorBoardLogger, fabric.is_global_zero, owner, strict
        )
        self.recorder: Recorder = self.session.recorder
        self.setup_stat = Statistic(owner, "the set-up", strict)
        self._started = False
        self._measured: Optional[int] = None  # the step whose gradients after_backward measured
        self._loss: Optional[Tensor] = None  # GradScaler: the step's loss, read at an overflow only
        with self.setup_stat.guarded():
            self._set_up()

    def _set_up(self) -> None:
        session, plugin, module, owner = self.session, self.plugin, self.module, type(self).__name__
        session.shard(module, bool(self.fabric.loggers))
        session.warn_without_logger(owner, "Fabric")
        fp8 = getattr(plugin, "fp8_config", None) is not None
        # every chart, as the Trainer's callbacks together draw them (the fp8 ones with fp8 only, as Float8Monitor)
        session.write_header(plugin, None if fp8 else [k for k in CHARTS if k not in FP8_CHARTS], [owner], 0)
        self.histograms.set_up(session, module, plugin)
        if half_format(plugin) is FP16 and ScaleTracker.source_of(plugin) is None:
            session.warn_once(self.scale.without_scale(plugin))
        self.underflow.set_up(session, module, plugin)
        if fp8:
            self.fp8.set_up(session, module)
            self.fp8.arm(self.recorder, self.global_step)  # the first step's forward comes before any call

    def _start(self) -> None:
        """At the first call: where the plugin stands (a run resumed with ``fabric.load`` continues its step count)."""
        if self._started:
            return
        self._started = True
        self.scale.start(self.plugin)
        if has_masters(self.plugin):
            self.global_step = steps_taken(self.plugin)

    @property
    def _on(self) -> bool:
        return self.setup_stat.enabled or self.recorder.sharded

    # ------------------------------------------------------------------------------------------------ call points
    def after_backward(self, loss: Optional[Tensor] = None) -> None:
        """Measure the stored gradients of the current step: call it after ``fabric.backward`` of the step's last
        micro-batch, before ``fabric.clip_gradients`` and :meth:`step` (which unscale them).

        Args:
            loss: the step's loss, under a ``GradScaler`` only (``MPTPrecision`` records it itself): at an overflow
                the records say whether the loss itself was non-finite.
        """
        self._start()
        step = self.global_step
        if loss is not None and not has_masters(self.plugin):
            self._loss = loss.detach()
        if self._measured == step:
            self.session.warn_once(
                f"{type(self).__name__}.after_backward was called twice in step {step}; the gradients are measured at "
                "the first call. With gradient accumulation call it after the last micro-batch's backward only.",
                key="after_backward twice",
            )
            return
        self._measured = step
        if self._on:
            self.fp8.after_backward(self.recorder)
            self.underflow.after_backward(self.recorder, step)
            self.histograms.after_backward(self.recorder, step)
            self.histograms.stored_values(self.recorder, self.plugin, step)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` (the optimizer ``fabric.setup`` returned) with the measurements around
        it, then one host read for everything the step queued. Returns what ``optimizer.step`` returned."""
        self._start()
        step, plugin = self.global_step, self.plugin
        if self._on:
            self.underflow.before_step(self.recorder, plugin, step)
        self.scale.before_step(self.session.sink, plugin, step)
        try:
            output = optimizer.step(*args, **kwargs)
        except Exception as error:
            self._stopped(error)
            raise
        self.underflow.after_step(self.recorder)
        self.scale.after_steps(self.session.sink, plugin, lambda: Suspects.in_module(self.module), self._loss)
        self._loss = None
        self.global_step = steps_taken(plugin) if has_masters(plugin) else step + 1
        self.recorder.flush()
        if self._on:
            self.fp8.arm(self.recorder, self.global_step)  # before the next step's forward
        return output

    def reference(self, loss_fn: Callable[..., Any], *args: Any) -> Optional[ReferenceStats]:
        """The fp32 reference of a batch: ``loss_fn(module, *args)`` with the module's weights replaced by the fp32
        masters, in fp32, differentiated with ``torch.autograd.grad``; logs ``mpt/grad_underflow_fraction`` (global,
        per parameter) and ``mpt/scale_headroom`` at the current step and loss scale. Returns the counts (``None``
        when off).

        Call it before the step's forward: the random state is restored afterwards, so the real forward draws the
        same random numbers (dropout masks). It leaves weights, gradients, optimizer state, buffers and torchmetrics
        states as they were and costs about one fp32 forward and backward. Under DDP and FSDP2 every process must call
        it at the same steps; a failure on one turns it off on all.
        """
        self._start()
        module, plugin, strategy = self.module, self.plugin, self.fabric.strategy
        return self.underflow.measure_reference(
            self.recorder,
            lambda table: reference_gradients(module, table, plugin, loss_fn, args, rng=rng_state()),
            current_scale(plugin),
            self.global_step,
            lambda ok: bool(strategy.reduce_boolean_decision(ok, all=True)),
        )

    def finalize(self) -> None:
        """At the end of training: the overflow summary (the text ``mpt/overflow_summary`` when there were skipped
        steps, the record ``mpt/data/overflow_summary``) and whatever is still queued, written to disk."""
        self._start()
        self.scale.summary(self.session.sink, self.global_step)
        self.recorder.flush()
        self.session.sink.flush()

    @property
    def last_reference(self) -> Optional[ReferenceStats]:
        return self.underflow.last_reference

    def _stopped(self, error: BaseException) -> None:
        """``optimizer.step`` raised: log the steps taken (the one that tripped ``MPTPrecision``'s guard among them),
        the stop, and the summary; drop the rest."""
        self.underflow.release()
        self.fp8.release()
        self.recorder.clear()
        self.scale.stopped(self.session.sink, self.plugin, error, self.global_step)
        self.session.sink.flush()  # the error may end the process: the stop is on disk first
