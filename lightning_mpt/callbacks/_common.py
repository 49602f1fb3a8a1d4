"""Machinery shared by the diagnostic callbacks: where to write, what the precision plugin exposes, which parameters
are computed in half precision, and the one host read-out per step that all monitors share."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Callable, Optional
from weakref import WeakKeyDictionary

import torch
from tensorboard.compat.proto.summary_pb2 import Summary
from torch import Tensor

import lightning.pytorch as pl
from lightning.fabric.loggers.tensorboard import TensorBoardLogger
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mpt.master import DEFAULT_KEEP_FP32, HALF_DTYPES
from lightning_mpt.numerics import BF16, FP16, FloatFormat, exponent_histograms, format_of
from lightning_mpt.precision import MPTPrecision


# ---------------------------------------------------------------------------------------------- the precision plugin
def half_format(plugin: Any) -> Optional[FloatFormat]:
    """The half-precision format the plugin computes in: fp16 or bf16, ``None`` for full precision."""
    if isinstance(plugin, MPTPrecision):
        return format_of(plugin.half_dtype)
    precision = str(getattr(plugin, "precision", ""))
    if precision.startswith("16"):
        return FP16
    if precision.startswith("bf16"):
        return BF16
    return None


def grad_scaler(plugin: Any) -> Optional[torch.amp.GradScaler]:
    """The :class:`torch.amp.GradScaler` of Lightning's ``MixedPrecision`` plugin, if any."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def loss_scale(plugin: Any) -> float:
    """The loss scale the current step's gradients were computed with (read before the scaler updates)."""
    if isinstance(plugin, MPTPrecision):
        return plugin.backward_scale
    scaler = grad_scaler(plugin)
    return scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0


def accumulating(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether the backward that just ran is followed by more micro-batches before the optimizer step."""
    return bool(pl_module.automatic_optimization and trainer.fit_loop._should_accumulate())


class ParamTable:
    """The parameters computed in the half format, in ``named_parameters()`` order.

    Under :class:`MPTPrecision` these are the parameters the plugin cast to fp16/bf16 (norm layers stay fp32 and are
    left out). Under Lightning's autocast precisions every parameter is fp32, and the gradients of the layers that
    autocast runs in half precision are formed from half-precision values: all parameters except those of norm layers.
    """

    def __init__(self, pl_module: pl.LightningModule, plugin: Any) -> None:
        mpt = isinstance(plugin, MPTPrecision)
        kept = {id(p) for m in pl_module.modules() if isinstance(m, DEFAULT_KEEP_FP32) for p in m.parameters()}
        self.names: list[str] = []
        self.params: list[Tensor] = []
        for name, p in pl_module.named_parameters():
            if (p.dtype in HALF_DTYPES) if mpt else (p.is_floating_point() and id(p) not in kept):
                self.names.append(name)
                self.params.append(p)

    def __len__(self) -> int:
        return len(self.params)

    def grads(self) -> list[Optional[Tensor]]:
        return [p.grad for p in self.params]

    def masters(self, plugin: Any) -> list[Optional[Tensor]]:
        """The fp32 tensor the optimizer steps for each parameter, ``None`` where the half tensor is stepped itself
        (``MPTPrecision(master_weights=False)``, ``"16-true"``)."""
        if isinstance(plugin, MPTPrecision):
            return [m if m is not p else None for p, m in ((p, plugin.master_of(p)) for p in self.params)]
        return [p if p.dtype == torch.float32 else None for p in self.params]


def module_name(param_name: str) -> str:
    """``"encoder.0.linear.weight"`` -> ``"encoder.0.linear"``; a parameter of the root module -> ``"(root)"``."""
    owner, _, _ = param_name.rpartition(".")
    return owner or "(root)"


# ------------------------------------------------------------------------------------------------------ the writer
class Sink:
    """Where a monitor writes: the trainer's TensorBoard ``SummaryWriter`` on global rank 0, nothing elsewhere.

    Without a TensorBoard logger, scalars go to the other loggers' ``log_metrics`` (histograms and text need
    TensorBoard and are dropped).
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.writer: Any = None
        self.loggers: list[Any] = []
        if not trainer.is_global_zero:
            return
        tb = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if tb is not None:
            self.writer = tb.experiment
        else:
            self.loggers = list(trainer.loggers)

    @property
    def active(self) -> bool:
        return self.writer is not None or bool(self.loggers)

    def scalars(self, values: dict[str, float], step: int) -> None:
        values = {k: float(v) for k, v in values.items() if v is not None}
        if not values:
            return
        if self.writer is not None:
            # one event holding every value: one hand-off to the writer thread instead of one per tag
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()])
            self.writer._get_file_writer().add_summary(summary, step)
        for logger in self.loggers:
            logger.log_metrics(values, step)

    def histogram_raw(self, tag: str, step: int, **kwargs: Any) -> None:
        if self.writer is not None:
            self.writer.add_histogram_raw(tag, global_step=step, **kwargs)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)


