"""``UnderflowMonitor``: what the half format does to the gradients and updates of each parameter.

Three measurements, each at its own cadence:

* every ``every_n_steps``: zero, subnormal and overflow fractions of the stored (scaled) half gradients, and the
  headroom of the largest stored value, from the gradients as the backward left them;
* at the same steps: the update underflow fraction, from the fp32 masters before and after the optimizer step;
* every ``reference_every_n_steps``: the true flush (underflow) fraction and the scale headroom, from an fp32
  reference gradient of the same batch computed with the masters. Each rank measures its own backward; the counts
  are summed (and the maxima taken) across ranks by :class:`FlushStatistics`, a torchmetrics ``Metric``.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer
from torchmetrics import Metric

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_mpt.callbacks import dashboard as tags
from lightning_mpt.callbacks._common import (
    Monitor,
    ParamTable,
    accumulating,
    check_every,
    due,
    half_format,
    loss_scale,
    ratio,
    shared,
)
from lightning_mpt.master import HALF_DTYPES
from lightning_mpt.numerics import FloatFormat, flush_counts, max_abs, stored_counts, update_underflow_counts


class FlushStatistics(Metric):
    """Per-parameter flush counts of fp32 reference gradients, reduced across processes: ``nonzero`` and
    ``flushed`` are summed, ``max_scaled`` (the largest scaled gradient) is maxed.

    Example:
        ```python
        import torch
        from lightning_mpt.callbacks import FlushStatistics

        m = FlushStatistics(num_params=2)
        m.update(torch.tensor([[4, 1], [10, 0]]), torch.tensor([3.0, 70000.0]))
        nonzero, flushed, max_scaled = m.compute()
        assert flushed.tolist() == [1, 0] and max_scaled.max().item() == 70000.0
        ```
    """

    full_state_update = False

    def __init__(self, num_params: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("nonzero", torch.zeros(num_params, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("flushed", torch.zeros(num_params, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("max_scaled", torch.zeros(num_params), dist_reduce_fx="max")

    def update(self, counts: Tensor, max_scaled: Tensor) -> None:  # type: ignore[override]
        """``counts``: ``(P, 2)`` rows of ``(nonzero, flushed)`` (:func:`~lightning_mpt.numerics.flush_counts`);
        ``max_scaled``: ``(P,)`` largest ``|gradient * scale|`` per parameter."""
        self.nonzero += counts[:, 0].to(self.nonzero)
        self.flushed += counts[:, 1].to(self.flushed)
        self.max_scaled = torch.maximum(self.max_scaled, max_scaled.to(self.max_scaled))

    def compute(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.nonzero, self.flushed, self.max_scaled


@dataclass
class ReferenceStats:
    """The latest fp32 reference measurement (device tensors; every rank holds its own ``local_*`` values)."""

    step: int
    scale: float
    names: list[str]
    local_nonzero: Tensor
    local_flushed: Tensor
    nonzero: Tensor  # summed over ranks
    flushed: Tensor
    max_scaled: Tensor  # maxed over ranks

    @property
    def flush_fraction(self) -> float:
        """Flushed over nonzero values, all parameters and ranks (NaN without nonzero values; one host sync)."""
        nonzero = float(self.nonzero.sum())
        return float(self.flushed.sum()) / nonzero if nonzero else math.nan


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
    callbacks' or the module's ``on_train_batch_start``) would give the re-run other dropout masks.

    Measuring the update underflow copies the fp32 masters before the step, at those steps only: 4 bytes per
    parameter of transient memory (``update_underflow=False`` avoids it).

    Args:
        every_n_steps: optimizer steps between fraction and update-underflow measurements; ``None`` takes the
            Trainer's ``log_every_n_steps``.
        reference_every_n_steps: optimizer steps between fp32 reference measurements; ``0`` turns them off.
        per_parameter: also log each parameter's values.
        update_underflow: measure the update underflow (it copies the fp32 masters before the step, at those steps).

    Attributes:
        last_reference: the latest :class:`ReferenceStats`, on every rank.

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
    ) -> None:
        super().__init__()
        self.every_n_steps = check_every("UnderflowMonitor", "every_n_steps", every_n_steps, allow_none=True)
        self.reference_every_n_steps = check_every(
            "UnderflowMonitor", "reference_every_n_steps", reference_every_n_steps, allow_zero=True
        )
        self.per_parameter = per_parameter
        self.update_underflow = update_underflow
        self.last_reference: Optional[ReferenceStats] = None
        self._fmt: Optional[FloatFormat] = None
        self._every = 0
        self._reference_every = 0
        self._table: Optional[ParamTable] = None
        self._metric: Optional[FlushStatistics] = None
        self._replay: Optional[_Replay] = None
        self._snapshot: Optional[tuple[int, list[int], list[Tensor], list[Tensor]]] = None

    # ------------------------------------------------------------------------------------------------ set-up
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        plugin = trainer.precision_plugin
        self._fmt = half_format(plugin)
        if self._fmt is None:
            self.warn_once(
                "format",
                f"UnderflowMonitor: the precision plugin {type(plugin).__name__} does not compute in fp16 or bf16;"
                " nothing is measured. Use MPTPrecision('fp16'/'bf16') or precision='16-mixed'/'bf16-mixed'.",
            )
            return
        self._table = ParamTable(pl_module, plugin)
        self._every = self.every_n_steps or trainer.log_every_n_steps or 1
        self._reference_every = self.reference_every_n_steps
        if self._reference_every and not pl_module.automatic_optimization:
            self.warn_once(
                "manual",
                "UnderflowMonitor: the fp32 reference needs automatic optimization; reference_every_n_steps is"
                " ignored under manual optimization.",
            )
            self._reference_every = 0
        if self._reference_every:
            self._metric = FlushStatistics(len(self._table)).to(pl_module.device)

    @property
    def _on(self) -> bool:
        return self._fmt is not None and self._table is not None

    # ------------------------------------------------------------------------------------------------ hooks
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._on and due(trainer.global_step, self._reference_every):
            self._replay = _Replay(batch, batch_idx, _rng_state())  # the state this batch's training_step starts from

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if not (self._on and self.sink.active and due(step, self._every)) or accumulating(trainer, pl_module):
            return
        assert self._table is not None and self._fmt is not None
        counts = stored_counts(shared(trainer).stored_histograms(self._table, self._fmt), self._fmt)
        grads = [g for g in self._table.grads() if g is not None]
        top = max_abs(grads).amax() if grads else torch.zeros((), device=counts.device)
        values = torch.cat([counts.reshape(-1).to(torch.float64), top.reshape(1).to(counts.device, torch.float64)])
        shared(trainer).readout.add(values, lambda v: self._write_stored(v, step))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        if not self._on:
            return
        step = trainer.global_step
        if self.update_underflow and self._snapshot is None and self.sink.active and due(step, self._every):
            assert self._table is not None
            masters = self._table.masters(trainer.precision_plugin)
            index = [i for i, m in enumerate(masters) if m is not None]
            current = [masters[i].detach() for i in index]  # type: ignore[union-attr]
            if current:
                old = [torch.empty_like(m) for m in current]
                torch._foreach_copy_(old, current)
                self._snapshot = (step, index, current, old)
        if self._replay is not None and due(step, self._reference_every):
            replay, self._replay = self._replay, None
            self._reference(trainer, pl_module, replay, step)

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        if accumulating(trainer, pl_module):
            return
        self._replay = None
        if self._snapshot is None:
            return
        step, index, current, old = self._snapshot
        self._snapshot = None
        assert self._fmt is not None
        counts = update_underflow_counts(old, current, self._fmt)  # the masters hold the stepped values now
        shared(trainer).readout.add(counts, lambda v: self._write_update(v, step, index))

    def release(self, trainer: pl.Trainer) -> None:
        self._snapshot = None
        self._replay = None

    # ------------------------------------------------------------------------------------------------ the reference
    def _reference(self, trainer: pl.Trainer, pl_module: pl.LightningModule, replay: _Replay, step: int) -> None:
        assert self._table is not None and self._fmt is not None and self._metric is not None
        plugin = trainer.precision_plugin
        scale = loss_scale(plugin)
        grads: Optional[list[Optional[Tensor]]] = None
        error: Optional[BaseException] = None
        try:
            grads = _reference_grads(trainer, pl_module, self._table, plugin, replay)
        except Exception as e:  # a model the fp32 re-run does not suit must not stop training
            error = e
        # every rank must agree before the collective in compute(): one failing rank would leave the others waiting
        if not trainer.strategy.reduce_boolean_decision(grads is not None, all=True):
            self._reference_every = 0
            self.warn_once(
                "reference",
                "UnderflowMonitor: the fp32 reference step failed"
                + (f" ({type(error).__name__}: {error})" if error else " (training_step returned no loss)")
                + "; flush fractions and scale headroom are off for the rest of this run.",
            )
            return
        assert grads is not None
        counts = flush_counts(grads, scale, self._fmt)
        device = counts.device
        zero = torch.zeros((), device=device)
        maxima = torch.stack([zero if g is None else m for g, m in zip(grads, _max_abs_or_none(grads, device))]) * scale
        metric = self._metric
        metric.update(counts, maxima)
        nonzero, flushed, max_scaled = (t.clone() for t in metric.compute())  # reduced across ranks
        metric.reset()
        self.last_reference = ReferenceStats(
            step, scale, self._table.names, counts[:, 0], counts[:, 1], nonzero, flushed, max_scaled
        )
        if self.sink.active:
            values = torch.cat([nonzero.double(), flushed.double(), max_scaled.double()])
            shared(trainer).readout.add(values, lambda v: self._write_reference(v, step))

    # ------------------------------------------------------------------------------------------------ writing
    def _write_stored(self, v: list[float], step: int) -> None:
        assert self._table is not None and self._fmt is not None
        n = len(self._table)
        rows = [v[5 * i : 5 * i + 5] for i in range(n)]
        values: dict[str, Optional[float]] = {}

        def fractions(suffix: str, numel: float, zero: float, sub: float, nzf: float, over: float) -> None:
            values[tags.GRAD_ZERO + suffix] = ratio(zero, numel)
            values[tags.GRAD_SUBNORMAL + suffix] = ratio(sub, nzf)
            values[tags.GRAD_OVERFLOW + suffix] = ratio(over, numel)

        totals = [sum(col) for col in zip(*rows)] if rows else [0.0] * 5
        fractions("", *totals)
        if self.per_parameter:
            for name, row in zip(self._table.names, rows):
                fractions("/" + name, *row)
        top = v[5 * n]
        if 0 < top < math.inf:
            values[tags.STORED_HEADROOM] = math.log2(self._fmt.max / top)
        self.sink.scalars({k: x for k, x in values.items() if x is not None}, step)

    def _write_update(self, v: list[float], step: int, index: list[int]) -> None:
        assert self._table is not None
        changed, lost = v[0::2], v[1::2]
        values = {tags.UPDATE_UNDERFLOW: ratio(sum(lost), sum(changed))}
        if self.per_parameter:
            for i, c, l in zip(index, changed, lost):
                values[f"{tags.UPDATE_UNDERFLOW}/{self._table.names[i]}"] = ratio(l, c)
        self.sink.scalars({k: x for k, x in values.items() if x is not None}, step)

    def _write_reference(self, v: list[float], step: int) -> None:
        assert self._table is not None and self._fmt is not None
        n = len(self._table)
        nonzero, flushed, max_scaled = v[:n], v[n : 2 * n], v[2 * n :]
        values = {tags.GRAD_UNDERFLOW: ratio(sum(flushed), sum(nonzero))}
        if self.per_parameter:
            for name, z, f in zip(self._table.names, nonzero, flushed):
                values[f"{tags.GRAD_UNDERFLOW}/{name}"] = ratio(f, z)
        top = max(max_scaled, default=0.0) if all(map(math.isfinite, max_scaled)) else math.nan
        if 0 < top < math.inf:  # a NaN/inf in the fp32 reference itself: no headroom to speak of
            values[tags.SCALE_HEADROOM] = math.log2(self._fmt.max / top)  # negative: the scale overflows
        self.sink.scalars({k: x for k, x in values.items() if x is not None}, step)


# ---------------------------------------------------------------------------------------------------- the re-run
def _reference_grads(
    trainer: pl.Trainer, pl_module: pl.LightningModule, table: ParamTable, plugin: Any, replay: _Replay
) -> Optional[list[Optional[Tensor]]]:
    """fp32 gradients of the replayed batch's loss for ``table``'s parameters, leaving every state as it was.

    The fp32 weights stand in for the module's parameters through ``torch.func.functional_call``, which swaps
    module attributes: the parameters themselves (their data, gradients and autograd accumulators, which DDP
    hooks) are never touched.
    """
    weights = {
        n: (m.detach() if m is not None else p.detach().float()).requires_grad_(p.requires_grad)
        for n, p, m in zip(table.names, table.params, table.masters(plugin))
    }
    # other half parameters ("16-true" norm layers) run in fp32 too
    weights.update(
        {n: p.detach().float() for n, p in pl_module.named_parameters() if p.dtype in HALF_DTYPES and n not in weights}
    )
    batch = apply_to_collection(replay.batch, Tensor, lambda t: t.float() if t.is_floating_point() else t)
    with ExitStack() as stack:
        stack.enter_context(_restored_state(pl_module))
        stack.enter_context(_replayed_rng(replay.rng))
        stack.enter_context(_discarded_logs(pl_module))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autocast(pl_module.device.type, enabled=False))
        out = torch.func.functional_call(
            _TrainingStep(pl_module), {f"module.{n}": w for n, w in weights.items()}, (batch, replay.batch_idx),
            strict=False,
        )
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            return None
        loss = loss / trainer.accumulate_grad_batches  # as Lightning's closure normalises it
        wanted = [i for i, p in enumerate(table.params) if p.requires_grad]
        found = torch.autograd.grad(loss, [weights[table.names[i]] for i in wanted], allow_unused=True)
    grads: list[Optional[Tensor]] = [None] * len(table)
    for i, g in zip(wanted, found):
        grads[i] = g
    return grads


class _TrainingStep(torch.nn.Module):
    """``module.training_step`` as a forward, so that ``torch.func.functional_call`` can run it."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self.module.training_step(batch, batch_idx)


