"""The Lightning side of the diagnostic callbacks: the ``Monitor`` base class and how the monitors of one Trainer
work together.

**Coordination.** The monitors of a Trainer share one :class:`~lightning_mpt.diagnostics.statistics.Recorder` (the
writer, the one-sync read-out, the per-backward cache). They find each other at ``setup("fit")`` in
``trainer.callbacks``: the first :class:`Monitor` in that list is the **owner**; its ``setup`` (Lightning calls the
callbacks' ``setup`` in list order, so it runs first) forms a :class:`MonitorGroup` of all of them and hands it to
each member explicitly (``monitor.group``). The owner's group writes what is written once per fit (the dashboard
layout, the ``mpt/data/run`` record).

**One host sync per logging step.** During a batch, each member queues its device tensors on
``group.recorder``. At the end of the batch each member reports to the group (:meth:`MonitorGroup.done`); when every
member has reported, the group flushes the read-out: one ``.tolist()`` for all statistics of all monitors. This
barrier does not depend on the order of the callbacks. The same barrier closes ``on_train_end`` (flush),
``on_exception`` and ``teardown`` (drop what is queued and dissolve the group: every member's ``group`` is ``None``
again, and a later fit forms a new one).

Nothing is kept in module-level state keyed by the Trainer.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightning_mpt._compat import should_accumulate
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistics import Recorder, Shards, Statistic, describe_precision


def sink_for_trainer(trainer: pl.Trainer) -> Sink:
    """On global rank 0 the trainer's TensorBoard ``SummaryWriter`` s, every one (else its other loggers); nothing
    elsewhere."""
    return Sink.for_loggers(trainer.loggers) if trainer.is_global_zero else Sink()


def trainer_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """``trainer.callbacks`` (an attribute Lightning's callback connector sets, which type checkers do not see)."""
    callbacks: list[Callback] = getattr(trainer, "callbacks", [])
    return callbacks


def accumulating(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether the backward that just ran is followed by more micro-batches before the optimizer step."""
    return pl_module.automatic_optimization and should_accumulate(trainer)


# ------------------------------------------------------------------------------------------------- the group
class MonitorGroup:
    """The monitors of one Trainer's fit and what they share: a :class:`Recorder` writing to the Trainer's logger.

    Formed by the owner (the first :class:`Monitor` in ``trainer.callbacks``) at ``setup("fit")``. Members report
    the end of each phase with :meth:`done`; the last one to report completes it (see the module docstring).
    """

    def __init__(self, trainer: pl.Trainer, members: list[Monitor]) -> None:
        self.members = members
        self.recorder = Recorder(sink_for_trainer(trainer))
        self._done: dict[str, set[int]] = {}
        self._attached = False

    @property
    def sink(self) -> Sink:
        return self.recorder.sink

    @property
    def owner(self) -> Monitor:
        return self.members[0]

    @classmethod
    def form(cls, trainer: pl.Trainer) -> MonitorGroup:
        """Form the group of the monitors in ``trainer.callbacks``, hand it to each of them, and write what is
        written once per fit: the dashboard layout (once per ``SummaryWriter``) and the ``mpt/data/run`` record."""
        members = [c for c in trainer_callbacks(trainer) if isinstance(c, Monitor)]
        group = cls(trainer, members)
        for m in members:
            m.group = group
        header = Statistic("diagnostics", f"the dashboard layout and the {tags.RUN_RECORD} record", members[0].strict)
        with header.guarded():
            group.sink.layout([key for m in members for key in m.charts])
            run = {**describe_precision(trainer.precision_plugin), "monitors": [type(m).__name__ for m in members]}
            group.sink.record(tags.RUN_RECORD, run, trainer.global_step)
        return group

    def attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At ``on_fit_start`` (once the model is set up, sharded by ``configure_model`` under FSDP2): whether the
        parameters are sharded. Then every process measures its shards and the recorder reduces them across
        processes; every process measures when the Trainer has loggers (rank 0 writes)."""
        if self._attached:
            return
        self._attached = True
        stat = Statistic("diagnostics", "the set-up for sharded parameters (FSDP2)", self.owner.strict)
        try:
            shards = Shards.of(list(pl_module.parameters()))
        except Exception as error:
            self.recorder.active = False  # local numbers of shards would be wrong numbers: measure nothing
            with stat.guarded():
                raise error
            return
        if shards is not None:
            self.recorder.shards = shards
            self.recorder.active = bool(trainer.loggers)

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
            self.recorder.release()
            for m in self.members:
                if m.group is self:
                    m.group = None


# ------------------------------------------------------------------------------------------------- the base class
class Monitor(Callback):
    """Base of the diagnostic callbacks: joins the Trainer's :class:`MonitorGroup` at ``setup`` and reports the end
    of each batch to it.

    Subclasses implement :meth:`start` (at ``on_fit_start``), :meth:`batch_end` (at ``on_train_batch_end``, before
    the group flushes), :meth:`train_end` and :meth:`release`, and queue their device tensors on
    ``self.recorder``. Their :class:`~lightning_mpt.diagnostics.statistics.Statistic` objects turn off alone on an
    internal error; :attr:`setup_stat` guards the rest of the monitor (``start`` and ``batch_end``).

    Args:
        strict: re-raise internal errors instead of turning the failing statistic off with a warning; ``None`` reads
            the environment variable ``LIGHTNING_MPT_STRICT_DIAGNOSTICS`` (``1`` for strict).
    """

    #: keys of :data:`lightning_mpt.callbacks.dashboard.CHARTS` this monitor fills
    charts: tuple[str, ...] = ()

    def __init__(self, strict: Optional[bool] = None) -> None:
        self.strict = strict
        self.group: Optional[MonitorGroup] = None
        self.setup_stat = Statistic(type(self).__name__, "the monitor", strict)
        self._warned: set[str] = set()

    @property
    def recorder(self) -> Recorder:
        if self.group is None:
            raise RuntimeError(
                f"{type(self).__name__} is used outside a fit: its recorder exists from setup('fit') on."
            )
        return self.group.recorder

    @property
    def sink(self) -> Sink:
        return self.recorder.sink

    @property
    def on(self) -> bool:
        """Whether this monitor has a group to write to and has not failed as a whole (under sharded parameters: on
        any process, as every process must go on measuring until they all agree)."""
        if self.group is None:
            return False
        if self.group.recorder.sharded:
            return not self.setup_stat.retired
        return self.setup_stat.enabled

    def measures(self, stat: Optional[Statistic]) -> bool:
        """Whether this monitor measures ``stat`` at all (before the cadence): the monitor is on, the recorder
        measures, and the statistic still takes part (see :meth:`Recorder.live`). The same on every process under
        sharded parameters."""
        return stat is not None and self.on and self.recorder.active and self.recorder.live(stat)

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
        if trainer.is_global_zero and not self.sink.active:
            self.warn_once("logger", f"{type(self).__name__}: the Trainer has no logger; nothing will be recorded.")
        with self.setup_stat.guarded():
            self.start(trainer, pl_module)
        shards = self.recorder.shards
        if shards is not None:  # every process set up, or none: the processes must queue the same statistics
            failed = torch.tensor([0.0 if self.setup_stat.enabled else 1.0], device=shards.device)
            shards.all_reduce(failed, "max")
            if failed.item() > 0:  # one host read per monitor and fit
                self.setup_stat.retired = True
                if self.setup_stat.enabled:
                    self.setup_stat.enabled = False
                    self.warn_once("setup", f"{type(self).__name__}: set-up failed on another process; it is off.")

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

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)


# -------------------------------------------------------------------------------------------------- arguments
def check_every(owner: str, name: str, value: Any, allow_none: bool = False, allow_zero: bool = False) -> Any:
    """Validate a cadence argument; the error lists what is accepted."""
    if value is None and allow_none:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or (allow_zero and value == 0)):
        return value
    accepted = ["an int >= 1"]
    if allow_zero:
        accepted.append("0 (off)")
    if allow_none:
        accepted.append("None (the Trainer's log_every_n_steps)")
    raise ValueError(f"{owner}({name}={value!r}): expected {' or '.join(accepted)}.")


def due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0