def histogram_buckets(limits: list[float], counts: list[float]) -> tuple[list[float], list[float]]:
    """Merge runs of empty buckets into one (TensorBoard draws the same picture from fewer bytes)."""
    out_limits: list[float] = []
    out_counts: list[float] = []
    for limit, count in zip(limits, counts):
        if count == 0 and out_counts and out_counts[-1] == 0:
            out_limits[-1] = limit
        else:
            out_limits.append(limit)
            out_counts.append(count)
    return out_limits, out_counts


# ----------------------------------------------------------------------------------------- the per-step read-out
class Readout:
    """Device tensors that the monitors read on the host together: one ``.tolist()`` (one host sync) per step for
    every statistic of every parameter of every monitor.

    A monitor :meth:`add` s a tensor and a consumer; the last monitor in ``trainer.callbacks`` calls :meth:`flush`
    at ``on_train_batch_end``, which hands each consumer its values as Python floats.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Tensor, Callable[[list[float]], None]]] = []
        self.syncs = 0  # host reads done, for the benchmark and tests

    def add(self, values: Tensor, consume: Callable[[list[float]], None]) -> None:
        self._pending.append((values, consume))

    def __len__(self) -> int:
        return len(self._pending)

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        device = pending[0][0].device
        dtype = torch.float32 if device.type == "mps" else torch.float64  # counts need float64's 53 bits
        flat = torch.cat([v.detach().reshape(-1).to(device=device, dtype=dtype) for v, _ in pending])
        values = flat.tolist()  # the one host sync
        self.syncs += 1
        start = 0
        for v, consume in pending:
            consume(values[start : start + v.numel()])
            start += v.numel()

    def clear(self) -> None:
        self._pending.clear()


class _Shared:
    """State the monitors of one trainer share."""

    def __init__(self) -> None:
        self.readout = Readout()
        self._stored_key: Optional[tuple] = None
        self._stored: Optional[Tensor] = None

    def stored_histograms(self, table: ParamTable, fmt: FloatFormat) -> Tensor:
        """Exponent histograms of the stored gradients of ``table``, computed once per backward for all monitors."""
        grads = table.grads()
        key = tuple(None if g is None else (id(g), g._version) for g in grads)
        if key != self._stored_key or self._stored is None:
            self._stored = exponent_histograms(grads, fmt)
            self._stored_key = key
        return self._stored

    def release(self) -> None:
        self._stored_key = self._stored = None


_SHARED: WeakKeyDictionary[pl.Trainer, _Shared] = WeakKeyDictionary()


def shared(trainer: pl.Trainer) -> _Shared:
    state = _SHARED.get(trainer)
    if state is None:
        state = _SHARED[trainer] = _Shared()
    return state


# ------------------------------------------------------------------------------------------------- the base class
class Monitor(Callback):
    """Base of the diagnostic callbacks: finds the writer at fit start, writes the dashboard layout once, and
    flushes the shared read-out at the end of each training batch."""

    #: keys of :data:`lightning_mpt.callbacks.dashboard.CHARTS` this monitor fills
    charts: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._sink: Optional[Sink] = None
        self._warned: set[str] = set()

    @property
    def sink(self) -> Sink:
        assert self._sink is not None, "used before on_fit_start"
        return self._sink

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_mpt.callbacks.dashboard import write_dashboard

        self._sink = Sink(trainer)
        if trainer.is_global_zero and not self._sink.active:
            self.warn_once("logger", f"{type(self).__name__}: the Trainer has no logger; nothing will be recorded.")
        monitors = [c for c in trainer.callbacks if isinstance(c, Monitor)]
        if monitors and monitors[0] is self and self._sink.writer is not None:
            write_dashboard(self._sink.writer, [key for m in monitors for key in m.charts])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batch_end(trainer, pl_module, outputs)
        if _is_last(self, trainer):
            shared(trainer).readout.flush()

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        """What a monitor does at the end of a training batch, before the shared read-out is flushed."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _is_last(self, trainer):
            shared(trainer).readout.flush()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.release(trainer)
        shared(trainer).readout.clear()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.release(trainer)
        shared(trainer).release()

    def release(self, trainer: pl.Trainer) -> None:
        """Drop what a monitor holds between hooks (snapshots, batches)."""

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)


def _is_last(monitor: Monitor, trainer: pl.Trainer) -> bool:
    last = None
    for c in trainer.callbacks:
        if isinstance(c, Monitor):
            last = c
    return last is monitor


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


def finite(x: float) -> bool:
    return math.isfinite(x)


def ratio(num: float, den: float) -> Optional[float]:
    """``num / den``, ``None`` when undefined (no values to take a share of)."""
    return num / den if den > 0 else None


def chunks(values: list[float], width: int) -> Iterator[list[float]]:
    for i in range(0, len(values), width):
        yield values[i : i + width]