def _max_abs_or_none(grads: list[Optional[Tensor]], device: torch.device) -> list[Optional[Tensor]]:
    present = [g for g in grads if g is not None]
    maxima = iter(max_abs(present).to(device)) if present else iter(())
    return [None if g is None else next(maxima) for g in grads]


@contextmanager
def _restored_state(pl_module: pl.LightningModule) -> Iterator[None]:
    """Restore buffers (BatchNorm running statistics) and torchmetrics states the re-run may update."""
    buffers = [(m, name, b, b.clone()) for m in pl_module.modules() for name, b in m._buffers.items() if b is not None]
    metrics = [(m, _metric_state(m)) for m in pl_module.modules() if isinstance(m, Metric)]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, copy in buffers:
                m._buffers[name] = b
                b.copy_(copy)
        for m, state in metrics:
            for k, v in state.items():
                setattr(m, k, v)


_METRIC_PRIVATE = ("_update_count", "_computed", "_forward_cache", "_is_synced", "_cache")


def _metric_state(m: Metric) -> dict[str, Any]:
    state = {k: (v.clone() if isinstance(v, Tensor) else list(v)) for k, v in m.metric_state.items()}
    state.update({k: m.__dict__[k] for k in _METRIC_PRIVATE if k in m.__dict__})
    return state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


@contextmanager
def _replayed_rng(state: dict[str, Any]) -> Iterator[None]:
    """Run with the RNG state ``state`` (same dropout masks as the real step), then continue where training was."""
    now = _rng_state()
    _set_rng_state(state)
    try:
        yield
    finally:
        _set_rng_state(now)


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
