"""``UnderflowMonitor``: what the half format does to the gradients and updates of each parameter.

The statistics are those of :class:`~lightning_mpt.diagnostics.underflow.UnderflowStatistics`; this module holds
what needs the Trainer: when to measure, and the fp32 re-run of ``training_step``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpt.callbacks._monitor import Monitor, accumulating
from lightning_mpt.diagnostics.cadence import check_every, due
from lightning_mpt.diagnostics.params import ParamTable
from lightning_mpt.diagnostics.plugin import backward_scale
from lightning_mpt.diagnostics.reference import FlushReference, ReferenceStats
from lightning_mpt.diagnostics.replay import reference_gradients, rng_state
from lightning_mpt.diagnostics.stored import StoredFractions
from lightning_mpt.diagnostics.underflow import UnderflowStatistics
from lightning_mpt.diagnostics.updates import UpdateUnderflow


@dataclass
class _Replay:
    """The batch of a reference step and the random state its ``training_step`` starts from."""

    batch: Any
    batch_idx: int
    rng: dict[str, Any]


class UnderflowMonitor(Monitor):
    """Log the fractions of gradient values that the half format zeroes, makes subnormal or overflows, the true
    flush fraction and scale headroom from an fp32 reference, and the share of weight updates a half-precision
    weight would lose (docs/concepts.md#definitions).

    Tags (global, and per parameter with ``/<param name>`` when ``per_parameter``): every ``every_n_steps``,
    ``mpt/grad_zero_fraction``, ``mpt/grad_subnormal_fraction``, ``mpt/grad_overflow_fraction``,
    ``mpt/stored_headroom`` and, unless the step was skipped, ``mpt/update_underflow_fraction``; every
    ``reference_every_n_steps``, ``mpt/grad_underflow_fraction`` and ``mpt/scale_headroom``.

    The reference re-runs ``training_step`` on the same batch in fp32 with the master weights and the random state
    the batch started with (taken in this callback's ``on_train_batch_start``, so dropout draws the same masks), and
    leaves weights, gradients, optimizer state, buffers, torchmetrics states and the random state as they were; its
    ``self.log`` calls are discarded. It costs about one fp32 forward and backward and needs automatic optimization;
    under gradient accumulation it measures the last micro-batch. Under FSDP2 every rank gathers the whole fp32
    weights for it: a transient fp32 copy of the model and of its gradients (see docs/diagnostics.md). A re-run that
    fails turns the reference off on every rank with a warning, and training goes on.

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
        self.statistics = UnderflowStatistics(1, per_parameter, update_underflow, "UnderflowMonitor", strict)
        self._replay: Optional[_Replay] = None

    @property
    def last_reference(self) -> Optional[ReferenceStats]:
        return self.statistics.last_reference

    @property
    def stored_stat(self) -> Optional[StoredFractions]:
        return self.statistics.stored_stat

    @property
    def update_stat(self) -> Optional[UpdateUnderflow]:
        return self.statistics.update_stat

    @property
    def reference_stat(self) -> Optional[FlushReference]:
        return self.statistics.reference_stat

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_every: int = getattr(trainer, "log_every_n_steps", 0)  # set by Lightning's logger connector
        self.statistics.every_n_steps = self.every_n_steps or log_every or 1
        manual = not pl_module.automatic_optimization
        reference = bool(self.reference_every_n_steps) and not manual
        self.statistics.set_up(self.session, pl_module, trainer.precision_plugin, reference)
        if self.statistics.table is not None and self.reference_every_n_steps and manual:
            self.session.warn_once(
                "UnderflowMonitor: the fp32 reference needs automatic optimization; reference_every_n_steps is"
                " ignored under manual optimization."
            )

    # Whether a statistic is measured depends on what every rank knows alike (the step, the cadence, the recorder's
    # liveness of the statistic), never on whether it failed on this rank: under FSDP2 every rank must queue the same
    # values for the flush's collective, and the reference's decision precedes its collective.
    def _reference_due(self, step: int) -> bool:
        return self.statistics.takes_reference() and due(step, self.reference_every_n_steps)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.group is not None and self._reference_due(trainer.global_step):
            self._replay = _Replay(batch, batch_idx, rng_state())  # the state this batch's training_step starts from

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on and not accumulating(trainer, pl_module):
            self.statistics.after_backward(self.recorder, trainer.global_step)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self.group is None:
            return
        step, plugin = trainer.global_step, trainer.precision_plugin
        if self.on:
            self.statistics.before_step(self.recorder, plugin, step)
        if not self._reference_due(step):  # the same on every rank, also where the reference failed
            return
        replay, self._replay = self._replay, None
        self.statistics.measure_reference(
            self.recorder,
            lambda table: _reference_grads(trainer, pl_module, table, plugin, replay) if replay is not None else None,
            backward_scale(plugin),
            step,
            lambda ok: trainer.strategy.reduce_boolean_decision(ok, all=True),
            missing="had no batch to replay" if replay is None else None,
        )

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        if accumulating(trainer, pl_module):
            return
        self._replay = None
        self.statistics.after_step(self.recorder)

    def release(self, trainer: pl.Trainer) -> None:
        self.statistics.release()
        self._replay = None


def _reference_grads(
    trainer: pl.Trainer, pl_module: pl.LightningModule, table: ParamTable, plugin: Any, replay: _Replay
) -> Optional[Sequence[Optional[Tensor]]]:
    """fp32 gradients of the replayed batch's ``training_step`` loss
    (:func:`~lightning_mpt.diagnostics.replay.reference_gradients`); its ``self.log`` calls are discarded and the loss
    is normalised as Lightning's closure does under gradient accumulation."""
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
