"""The Lightning side of the diagnostic callbacks: the ``Monitor`` base class and how the monitors of one Trainer
work together.

**Coordination.** The monitors of a Trainer share one
:class:`~lightning_mpt.diagnostics.session.DiagnosticSession` per fit (the writer, the one-sync read-out, the half
parameters). The first :class:`Monitor` in ``trainer.callbacks`` is the **owner**: its ``setup("fit")`` (Lightning
calls the callbacks' ``setup`` in list order, so it runs first) forms a :class:`MonitorGroup` of all of them and
hands it to each member (``monitor.group``).

**One host sync per logging step.** During a batch each member queues its device tensors on ``group.recorder``. At
the end of the batch each member reports to the group (:meth:`MonitorGroup.done`); when every member has reported,
the group flushes the read-out: one ``.tolist()`` for all statistics of all monitors, whatever the order of the
callbacks. The same barrier closes ``on_train_end`` (flush), ``on_exception`` and ``teardown`` (drop what is queued
and dissolve the group: a later fit forms a new one).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.fabric.loggers import TensorBoardLogger
from lightning.pytorch.callbacks import Callback

from lightning_mpt._compat import should_accumulate
from lightning_mpt.diagnostics.recorder import Recorder
from lightning_mpt.diagnostics.session import DiagnosticSession
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistic import Statistic


def trainer_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """``trainer.callbacks`` (an attribute Lightning's callback connector sets, which type checkers do not see)."""
    callbacks: list[Callback] = getattr(trainer, "callbacks", [])
    return callbacks


def accumulating(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether the backward that just ran is followed by more micro-batches before the optimizer step."""
    return pl_module.automatic_optimization and should_accumulate(trainer)


class MonitorGroup:
    """The monitors of one Trainer's fit and their :class:`DiagnosticSession`, writing to the Trainer's loggers.

    Formed by the owner (the first :class:`Monitor` in ``trainer.callbacks``) at ``setup("fit")``. Members report
    the end of each phase with :meth:`done`; the last one to report completes it.
    """

    def __init__(self, trainer: pl.Trainer, members: list[Monitor]) -> None:
        self.members = members
        self.session = DiagnosticSession.for_loggers(
            trainer.loggers, TensorBoardLogger, trainer.is_global_zero, strict=members[0].strict
        )
        self._done: dict[str, set[int]] = {}
        self._attached = False

    @property
    def recorder(self) -> Recorder:
        return self.session.recorder

    @property
    def owner(self) -> Monitor:
        return self.members[0]

    @classmethod
    def form(cls, trainer: pl.Trainer) -> MonitorGroup:
        """Form the group of the monitors in ``trainer.callbacks``, hand it to each of them, and write the dashboard
        layout with their charts and the ``mpt/data/run`` record."""
        members = [c for c in trainer_callbacks(trainer) if isinstance(c, Monitor)]
        group = cls(trainer, members)
        for m in members:
            m.group = group
        charts = [key for m in members for key in m.charts]
        names = [type(m).__name__ for m in members]
        group.session.write_header(trainer.precision_plugin, charts, names, trainer.global_step)
        return group

    def attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At ``on_fit_start``, once the model is set up (sharded by ``configure_model`` under FSDP2): whether the
        parameters are sharded (see :meth:`DiagnosticSession.shard`)."""
        if not self._attached:
            self._attached = True
            self.session.shard(pl_module, bool(trainer.loggers))

    def done(self, member: Monitor, phase: str) -> None:
        """``member`` finished its work of ``phase`` (``"batch"``, ``"train_end"``, ``"exception"``,
        ``"teardown"``); the last member to report completes the phase."""
        done = self._done.setdefault(phase, set())
        done.add(id(member))
        if len(done) < len(self.members):
            return
        del self._done[phase]
        if phase in ("batch", "train_end"):
            self.recorder.flush()
        else:  # "exception" (Lightning calls no teardown hooks after one) or "teardown": the fit is over
            self.session.release()
            for m in self.members:
                if m.group is self:
                    m.group = None


class Monitor(Callback):
    """Base of the diagnostic callbacks: joins the Trainer's :class:`MonitorGroup` at ``setup`` and reports the end
    of each batch to it.

    Subclasses implement :meth:`start` (at ``on_fit_start``), :meth:`batch_end` (at ``on_train_batch_end``, before
    the group flushes), :meth:`train_end`, :meth:`exception` and :meth:`release`, and drive their statistics on
    :attr:`session`. :attr:`setup_stat` guards the monitor's own work (``start``, ``batch_end``): an internal error
    there turns the monitor off alone.

    Args:
        strict: re-raise internal errors instead of turning the failing statistic off with a warning; ``None`` reads
            the environment variable ``LIGHTNING_MPT_STRICT_DIAGNOSTICS`` (``1`` for strict).
    """

    #: keys of :data:`lightning_mpt.diagnostics.dashboard.CHARTS` this monitor fills
    charts: tuple[str, ...] = ()

    def __init__(self, strict: Optional[bool] = None) -> None:
        self.strict = strict
        self.group: Optional[MonitorGroup] = None
        self.setup_stat = Statistic(type(self).__name__, "the monitor", strict)

    @property
    def session(self) -> DiagnosticSession:
        if self.group is None:
            raise RuntimeError(f"{type(self).__name__} is used outside a fit: its session exists from setup('fit') on.")
        return self.group.session

    @property
    def recorder(self) -> Recorder:
        return self.session.recorder

    @property
    def sink(self) -> Sink:
        return self.session.sink

    @property
    def on(self) -> bool:
        """Whether this monitor has a group to write to and has not failed as a whole (under sharded parameters: on
        any process, as every process must go on measuring until they all agree)."""
        if self.group is None:
            return False
        if self.group.recorder.sharded:
            return not self.setup_stat.retired
        return self.setup_stat.enabled

    # ----------------------------------------------------------------------------------------- Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        members = [c for c in trainer_callbacks(trainer) if isinstance(c, Monitor)]
        if members[0] is self:  # the owner: Lightning runs it before the other members' setup
            MonitorGroup.form(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.group is None:
            return
        self.group.attach(trainer, pl_module)
        self.session.warn_without_logger(type(self).__name__, "Trainer")
        with self.setup_stat.guarded():
            self.start(trainer, pl_module)
        shards = self.recorder.shards
        # every process set up, or none: the processes must queue the same statistics (one host read per fit)
        if shards is not None and not shards.agree(self.setup_stat.enabled):
            self.setup_stat.retire("failed to set up on another process")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.group is None:
            return
        try:
            if self.on:
                with self.setup_stat.guarded():
                    self.batch_end(trainer, pl_module, outputs)
        finally:
            self.group.done(self, "batch")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.group is None:
            return
        try:
            if self.setup_stat.enabled:
                with self.setup_stat.guarded():
                    self.train_end(trainer, pl_module)
        finally:
            self.group.done(self, "train_end")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.group is None:
            return
        try:
            if self.setup_stat.enabled:
                with self.setup_stat.guarded():
                    self.exception(trainer, pl_module, exception)
            self.release(trainer)
        finally:
            self.group.done(self, "exception")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.group is None:
            return
        self.release(trainer)
        self.group.done(self, "teardown")

    # ------------------------------------------------------------------------------------------ for subclasses
    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Set up the monitor's statistics at ``on_fit_start``."""

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        """What a monitor does at the end of a training batch, before the group flushes the read-out."""

    def train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """What a monitor does at the end of training, before the group flushes the read-out."""

    def exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """What a monitor records when training stopped with ``exception``."""

    def release(self, trainer: pl.Trainer) -> None:
        """Drop what a monitor holds between hooks (snapshots, batches)."""
