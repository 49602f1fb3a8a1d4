"""``UnderflowMonitor``: what the half format does to the gradients and updates of each parameter.

Three measurements, each at its own cadence, each a :class:`~lightning_mpt.diagnostics.statistics.Statistic` that
turns off alone on an internal error:

* every ``every_n_steps``: zero, subnormal and overflow fractions of the stored (scaled) half gradients, and the
  headroom of the largest stored value, from the gradients as the backward left them
  (:class:`~lightning_mpt.diagnostics.statistics.StoredFractions`);
* at the same steps: the update underflow fraction, from the fp32 masters before and after the optimizer step
  (:class:`~lightning_mpt.diagnostics.statistics.UpdateUnderflow`);
* every ``reference_every_n_steps``: the true flush (underflow) fraction and the scale headroom, from an fp32
  reference gradient of the same batch computed with the masters
  (:class:`~lightning_mpt.diagnostics.statistics.FlushReference`). Each rank measures its own backward; the counts
  are summed (and the maxima taken) across ranks by :class:`FlushStatistics`, a torchmetrics ``Metric``. Under FSDP2
  each rank re-runs its batch with the whole fp32 weights gathered from the shards, with FSDP's hooks suspended.

This module holds what needs the Trainer: when to measure, and the fp32 re-run of ``training_step``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpt.callbacks._common import Monitor, accumulating, check_every, due
from lightning_mpt.diagnostics.statistics import (
    FlushReference,
    FlushStatistics,
    ParamTable,
    ReferenceStats,
    StoredFractions,
    UpdateUnderflow,
    half_format,
    loss_scale,
    reference_gradients,
    rng_state,
)

__all__ = ["FlushStatistics", "ReferenceStats", "UnderflowMonitor"]


@dataclass
class _Replay:
    batch: Any
    batch_idx: int
    rng: dict[str, Any]


class UnderflowMonitor(Monitor):
    """Log the fractions of gradient values that the half format zeroes, makes subnormal or overflows, the true
    flush fraction and scale headroom from an fp32 reference, and the share of weight updates a half-precision
    weight would lose (DESIGN.md §4).

    Tags (global, and per parameter with ``/<param name>`` appended when ``per_parameter``):
    ``mpt/grad_zero_fraction``, ``mpt/grad_subnormal_fraction``, ``mpt/grad_overflow_fraction`` and
    ``mpt/stored_headroom`` every ``every_n_steps``; ``mpt/update_underflow_fraction`` at the same steps (when the
    step was not skipped); ``mpt/grad_underflow_fraction`` and ``mpt/scale_headroom`` every
    ``reference_every_n_steps``.

    The reference re-runs ``training_step`` on the same batch in fp32 with the master weights, replaying the RNG
    state the batch started with (same dropout masks), and takes ``torch.autograd.grad`` of the loss: it leaves the
    weights, gradients, optimizer state, BatchNorm statistics, torchmetrics states and RNG state as they were, and
    its ``self.log`` calls are discarded. It costs about one fp32 forward and backward. It needs automatic
    optimization; under gradient accumulation it measures the last micro-batch. The RNG state is taken in this
    callback's ``on_train_batch_start``: random numbers drawn after it and before ``training_step`` (by later
    callbacks' or the module's ``on_train_batch_start``) would give the re-run other dropout masks. If the re-run
    raises (a model that cannot run in fp32), the reference is turned off with a warning holding the traceback
    (on every rank together) and training goes on; with ``strict`` the error is raised.

    Under FSDP2 (``ModelParallelStrategy``) the reference measures what it measures under DDP: each rank's own batch,
    differentiated with respect to the whole fp32 weights, counted over the whole gradients, the counts summed and the
    maxima taken across ranks. At a reference step every rank gathers the whole fp32 weights from FSDP's fp32 shards
    (``DTensor.full_tensor()``, before the re-run's forward) and re-runs the batch with ``fully_shard``'s hooks
    suspended, so that FSDP neither all-gathers its half copy nor reduce-scatters into the step's gradients. The
    memory cost, at reference steps only and transient: a whole fp32 copy of the weights and of their gradients on
    every rank, besides the fp32 activations, i.e. what sharding saves, for the time of the re-run. A model too large
    for it fails there (out of memory): the reference is then turned off with a ``DiagnosticsWarning`` on every rank
    and training goes on (``reference_every_n_steps=0`` avoids it).

    Measuring the update underflow copies the fp32 masters before the step, at those steps only: 4 bytes per
    parameter of transient memory (``update_underflow=False`` avoids it).

    Args:
        every_n_steps: optimizer steps between fraction and update-underflow measurements; ``None`` takes the
            Trainer's ``log_every_n_steps``.
        reference_every_n_steps: optimizer steps between fp32 reference measurements; ``0`` turns them off.
        per_parameter: also log each parameter's values.
        update_underflow: measure the update underflow (it copies the fp32 masters before the step, at those steps).
        strict: re-raise internal errors instead of a warning that turns the failing statistic off (``None``: the
            environment variable ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Attributes:
        last_reference: the latest :class:`ReferenceStats`, on every rank.
        stored_stat, update_stat, reference_stat: the three statistics (``None`` until ``fit`` starts, and when
            not measured); ``stat.enabled`` is ``False`` once one failed.

    Example:
        ```python
        import lightning as L
        from lightning_mpt import MPTPrecision
        from lightning_mpt.callbacks import UnderflowMonitor

        trainer = L.Trainer(
            plugins=[MPTPrecision("fp16")], callbacks=[UnderflowMonitor(every_n_steps=50, reference_every_n_steps=500)]
        )
        ```
    """

    charts = (
        "headroom",
        "grad_classes",
        "update_underflow",
        "underflow_by_param",
        "subnormal_by_param",
        "overflow_by_param",
        "update_by_param",
    )

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        reference_every_n_steps: int = 500,
        per_parameter: bool = True,
        update_underflow: bool = True,
        strict: Optional[bool] = None,
    ) -> None:
        super().__init__(strict)
        self.every_n_steps = check_every("UnderflowMonitor", "every_n_steps", every_n_steps, allow_none=True)
        self.reference_every_n_steps = check_every(
            "UnderflowMonitor", "reference_every_n_steps", reference_every_n_steps, allow_zero=True
        )
        self.per_parameter = per_parameter
        self.update_underflow = update_underflow
        self.last_reference: Optional[ReferenceStats] = None
        self.stored_stat: Optional[StoredFractions] = None
        self.update_stat: Optional[UpdateUnderflow] = None
        self.reference_stat: Optional[FlushReference] = None
        self._every = 0
        self._reference_every = 0
        self._table: Optional[ParamTable] = None
        self._replay: Optional[_Replay] = None

    # ------------------------------------------------------------------------------------------------ set-up
    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stored_stat = self.update_stat = self.reference_stat = None
        self._table, self._reference_every = None, 0
        plugin = trainer.precision_plugin
        fmt = half_format(plugin)
        if fmt is None:
            self.warn_once(
                "format",
                f"UnderflowMonitor: the precision plugin {type(plugin).__name__} does not compute in fp16 or bf16;"
                " nothing is measured. Use MPTPrecision('fp16'/'bf16') or precision='16-mixed'/'bf16-mixed'.",
            )
            return
        table = ParamTable(pl_module, plugin, self.recorder.shards)
        if not len(table):
            self.warn_once("no half", f"UnderflowMonitor: no parameter is computed in {fmt.name}; nothing is measured.")
            return
        self._table = table
        log_every: int = getattr(trainer, "log_every_n_steps", 0)  # set by Lightning's logger connector
        self._every = self.every_n_steps or log_every or 1
        owner, strict, per_parameter = "UnderflowMonitor", self.strict, self.per_parameter
        self.stored_stat = StoredFractions(table.names, fmt, per_parameter, owner, strict)
        if self.update_underflow:
            self.update_stat = UpdateUnderflow(table.names, fmt, per_parameter, owner, strict)
        self._reference_every = self.reference_every_n_steps
        if self._reference_every and not pl_module.automatic_optimization:
            self.warn_once(
                "manual",
                "UnderflowMonitor: the fp32 reference needs automatic optimization; reference_every_n_steps is"
                " ignored under manual optimization.",
            )
            self._reference_every = 0
        if self._reference_every:
            self.reference_stat = FlushReference(table.names, fmt, per_parameter, owner, strict)

    # ------------------------------------------------------------------------------------------------ hooks
    # What decides whether a statistic is measured is the same on every rank (the step, the cadence, the table, the
    # recorder's liveness of the statistic), never whether it failed on this rank: under FSDP2 every rank must queue
    # the same values for the flush's collective, and the reference's decision precedes its collective.
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.group is not None and self._table is not None and due(trainer.global_step, self._reference_every):
            self._replay = _Replay(batch, batch_idx, rng_state())  # the state this batch's training_step starts from

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stat, table = self.stored_stat, self._table
        if not (self.measures(stat) and stat is not None and table is not None):
            return
        if not due(trainer.global_step, self._every) or accumulating(trainer, pl_module):
            return
        stat.measure(self.recorder, table.grads, trainer.global_step)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        table = self._table
        if self.group is None or table is None:
            return
        step = trainer.global_step
        stat = self.update_stat
        if self.measures(stat) and stat is not None and due(step, self._every):
            stat.snapshot(partial(table.masters, trainer.precision_plugin), step)
        if due(step, self._reference_every):  # every rank, also where the reference failed: they decide together
            replay, self._replay = self._replay, None
            self._reference(trainer, pl_module, replay, step)

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        if accumulating(trainer, pl_module):
            return
        self._replay = None
        if self.update_stat is not None:
            self.update_stat.measure(self.recorder)

    def release(self, trainer: pl.Trainer) -> None:
        if self.update_stat is not None:
            self.update_stat.discard()
        self._replay = None

    # ------------------------------------------------------------------------------------------------ the reference
    def _reference(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, replay: Optional[_Replay], step: int
    ) -> None:
        stat, table = self.reference_stat, self._table
        if stat is None or table is None or stat.retired:  # the same on every rank (retired: by all, together)
            return
        plugin = trainer.precision_plugin
        result = stat.measure(
            self.recorder,
            lambda: _reference_grads(trainer, pl_module, table, plugin, replay) if replay is not None else None,
            loss_scale(plugin),
            step,
            lambda ok: trainer.strategy.reduce_boolean_decision(ok, all=True),
            missing="had no batch to replay" if replay is None else None,
        )
        if result is not None:
            self.last_reference = result
        if stat.retired:  # not on enabled alone, which may be off on one rank only (until the ranks agree)
            self._reference_every = 0


# ---------------------------------------------------------------------------------------------------- the re-run
def _reference_grads(
    trainer: pl.Trainer, pl_module: pl.LightningModule, table: ParamTable, plugin: Any, replay: _Replay
) -> Optional[list[Optional[Tensor]]]:
    """fp32 gradients of the replayed batch's ``training_step`` loss for ``table``'s parameters, leaving every state
    as it was (:func:`~lightning_mpt.diagnostics.statistics.reference_gradients`); its ``self.log`` calls are
    discarded and the loss is normalised as Lightning's closure does under gradient accumulation."""
    with _discarded_logs(pl_module):
        return reference_gradients(
            pl_module,
            table,
            plugin,
            _training_step,
            (replay.batch, replay.batch_idx),
            rng=replay.rng,
            divisor=float(trainer.accumulate_grad_batches),
        )


def _training_step(module: pl.LightningModule, batch: Any, batch_idx: int) -> Any:
    return module.training_step(batch, batch_idx)


def _discard_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``LightningModule.log`` during the re-run: its values must not reach the loggers."""


@contextmanager
def _discarded_logs(pl_module: pl.LightningModule) -> Iterator[None]:
    had = "log" in pl_module.__dict__
    previous = pl_module.__dict__.get("log")
    pl_module.__dict__["log"] = _discard_log  # log_dict goes through log too
    try:
        yield
    finally:
        if had:
            pl_module.__dict__["log"] = previous
        else:
            del pl_module.__dict__["log"]
