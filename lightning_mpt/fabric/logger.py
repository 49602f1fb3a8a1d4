"""``MixedPrecisionLogger``: the diagnostics of the Trainer callbacks for a Lightning Fabric loop.

The loop calls it at the two places where the numerics of a step can be seen: after the backward that completes the
step's gradients (the stored, scaled half gradients: fractions, exponent and value histograms) and in place of
``optimizer.step()`` (the masters before and after the step: update underflow; the plugin's step history: loss
scale, skipped steps, culprits). It writes the tags of :mod:`lightning_mpt.diagnostics.tags` and the "Mixed precision"
dashboard through ``fabric.loggers``, with the statistics of :mod:`lightning_mpt.diagnostics.statistics` that the
Trainer callbacks use: the same numbers, one host sync per logging step, and ``lightning-mpt report`` reads the logs.

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

import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal, Optional

import torch
from lightning.fabric import Fabric
from lightning.fabric.wrappers import is_wrapped
from torch import Tensor, nn

from lightning_mpt.core.numerics import FP16, max_abs
from lightning_mpt.core.steps import NonFiniteGradientError
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistics import (
    ExponentHistograms,
    FlushReference,
    LossScaleLog,
    ParamTable,
    Recorder,
    ReferenceStats,
    Shards,
    Statistic,
    StoredFractions,
    UpdateUnderflow,
    ValueHistograms,
    describe_precision,
    grad_scaler,
    half_format,
    has_masters,
    local_tensor,
    loss_scale,
    module_name,
    reference_gradients,
    rng_state,
)

__all__ = ["MixedPrecisionLogger"]


def sink_for_fabric(fabric: Fabric) -> Sink:
    """Every TensorBoard ``SummaryWriter`` of Fabric's loggers on global rank 0 (else its other loggers), nothing
    elsewhere."""
    return Sink.for_loggers(fabric.loggers) if fabric.is_global_zero else Sink()


class MixedPrecisionLogger:
    """The "Mixed precision" dashboard for a Fabric loop: loss scale, skipped steps and their culprits, stored-gradient
    fractions, update underflow, gradient and exponent histograms, and the flush fraction from an fp32 reference on
    demand, under the same tags and with the same numbers as the Trainer callbacks
    (:class:`~lightning_mpt.callbacks.LossScaleMonitor`, :class:`~lightning_mpt.callbacks.UnderflowMonitor`,
    :class:`~lightning_mpt.callbacks.GradientHistogramMonitor`).

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

    * :meth:`after_backward` reads the gradients as the backward stored them, scaled, before anything unscales or
      clips them: the zero, subnormal and overflow fractions and the stored headroom (every ``every_n_steps``), the
      exponent histograms and the value histograms (every ``histograms_every_n_steps``; the values are drawn unscaled,
      as the optimizer sees them before clipping). With gradient accumulation, call it after the last micro-batch's
      backward only.
    * :meth:`step` copies the fp32 masters (at fraction steps), runs ``optimizer.step()``, measures the update
      underflow, logs the plugin's step history (loss scale, skips, culprits, scale changes) and reads everything
      queued in the step with **one** host sync.
    * :meth:`reference` re-runs a loss function in fp32 with the masters (``torch.func.functional_call``: the module's
      parameters, gradients and the optimizer are untouched) and logs the true flush fraction and the scale headroom.
      Called before the step's forward, it replays the random state the forward will start from, so dropout draws
      the same masks. Under DDP every process must call it at the same steps (its counts are summed across them).

    Works with :class:`lightning_mpt.fabric.MPTPrecision` (``"fp16"``, ``"bf16"``) and with Fabric's own
    ``"16-mixed"`` (a ``torch.amp.GradScaler``: an overflow shows as the scale backing off) and ``"bf16-mixed"`` (no
    loss scale to log), on one device and under DDP; rank 0 writes.

    Args:
        fabric: the ``lightning.Fabric`` whose loggers get the values (a TensorBoard logger for the histograms, texts
            and records; others get the scalars).
        model: the model ``fabric.setup`` returned (or the module it wraps).
        every_n_steps: optimizer steps between stored-gradient fractions and update-underflow measurements.
        histograms_every_n_steps: optimizer steps between gradient and exponent histograms; ``0`` turns them off.
        scale_every_n_steps: log the loss scale every this many steps; skipped steps and scale changes are always
            logged.
        per_parameter: also log each parameter's fractions.
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
        recorder: the :class:`~lightning_mpt.diagnostics.statistics.Recorder` (``recorder.syncs`` counts host reads).
        stored_stat, update_stat, value_stat, exponent_stat, reference_stat, scale_log: the statistics (``None`` when
            not measured); ``stat.enabled`` is ``False`` once one failed.
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
        self.every_n_steps = _check("every_n_steps", every_n_steps)
        self.histograms_every_n_steps = _check("histograms_every_n_steps", histograms_every_n_steps, zero=True)
        self.scale_every_n_steps = _check("scale_every_n_steps", scale_every_n_steps)
        if group_by not in ("parameter", "module"):
            raise ValueError(f"MixedPrecisionLogger(group_by={group_by!r}): expected 'parameter' or 'module'.")
        _check("bins", bins)
        _check("max_names", max_names)
        self.fabric = fabric
        self.module: nn.Module = model.module if is_wrapped(model) and isinstance(model.module, nn.Module) else model
        self.plugin: Any = fabric.strategy.precision
        self.strict = strict
        self.global_step = 0
        self.last_reference: Optional[ReferenceStats] = None
        self._started = False
        self._measured: Optional[int] = None  # the step whose gradients after_backward measured
        self._loss_finite: Optional[Tensor] = None  # GradScaler: the step's loss was finite (on the device)
        self._warned: set[str] = set()
        owner = type(self).__name__
        self.setup_stat = Statistic(owner, "the set-up", strict)
        self.stored_stat: Optional[StoredFractions] = None
        self.update_stat: Optional[UpdateUnderflow] = None
        self.exponent_stat: Optional[ExponentHistograms] = None
        self.reference_stat: Optional[FlushReference] = None
        self.value_stat = ValueHistograms([], bins, owner, strict)
        self.scale_log = LossScaleLog(self.scale_every_n_steps, max_names, owner, strict)
        self._table: Optional[ParamTable] = None
        self._groups: list[tuple[str, list[tuple[str, Tensor]]]] = []
        self.recorder = Recorder(sink_for_fabric(fabric))
        with self.setup_stat.guarded():
            self._set_up(per_parameter, update_underflow, group_by, bins)

    @property
    def sink(self) -> Sink:
        return self.recorder.sink

    # ------------------------------------------------------------------------------------------------ set-up
    def _set_up(self, per_parameter: bool, update_underflow: bool, group_by: str, bins: int) -> None:
        owner, strict, plugin, module = type(self).__name__, self.strict, self.plugin, self.module
        try:
            shards = Shards.of(list(module.parameters()))
        except ValueError:
            self.recorder.active = False  # local numbers of shards would be wrong numbers: measure nothing
            raise
        if shards is not None:
            self.recorder.shards = shards
            self.recorder.active = bool(self.fabric.loggers)
        if self.fabric.is_global_zero and not self.sink.active:
            self._warn("logger", f"{owner}: the Fabric has no logger; nothing will be recorded.")
        header = Statistic(owner, f"the dashboard layout and the {tags.RUN_RECORD} record", strict)
        with header.guarded():
            self.sink.layout()  # every chart: the three callbacks' dashboard
            self.sink.record(tags.RUN_RECORD, {**describe_precision(plugin), "monitors": [owner]}, 0)
        key = (lambda n: n) if group_by == "parameter" else module_name
        groups: dict[str, list[tuple[str, Tensor]]] = {}
        for name, p in module.named_parameters():
            groups.setdefault(key(name), []).append((name, p))
        self._groups = list(groups.items())
        if self.histograms_every_n_steps:
            self.value_stat = ValueHistograms(list(groups), bins, owner, strict)
        fmt = half_format(plugin)
        if fmt is FP16 and not has_masters(plugin) and grad_scaler(plugin) is None:
            self._warn(
                "scaler",
                f"{owner}: the precision plugin {type(plugin).__name__} ({getattr(plugin, 'precision', '?')}) has no "
                "loss scaler; the loss scale is not logged.",
            )
        if fmt is None:
            self._warn(
                "format",
                f"{owner}: the precision plugin {type(plugin).__name__} does not compute in fp16 or bf16; only the "
                "value histograms are written. Use MPTPrecision('fp16'/'bf16') or precision='16-mixed'/'bf16-mixed'.",
            )
            return
        table = ParamTable(module, plugin, shards)
        if not len(table):
            self._warn(
                "no half", f"{owner}: no parameter is computed in {fmt.name}; only the value histograms are written."
            )
            return
        self._table = table
        self.stored_stat = StoredFractions(table.names, fmt, per_parameter, owner, strict)
        if update_underflow:
            self.update_stat = UpdateUnderflow(table.names, fmt, per_parameter, owner, strict)
        if self.histograms_every_n_steps:
            self.exponent_stat = ExponentHistograms([key(n) for n in table.names], fmt, owner, strict)
            self.exponent_stat.write_legend(self.sink)
        self.reference_stat = FlushReference(table.names, fmt, per_parameter, owner, strict)

    def _start(self) -> None:
        """At the first call: where the step count stands (a run resumed with ``fabric.load`` continues it)."""
        if self._started:
            return
        self._started = True
        if has_masters(self.plugin):
            last = self.plugin.last_step
            self.global_step = last.step + 1 if last is not None else int(self.plugin.state_dict().get("steps", 0))
            self.scale_log.seen = self.global_step - 1
            self.scale_log.overflows = int(self.plugin.skipped_steps)

    def _measures(self, stat: Optional[Statistic]) -> bool:
        return (
            stat is not None
            and (self.setup_stat.enabled or self.recorder.sharded)
            and self.recorder.active
            and self.recorder.live(stat)
        )

    # ------------------------------------------------------------------------------------------------ the step
    def after_backward(self, loss: Optional[Tensor] = None) -> None:
        """Measure the stored gradients of the current step: call it after ``fabric.backward`` of the step's last
        micro-batch, before ``fabric.clip_gradients`` and :meth:`step` (which unscale them).

        ``loss``: the step's loss, under a ``GradScaler`` only (``MPTPrecision`` records it itself): at an overflow
        the records say whether the loss itself was non-finite (kept on the device, read at overflows only).
        """
        self._start()
        step = self.global_step
        if loss is not None and not has_masters(self.plugin):
            self._loss_finite = torch.isfinite(loss.detach()).all()
        if self._measured == step:
            self._warn(
                "twice",
                f"{type(self).__name__}.after_backward was called twice in step {step}; the gradients are measured at "
                "the first call. With gradient accumulation call it after the last micro-batch's backward only.",
            )
            return
        self._measured = step
        table = self._table
        if table is not None and _due(step, self.every_n_steps) and self._measures(self.stored_stat):
            self.stored_stat.measure(self.recorder, table.grads, step)  # type: ignore[union-attr]  # _measures
        if not _due(step, self.histograms_every_n_steps):
            return
        if table is not None and self._measures(self.exponent_stat):
            self.exponent_stat.measure(self.recorder, table.grads, step)  # type: ignore[union-attr]  # _measures
        if self._groups and self._measures(self.value_stat):
            grads = partial(_stored_gradients, self._groups, self.recorder.shards)
            self.value_stat.measure(self.recorder, grads, step, scale=loss_scale(self.plugin))

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` (the optimizer ``fabric.setup`` returned) with the measurements around
        it, then one host read for everything the step queued. Returns what ``optimizer.step`` returned."""
        self._start()
        step, plugin = self.global_step, self.plugin
        if self._table is not None and _due(step, self.every_n_steps) and self._measures(self.update_stat):
            self.update_stat.snapshot(partial(self._table.masters, plugin), step)  # type: ignore[union-attr]
        scaler = grad_scaler(plugin)
        before = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
        try:
            output = optimizer.step(*args, **kwargs)
        except Exception as error:
            self._stopped(error)
            raise
        if self.update_stat is not None:
            self.update_stat.measure(self.recorder)
        if has_masters(plugin):
            self.scale_log.history(self.sink, plugin.history, plugin.loss_scale)
            last = plugin.last_step
            self.global_step = (last.step if last is not None else step) + 1
        else:
            if before is not None and scaler is not None:
                after = scaler.get_scale()
                overflow = after < before  # GradScaler backs off at every overflow, and only then
                names, loss_finite = self._causes() if overflow and self.sink.active else ([], None)
                self.scale_log.step(self.sink, step, before, after, overflow, lambda: names, loss_finite)
            self._loss_finite = None
            self.global_step = step + 1
        self.recorder.flush()
        return output

    def reference(self, loss_fn: Callable[..., Any], *args: Any) -> Optional[ReferenceStats]:
        """The fp32 reference of a batch: ``loss_fn(module, *args)`` with the module's weights replaced by the fp32
        masters, in fp32 (autocast off, floating inputs cast), differentiated with ``torch.autograd.grad``; logs
        ``mpt/grad_underflow_fraction`` (global, per parameter) and ``mpt/scale_headroom`` at the current step, at the
        loss scale the step's backward uses. Returns the counts (``None`` when off).

        Call it before the step's forward: the random state is restored afterwards, so the real forward draws the
        same random numbers (dropout masks) as the reference did. It leaves weights, gradients, optimizer state,
        buffers and torchmetrics states as they were. Costs about one fp32 forward and backward. Under DDP and FSDP2
        every process must call it at the same steps; a failure on one turns it off on all. Under FSDP2 each process
        gathers the whole fp32 weights for it (a collective, and a transient fp32 copy of the model and of its
        gradients per process; see :class:`~lightning_mpt.callbacks.UnderflowMonitor`), so the figures equal DDP's.
        """
        self._start()
        stat, table = self.reference_stat, self._table
        if stat is None or table is None or stat.retired:  # the same on every process: they measure together
            return None
        module, plugin = self.module, self.plugin
        strategy = self.fabric.strategy
        result = stat.measure(
            self.recorder,
            lambda: reference_gradients(module, table, plugin, loss_fn, args, rng=rng_state()),
            loss_scale_now(plugin),
            self.global_step,
            lambda ok: bool(strategy.reduce_boolean_decision(ok, all=True)),
        )
        if result is not None:
            self.last_reference = result
        return result

    def finalize(self) -> None:
        """At the end of training: the overflow summary (the text ``mpt/overflow_summary`` when there were skipped
        steps, the record ``mpt/data/overflow_summary``) and whatever is still queued, written to disk."""
        self.scale_log.summary(self.sink, self.global_step)
        self.recorder.flush()
        self.sink.flush()

    # ------------------------------------------------------------------------------------------------ internals
    def _stopped(self, error: BaseException) -> None:
        """``optimizer.step`` raised: log the steps taken (the one that tripped ``MPTPrecision``'s guard among them),
        the stop, and the summary; drop the rest."""
        plugin = self.plugin
        if self.update_stat is not None:
            self.update_stat.discard()
        self.recorder.clear()
        if has_masters(plugin):
            self.scale_log.history(self.sink, plugin.history, plugin.loss_scale)
            last = plugin.last_step
            if isinstance(error, NonFiniteGradientError):
                self.scale_log.stopped(self.sink, last.step if last is not None else self.global_step, error)
        self.scale_log.summary(self.sink, self.global_step)
        self.sink.flush()  # the error may end the process: the stop is on disk first

    def _causes(self) -> tuple[list[str], Optional[bool]]:
        """At a GradScaler overflow: the parameters whose gradients hold inf/NaN and whether the loss was finite
        (``None``: not given), with one host read (those steps only)."""
        named = [(n, p.grad) for n, p in self.module.named_parameters() if p.grad is not None]
        parts = [(~torch.isfinite(max_abs([local_tensor(g) for _, g in named]))).float()] if named else []
        if self._loss_finite is not None:
            parts.append(self._loss_finite.float().reshape(1).to(parts[0].device if parts else "cpu"))
        values = torch.cat(parts).tolist() if parts else []
        loss_finite = values[-1] > 0 if self._loss_finite is not None else None
        return [n for (n, _), bad in zip(named, values) if bad], loss_finite

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned and self.fabric.is_global_zero:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)


def loss_scale_now(plugin: Any) -> float:
    """The loss scale the next backward uses: the scale in force now (1.0 without one)."""
    if has_masters(plugin):
        return float(plugin.loss_scale)
    scaler = grad_scaler(plugin)
    return scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0


def _stored_gradients(
    groups: Sequence[tuple[str, Sequence[tuple[str, Tensor]]]], shards: Optional[Shards]
) -> list[list[Tensor]]:
    """Each group's stored gradients (scaled; this process's shards under FSDP2)."""
    return [
        [local_tensor(p.grad) for _, p in members if p.grad is not None and (shards is None or shards.owns(p))]
        for _, members in groups
    ]


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _check(name: str, value: Any, zero: bool = False) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or (zero and value == 0)):
        return value
    accepted = "an int >= 1" + (" or 0 (off)" if zero else "")
    raise ValueError(f"MixedPrecisionLogger({name}={value!r}): expected {accepted}.")
