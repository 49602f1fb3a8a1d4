"""``GradientHistograms``: the value and exponent histograms of a run's gradients, set up and measured together.

The values are drawn unscaled (``mpt/grad/<name>``) from the masters' gradients after the plugin unscaled them, or
from the stored gradients divided by the scale; the exponents (``mpt/grad_exponent/<name>``) are those of the stored,
scaled half gradients. The Trainer's ``GradientHistogramMonitor`` and Fabric's ``MixedPrecisionLogger`` drive them.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

from torch import nn

from lightning_mpt.diagnostics.cadence import check_choice, check_every, due
from lightning_mpt.diagnostics.params import (
    GROUPINGS,
    Group,
    GroupBy,
    ParamTable,
    group_key,
    group_parameters,
    stored_gradients,
    true_gradients,
)
from lightning_mpt.diagnostics.plugin import backward_scale
from lightning_mpt.diagnostics.recorder import Recorder
from lightning_mpt.diagnostics.session import DiagnosticSession
from lightning_mpt.diagnostics.stored import ExponentHistograms
from lightning_mpt.diagnostics.values import ValueHistograms


class GradientHistograms:
    """The gradient value histograms and the exponent histograms of one run.

    Args:
        every_n_steps: optimizer steps between histograms; ``0``: none.
        group_by: ``"parameter"`` for one histogram per parameter, ``"module"`` for one per module.
        bins: buckets of the value histograms.
        values: draw the value histograms.
        exponents: draw the exponent histograms.
        owner: who measures, for messages and argument errors.
        strict: raise rather than warn when a statistic fails (``None``: ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Attributes:
        value_stat, exponent_stat: the two statistics (``exponent_stat`` is ``None`` when not measured).
        groups: the parameters each value histogram draws, ``(name, [(parameter name, parameter), ...])``.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        group_by: GroupBy = "parameter",
        bins: int = 32,
        values: bool = True,
        exponents: bool = True,
        owner: str = "diagnostics",
        strict: Optional[bool] = None,
    ) -> None:
        self.every_n_steps = every_n_steps
        self.group_by: GroupBy = check_choice(owner, "group_by", group_by, GROUPINGS)
        self.bins: int = check_every(owner, "bins", bins)
        self.values = values
        self.exponents = exponents
        self.owner = owner
        self.strict = strict
        self.value_stat = ValueHistograms([], bins, owner, strict)
        self.exponent_stat: Optional[ExponentHistograms] = None
        self.groups: list[Group] = []
        self.table: Optional[ParamTable] = None

    def set_up(self, session: DiagnosticSession, module: nn.Module, plugin: Any) -> None:
        """Group the parameters of ``module`` and make the statistics; write the exponent histograms' legend."""
        self.exponent_stat, self.table, self.groups = None, None, []
        self.value_stat = ValueHistograms([], self.bins, self.owner, self.strict)
        if not self.every_n_steps:
            return
        if self.values:
            self.groups = group_parameters(module.named_parameters(), self.group_by)
            self.value_stat = ValueHistograms([key for key, _ in self.groups], self.bins, self.owner, self.strict)
        if not self.exponents:
            return
        found = session.half_parameters(module, plugin, self.owner, "only the value histograms are written")
        if found is None:
            return
        fmt, self.table = found
        groups = [group_key(n, self.group_by) for n in self.table.names]
        self.exponent_stat = ExponentHistograms(groups, fmt, self.owner, self.strict)
        self.exponent_stat.write_legend(session.sink)

    def after_backward(self, recorder: Recorder, step: int) -> None:
        """After the backward that completes the step's gradients: queue their exponent histograms, at the cadence."""
        stat = self.exponent_stat
        if stat is not None and self.table is not None and due(step, self.every_n_steps) and recorder.measures(stat):
            stat.measure(recorder, self.table.grads, step)

    def true_values(self, recorder: Recorder, plugin: Any, step: int) -> None:
        """Once the plugin unscaled the gradients (before the optimizer step): queue their value histograms."""
        if self.groups and due(step, self.every_n_steps) and recorder.measures(self.value_stat):
            grads = partial(true_gradients, plugin, self.groups, recorder.shards)
            self.value_stat.measure(recorder, grads, step)

    def stored_values(self, recorder: Recorder, plugin: Any, step: int) -> None:
        """After the backward: queue the value histograms of the stored gradients, drawn unscaled."""
        if self.groups and due(step, self.every_n_steps) and recorder.measures(self.value_stat):
            grads = partial(stored_gradients, self.groups, recorder.shards)
            self.value_stat.measure(recorder, grads, step, scale=backward_scale(plugin))
