"""``UnderflowStatistics``: what the half format does to a run's gradients and updates, set up and measured together.

Three statistics, each at its call point, each turning off alone on an internal error: the stored-gradient fractions
after the backward (:class:`~lightning_mpt.diagnostics.stored.StoredFractions`), the update underflow around the
optimizer step (:class:`~lightning_mpt.diagnostics.updates.UpdateUnderflow`) and the fp32 reference of a batch
(:class:`~lightning_mpt.diagnostics.reference.FlushReference`). The Trainer's ``UnderflowMonitor`` and Fabric's
``MixedPrecisionLogger`` drive them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Optional

from torch import Tensor, nn

from lightning_mpt.diagnostics.cadence import due
from lightning_mpt.diagnostics.params import ParamTable
from lightning_mpt.diagnostics.recorder import Recorder
from lightning_mpt.diagnostics.reference import FlushReference, ReferenceStats
from lightning_mpt.diagnostics.session import DiagnosticSession
from lightning_mpt.diagnostics.stored import StoredFractions
from lightning_mpt.diagnostics.updates import UpdateUnderflow

#: computes the fp32 reference gradients of the table's parameters (``None``: no loss to differentiate)
ReferenceGradients = Callable[[ParamTable], Optional[Sequence[Optional[Tensor]]]]


class UnderflowStatistics:
    """The stored-gradient fractions, the update underflow and the fp32 reference of one run.

    Args:
        every_n_steps: optimizer steps between fraction and update-underflow measurements.
        per_parameter: also write each parameter's values.
        update_underflow: measure the update underflow (it copies the fp32 masters before the step, at those steps).
        owner: who measures, for messages.
        strict: raise rather than warn when a statistic fails (``None``: ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Attributes:
        stored_stat, update_stat, reference_stat: the three statistics (``None`` when not measured).
        last_reference: the latest :class:`~lightning_mpt.diagnostics.reference.ReferenceStats`, on every process.
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        per_parameter: bool = True,
        update_underflow: bool = True,
        owner: str = "diagnostics",
        strict: Optional[bool] = None,
    ) -> None:
        self.every_n_steps = every_n_steps
        self.per_parameter = per_parameter
        self.update_underflow = update_underflow
        self.owner = owner
        self.strict = strict
        self.stored_stat: Optional[StoredFractions] = None
        self.update_stat: Optional[UpdateUnderflow] = None
        self.reference_stat: Optional[FlushReference] = None
        self.table: Optional[ParamTable] = None
        self.last_reference: Optional[ReferenceStats] = None

    def set_up(self, session: DiagnosticSession, module: nn.Module, plugin: Any, reference: bool = True) -> None:
        """Find the half parameters of ``module`` and make the statistics (the fp32 reference with ``reference``)."""
        self.stored_stat = self.update_stat = self.reference_stat = self.table = None
        found = session.half_parameters(module, plugin, self.owner, "nothing is measured")
        if found is None:
            return
        fmt, self.table = found
        names, args = self.table.names, (fmt, self.per_parameter, self.owner, self.strict)
        self.stored_stat = StoredFractions(names, *args)
        if self.update_underflow:
            self.update_stat = UpdateUnderflow(names, *args)
        if reference:
            self.reference_stat = FlushReference(names, *args)

    def after_backward(self, recorder: Recorder, step: int) -> None:
        """After the backward that completes the step's gradients: queue their fractions, at the cadence."""
        stat = self.stored_stat
        if stat is not None and self.table is not None and due(step, self.every_n_steps) and recorder.measures(stat):
            stat.measure(recorder, self.table.grads, step)

    def before_step(self, recorder: Recorder, plugin: Any, step: int) -> None:
        """Before the optimizer step: copy the masters for the update underflow, at the cadence."""
        stat = self.update_stat
        if stat is not None and self.table is not None and due(step, self.every_n_steps) and recorder.measures(stat):
            stat.snapshot(partial(self.table.masters, plugin), step)

    def after_step(self, recorder: Recorder) -> None:
        """After the optimizer step: queue the update underflow of a snapshot taken before it."""
        if self.update_stat is not None:
            self.update_stat.measure(recorder)

    def takes_reference(self) -> bool:
        """Whether the fp32 reference is still measured (the same on every process)."""
        return self.reference_stat is not None and self.table is not None and not self.reference_stat.retired

    def measure_reference(
        self,
        recorder: Recorder,
        gradients: ReferenceGradients,
        scale: float,
        step: int,
        agree: Callable[[bool], bool],
        missing: Optional[str] = None,
    ) -> Optional[ReferenceStats]:
        """Count the fp32 reference ``gradients(table)`` at ``scale``, reduce the counts across processes and queue
        them (see :meth:`FlushReference.measure`: every process must call it at the same steps)."""
        stat, table = self.reference_stat, self.table
        if stat is None or table is None or stat.retired:
            return None
        result = stat.measure(recorder, lambda: gradients(table), scale, step, agree, missing)
        if result is not None:
            self.last_reference = result
        return result

    def release(self) -> None:
        """Drop the masters' snapshot of a step that did not complete."""
        if self.update_stat is not None:
            self.update_stat.discard()
