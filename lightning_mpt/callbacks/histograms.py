"""``GradientHistogramMonitor``: histograms of the unscaled gradients and exponent histograms of the stored ones."""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

import lightning.pytorch as pl

from lightning_mpt.callbacks import dashboard as tags
from lightning_mpt.callbacks._common import (
    Monitor,
    ParamTable,
    accumulating,
    check_every,
    due,
    half_format,
    histogram_buckets,
    module_name,
    shared,
)
from lightning_mpt.numerics import FloatFormat, exponent_bins, value_histograms
from lightning_mpt.precision import MPTPrecision

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
    ) -> None:
        super().__init__()
        self.every_n_steps = check_every("GradientHistogramMonitor", "every_n_steps", every_n_steps)
        if group_by not in _GROUPINGS:
            raise ValueError(f"GradientHistogramMonitor(group_by={group_by!r}): expected one of {list(_GROUPINGS)}.")
        self.group_by = group_by
        self.bins = check_every("GradientHistogramMonitor", "bins", bins)
        self.values = values
        self.exponents = exponents
        self._fmt: Optional[FloatFormat] = None
        self._table: Optional[ParamTable] = None
        self._exp_groups: list[str] = []
        self._exp_index: Optional[Tensor] = None  # half parameter -> its exponent group
        self._val_groups: list[tuple[str, list[tuple[str, Tensor]]]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if not self.sink.active:
            return
        plugin = trainer.precision_plugin
        self._fmt = half_format(plugin)
        self._val_groups = self._group(list(pl_module.named_parameters()))
        if self._fmt is None:
            if self.exponents:
                self.warn_once(
                    "format",
                    f"GradientHistogramMonitor: the precision plugin {type(plugin).__name__} does not compute in"
                    " fp16 or bf16; only the value histograms are written.",
                )
            return
        self._table = ParamTable(pl_module, plugin)
        names = [self._key(n) for n in self._table.names]
        self._exp_groups = list(dict.fromkeys(names))
        position = {g: i for i, g in enumerate(self._exp_groups)}
        self._exp_index = torch.tensor([position[n] for n in names], dtype=torch.long)
        if self.exponents:
            self._write_legend(self._fmt)

    def _key(self, param_name: str) -> str:
        return param_name if self.group_by == "parameter" else module_name(param_name)

    def _group(self, named: list[tuple[str, Tensor]]) -> list[tuple[str, list[tuple[str, Tensor]]]]:
        groups: dict[str, list[tuple[str, Tensor]]] = {}
        for name, p in named:
            groups.setdefault(self._key(name), []).append((name, p))
        return list(groups.items())

    # ------------------------------------------------------------------------------------------------ hooks
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if not (self.exponents and self._table is not None and self._fmt is not None and due(step, self.every_n_steps)):
            return
        if accumulating(trainer, pl_module):
            return
        hist = shared(trainer).stored_histograms(self._table, self._fmt)
        assert self._exp_index is not None
        grouped = torch.zeros(len(self._exp_groups), hist.shape[1], dtype=hist.dtype, device=hist.device)
        if self._exp_index.device != hist.device:
            self._exp_index = self._exp_index.to(hist.device)  # once: a host-to-device copy waits for the device
        grouped.index_add_(0, self._exp_index, hist)
        fmt = self._fmt
        shared(trainer).readout.add(grouped, lambda v: self._write_exponents(v, step, fmt))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        step = trainer.global_step
        if not (self.values and self._val_groups and self.sink.active and due(step, self.every_n_steps)):
            return
        plugin = trainer.precision_plugin
        # the true gradients: the masters' fp32 gradients under MPTPrecision, the (unscaled) .grad otherwise
        mpt = isinstance(plugin, MPTPrecision)
        names, groups = [], []
        for key, members in self._val_groups:
            grads = []
            for _, p in members:
                m = plugin.master_of(p) if mpt else p
                g = m.grad if m.grad is not None else p.grad
                if g is not None:
                    grads.append(g)
            if grads:
                names.append(key)
                groups.append(grads)
        if not groups:
            return
        stats = value_histograms(groups, self.bins)
        shared(trainer).readout.add(stats, lambda v: self._write_values(v, step, names))

    # ------------------------------------------------------------------------------------------------ writing
    def _write_values(self, v: list[float], step: int, names: list[str]) -> None:
        width = 5 + self.bins
        for i, name in enumerate(names):
            lo, hi, num, total, squares, *counts = v[i * width : (i + 1) * width]
            if num <= 0:
                continue  # no finite value to draw
            if hi > lo:
                step_ = (hi - lo) / self.bins
                limits = [lo + (k + 1) * step_ for k in range(self.bins)]
                limits[-1] = hi
            else:
                limits, counts = [hi], [num]
            limits, counts = histogram_buckets(limits, counts)
            self.sink.histogram_raw(
                f"{tags.GRAD_HIST}/{name}", step, min=lo, max=hi, num=num, sum=total, sum_squares=squares,
                bucket_limits=limits, bucket_counts=counts,
            )

    def _write_exponents(self, v: list[float], step: int, fmt: FloatFormat) -> None:
        nb = len(exponent_bins(fmt))
        lo_e, hi_e = fmt.min_exponent, fmt.max_exponent
        # x positions: zero bucket (lo_e-3, lo_e-2], gap, exponent e at (e, e+1], gap, non-finite (hi_e+3, hi_e+4]
        limits = [lo_e - 2, lo_e, *range(lo_e + 1, hi_e + 2), hi_e + 3, hi_e + 4]
        centers = [lo_e - 2.5, 0.0, *(e + 0.5 for e in range(lo_e, hi_e + 1)), 0.0, hi_e + 3.5]
        for i, name in enumerate(self._exp_groups):
            row = v[i * nb : (i + 1) * nb]
            num = sum(row)
            if num <= 0:
                continue
            counts = [row[0], 0.0, *row[1:-1], 0.0, row[-1]]
            total = sum(c * x for c, x in zip(counts, centers))
            squares = sum(c * x * x for c, x in zip(counts, centers))
            lim, cnt = histogram_buckets([float(x) for x in limits], counts)
            self.sink.histogram_raw(
                f"{tags.GRAD_EXPONENT}/{name}", step, min=float(lo_e - 3), max=float(hi_e + 4), num=num, sum=total,
                sum_squares=squares, bucket_limits=lim, bucket_counts=cnt,
            )

    def _write_legend(self, fmt: FloatFormat) -> None:
        lo, hi, normal = fmt.min_exponent, fmt.max_exponent, fmt.normal_exponent
        self.sink.scalars(
            {
                f"{tags.FORMAT_MARKS}/min_subnormal_exponent": lo,
                f"{tags.FORMAT_MARKS}/min_normal_exponent": normal,
                f"{tags.FORMAT_MARKS}/max_exponent": hi,
            },
            0,
        )
        self.sink.text(
            tags.EXPONENT_LEGEND,
            f"`mpt/grad_exponent/*`: stored {fmt.name} gradients (scaled), x = floor(log2|g|).\n\n"
            f"| x | meaning |\n|---|---|\n"
            f"| {lo - 3} to {lo - 2} | exact zeros |\n"
            f"| {lo} | min subnormal 2^{lo} = {fmt.min_subnormal:.3g} (smaller values flush to 0) |\n"
            f"| {lo} to {normal - 1} | subnormal: fewer significant bits |\n"
            f"| {normal} | min normal 2^{normal} = {fmt.min_normal:.3g} |\n"
            f"| {hi} | max exponent: max = {fmt.max:.6g} (larger values overflow to inf) |\n"
            f"| {hi + 3} to {hi + 4} | inf and NaN |",
            0,
        )
