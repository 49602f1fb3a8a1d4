"""``GradientHistogramMonitor``: histograms of the unscaled gradients and exponent histograms of the stored ones."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Literal, Optional

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpt.callbacks._common import Monitor, accumulating, check_every, due
from lightning_mpt.diagnostics.statistics import (
    ExponentHistograms,
    ParamTable,
    Shards,
    ValueHistograms,
    half_format,
    has_masters,
    local_tensor,
    module_name,
)

_GROUPINGS = ("parameter", "module")


class GradientHistogramMonitor(Monitor):
    """Every ``every_n_steps`` optimizer steps, write TensorBoard histograms of each parameter's (or module's)
    gradients: ``mpt/grad/<name>``, the true (unscaled, fp32) values the optimizer steps with, and
    ``mpt/grad_exponent/<name>``, the exponents ``floor(log2|g|)`` of the stored, scaled half-precision gradients.

    Exponent histogram layout (x axis in powers of two; fp16 numbers shown): one bucket per exponent from the
    format's min subnormal (-24) to its max (15; the min normal is -14); the bucket left of a gap (at -27) counts
    exact zeros and the bucket right of a gap (at 18) counts inf/NaN. The axis always spans the whole format, so
    how close the values sit to flushing (left) or overflowing (right) reads directly off the chart. The marks are
    also written once as scalars ``mpt/format/{min_subnormal,min_normal,max}_exponent`` and as the text
    ``mpt/legend/grad_exponent``. NaN and inf are counted, never plotted as values.

    Args:
        every_n_steps: optimizer steps between histograms.
        group_by: ``"parameter"`` for one histogram per parameter, ``"module"`` for one per module (its parameters
            together, e.g. a Linear's weight and bias).
        bins: buckets of the value histograms.
        values: write the value histograms (``mpt/grad/...``).
        exponents: write the exponent histograms (``mpt/grad_exponent/...``).
        strict: re-raise internal errors instead of a warning that turns the failing statistic (value or exponent
            histograms) off (``None``: the environment variable ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Example:
        ```python
        import lightning as L
        from lightning_mpt import MPTPrecision
        from lightning_mpt.callbacks import GradientHistogramMonitor

        trainer = L.Trainer(plugins=[MPTPrecision("fp16")], callbacks=[GradientHistogramMonitor(every_n_steps=100)])
        ```
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        group_by: Literal["parameter", "module"] = "parameter",
        bins: int = 32,
        values: bool = True,
        exponents: bool = True,
        strict: Optional[bool] = None,
    ) -> None:
        super().__init__(strict)
        self.every_n_steps = check_every("GradientHistogramMonitor", "every_n_steps", every_n_steps)
        if group_by not in _GROUPINGS:
            raise ValueError(f"GradientHistogramMonitor(group_by={group_by!r}): expected one of {list(_GROUPINGS)}.")
        self.group_by = group_by
        self.bins = check_every("GradientHistogramMonitor", "bins", bins)
        self.values = values
        self.exponents = exponents
        self.value_stat = ValueHistograms([], self.bins, owner="GradientHistogramMonitor", strict=strict)
        self.exponent_stat: Optional[ExponentHistograms] = None
        self._table: Optional[ParamTable] = None
        self._val_groups: list[tuple[str, list[tuple[str, Tensor]]]] = []

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.exponent_stat, self._table, self._val_groups = None, None, []
        self.value_stat = ValueHistograms([], self.bins, owner="GradientHistogramMonitor", strict=self.strict)
        if not self.recorder.active:
            return
        plugin = trainer.precision_plugin
        fmt = half_format(plugin)
        if self.values:
            self._val_groups = self._group(list(pl_module.named_parameters()))
            self.value_stat = ValueHistograms(
                [key for key, _ in self._val_groups], self.bins, owner="GradientHistogramMonitor", strict=self.strict
            )
        if not self.exponents:
            return
        if fmt is None:
            self.warn_once(
                "format",
                f"GradientHistogramMonitor: the precision plugin {type(plugin).__name__} does not compute in"
                " fp16 or bf16; only the value histograms are written.",
            )
            return
        table = ParamTable(pl_module, plugin, self.recorder.shards)
        if not len(table):
            self.warn_once(
                "no half",
                f"GradientHistogramMonitor: no parameter is computed in {fmt.name}; only the value histograms are"
                " written.",
            )
            return
        self._table = table
        self.exponent_stat = ExponentHistograms(
            [self._key(n) for n in table.names], fmt, owner="GradientHistogramMonitor", strict=self.strict
        )
        self.exponent_stat.write_legend(self.sink)

    def _key(self, param_name: str) -> str:
        return param_name if self.group_by == "parameter" else module_name(param_name)

    def _group(self, named: list[tuple[str, Tensor]]) -> list[tuple[str, list[tuple[str, Tensor]]]]:
        groups: dict[str, list[tuple[str, Tensor]]] = {}
        for name, p in named:
            groups.setdefault(self._key(name), []).append((name, p))
        return list(groups.items())

    # ------------------------------------------------------------------------------------------------ hooks
    # What decides whether a statistic is measured is the same on every rank (see UnderflowMonitor).
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stat, table = self.exponent_stat, self._table
        if not (self.measures(stat) and stat is not None and table is not None):
            return
        if not due(trainer.global_step, self.every_n_steps) or accumulating(trainer, pl_module):
            return
        stat.measure(self.recorder, table.grads, trainer.global_step)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        step = trainer.global_step
        if not (self.measures(self.value_stat) and self._val_groups and due(step, self.every_n_steps)):
            return
        grads = partial(true_gradients, trainer.precision_plugin, self._val_groups, self.recorder.shards)
        self.value_stat.measure(self.recorder, grads, step)


def true_gradients(
    plugin: Any, groups: Sequence[tuple[str, Sequence[tuple[str, Tensor]]]], shards: Optional[Shards] = None
) -> list[list[Tensor]]:
    """The true (unscaled) gradients of each group's parameters: the masters' fp32 gradients under ``MPTPrecision``,
    the (unscaled) ``.grad`` otherwise; this process's shards under FSDP2 (:meth:`Shards.owns`). A parameter without
    one is left out."""
    masters = has_masters(plugin)
    out = []
    for _, members in groups:
        grads = []
        for _, p in members:
            m = plugin.master_of(p) if masters else p
            g = m.grad if m.grad is not None else p.grad
            if g is not None and (shards is None or shards.owns(p)):
                grads.append(local_tensor(g))
        out.append(grads)
    return out
