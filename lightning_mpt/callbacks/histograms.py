"""``GradientHistogramMonitor``: histograms of the unscaled gradients and exponent histograms of the stored ones."""

from __future__ import annotations

from typing import Literal, Optional

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_mpt.callbacks._monitor import Monitor, accumulating
from lightning_mpt.diagnostics.cadence import check_every
from lightning_mpt.diagnostics.histograms import GradientHistograms
from lightning_mpt.diagnostics.params import Group
from lightning_mpt.diagnostics.stored import ExponentHistograms
from lightning_mpt.diagnostics.values import ValueHistograms


class GradientHistogramMonitor(Monitor):
    """Every ``every_n_steps`` optimizer steps, write TensorBoard histograms of each parameter's (or module's)
    gradients: ``mpt/grad/<name>``, the true (unscaled, fp32) values the optimizer steps with, and
    ``mpt/grad_exponent/<name>``, the exponents ``floor(log2|g|)`` of the stored, scaled half-precision gradients.

    The exponent axis spans the whole format (:mod:`~lightning_mpt.diagnostics.exponent_axis`), so how close the
    values sit to flushing (left) or overflowing (right) reads off the chart; zeros and inf/NaN have buckets of their
    own beyond gaps. The format's marks are written once as scalars ``mpt/format/*`` and as the text
    ``mpt/legend/grad_exponent``.

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
        self.histograms = GradientHistograms(
            self.every_n_steps, group_by, bins, values, exponents, "GradientHistogramMonitor", strict
        )
        self.group_by, self.bins, self.values, self.exponents = group_by, bins, values, exponents

    @property
    def value_stat(self) -> ValueHistograms:
        return self.histograms.value_stat

    @property
    def exponent_stat(self) -> Optional[ExponentHistograms]:
        return self.histograms.exponent_stat

    @property
    def _val_groups(self) -> list[Group]:
        """The parameters each value histogram draws."""
        return self.histograms.groups

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.histograms.set_up(self.session, pl_module, trainer.precision_plugin)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on and not accumulating(trainer, pl_module):
            self.histograms.after_backward(self.recorder, trainer.global_step)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self.on:
            self.histograms.true_values(self.recorder, trainer.precision_plugin, trainer.global_step)
