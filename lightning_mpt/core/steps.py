"""What happened at an optimizer step (:class:`StepRecord`), the log of a run's steps that updates the scaler and
guards the run (:class:`StepLog`), the error that stops a run which keeps skipping (:class:`NonFiniteGradientError`),
and the texts that explain them."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor

from lightning_mpt.core.scaler import DynamicLossScaler
from lightning_mpt.core.schedules import ScheduleGate

HISTORY = 1024  # optimizer steps kept in the history


class NonFiniteGradientError(RuntimeError):
    """Raised when training keeps producing non-finite gradients (see ``MPTPrecision(max_consecutive_skips=...)``)."""


@dataclass
class StepRecord:
    """What happened at one optimizer step.

    ``scale`` is the loss scale the step's gradients were computed with; ``optimizer`` the index of the optimizer
    that stepped (its position in the Trainer's ``optimizers``). For a skipped step the names of the parameters whose
    gradients were non-finite are worked out on first access of :attr:`nonfinite_params` (one host sync).

    Example:
        ```python
        record = StepRecord(step=0, scale=65536.0, skipped=False)
        assert record.nonfinite_params == []
        ```
    """

    step: int  # optimizer steps taken before this one (skipped ones included)
    scale: float
    skipped: bool
    loss_finite: bool = True
    optimizer: int = 0
    _names: list[str] = field(default_factory=list, repr=False)
    _mask: Optional[Tensor] = field(default=None, repr=False)

    @property
    def nonfinite_params(self) -> list[str]:
        """Names of the parameters whose gradients held inf or NaN at this step (empty for a clean step)."""
        if self._mask is not None:
            self._names = [n for n, bad in zip(self._names, self._mask.tolist()) if bad]
            self._mask = None
        return self._names


def stop_message(
    record: StepRecord,
    history: Iterable[StepRecord],
    streak: int,
    at_floor: bool,
    optimizers: int,
    scaler: Optional[DynamicLossScaler] = None,
) -> str:
    """Why the guard stopped the run at the skipped step ``record``: the culprits, whether the loss was finite, the
    recent scales (``streak``: skips in a row of its optimizer; ``optimizers``: how many have stepped), and a hint
    that fits the cause (``scaler``: the run's, ``None`` without loss scaling)."""
    names = record.nonfinite_params
    culprits = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    trail = ", ".join(f"{r.scale:g}{'*' if r.skipped else ''}" for r in list(history)[-12:])
    why = (
        f"an overflow happened at the minimum loss scale ({record.scale:g})"
        if at_floor
        else f"{streak} optimizer steps in a row were skipped"
    )
    which = f" (optimizer {record.optimizer})" if record.optimizer or optimizers > 1 else ""
    return (
        f"MPTPrecision stopped training: {why}{which} because of non-finite gradients.\n"
        f"  step {record.step}: parameters with non-finite gradients: {culprits or '(none found)'}\n"
        f"  the loss itself was {'finite' if record.loss_finite else 'NON-FINITE (inf/NaN in the forward pass)'}\n"
        f"  recent loss scales (* = skipped): {trail}\n"
        f"  hint: {stop_hint(record, streak, at_floor, scaler)}"
    )


def stop_hint(record: StepRecord, streak: int, at_floor: bool, scaler: Optional[DynamicLossScaler]) -> str:
    """What helps, by cause of the stop. Clipping and a lower learning rate are not offered: clipping acts on the
    unscaled gradients after the overflow has happened, and a skipped step applies no update for the learning rate to
    scale, so neither prevents the next overflow (measured: the same steps skip with either).

    Args:
        record: the skipped step that stopped the run.
        streak: skipped steps in a row of its optimizer, this one included.
        at_floor: whether it overflowed at the scaler's ``min_scale``.
        scaler: the run's scaler, ``None`` without loss scaling.

    Example:
        ```python
        record = StepRecord(step=2, scale=2.0**22, skipped=True)
        assert "use the dynamic scaler" in stop_hint(record, 3, False, DynamicLossScaler.static(2.0**22))
        ```
    """
    if not record.loss_finite:
        return (
            "the loss itself is inf/NaN: no loss scale changes that. Check the data and the loss (a log of 0, a "
            "division by 0); activations above fp16's max (65504) fit in bf16: MPTPrecision('bf16')."
        )
    if scaler is None:  # no loss scaling (bf16): the gradients themselves are inf/NaN
        return "the gradients are inf/NaN with no loss scale at all: check the data, the loss and the parameters named."
    if scaler.is_static:
        return (
            f"a static loss scale ({record.scale:g}) never backs off: use the dynamic scaler (scaler=None), which "
            "backs off to a scale the gradients fit, or a lower static scale."
        )
    if at_floor:
        lower = f"lower min_scale (now {scaler.min_scale:g}) or " if scaler.min_scale > 1 else ""
        return (
            f"the gradients overflow fp16 even at scale {record.scale:g}: {lower}use MPTPrecision('bf16'), whose range "
            "holds them."
        )
    if record.step + 1 == streak:  # every step so far skipped: the scale started too high
        return (
            "the dynamic scale kept backing off from too high a start: start lower (DynamicLossScaler(init_scale="
            "'auto') measures the first scale from the first gradients), or raise max_consecutive_skips."
        )
    return (
        f"the gradients grew past fp16's range at every scale tried since step {record.step + 1 - streak}: raise "
        "max_consecutive_skips to let the scale back off further, or use MPTPrecision('bf16'), whose range holds them."
    )


def reconfigured(changed: dict[str, tuple[Any, Any]], scale: float) -> str:
    """The warning for a scaler configured otherwise than the one in the checkpoint."""
    settings = "; ".join(f"{k} {saved!r} in the checkpoint, {now!r} now" for k, (saved, now) in changed.items())
    saved = ", ".join(f"{k}={saved!r}" for k, (saved, _) in changed.items())
    return (
        f"the loss scaler is configured otherwise than the checkpoint's: {settings}. The new configuration is in "
        f"force; the scale ({scale:g}) and its trackers are restored from the checkpoint. To go on with the "
        f"checkpoint's configuration, pass scaler=DynamicLossScaler({saved}, ...) with your other settings."
    )


def measuring_skipped(scale: float, loss_finite: bool, next_scale: float) -> str:
    """The warning for a skipped step of a scaler still measuring its scale (``init_scale="auto"``)."""
    cause = "the loss itself was non-finite" if not loss_finite else "the gradients overflowed"
    return (
        f"MPTPrecision: the step that measures the loss scale (init_scale='auto') was skipped: at scale {scale:g} "
        f"{cause}. The next step measures again, at scale {next_scale:g}."
    )


class StepLog:
    """The history, the counters and the guard of a run; told each step's outcome once, it updates the scaler.

    Args:
        scaler: the loss scaler, ``None`` for no scaling.
        max_consecutive_skips: stop after this many skipped steps in a row of one optimizer.

    Example:
        ```python
        log = StepLog(DynamicLossScaler(init_scale=8.0), max_consecutive_skips=2)
        log.skipped(optimizer=0, scale=8.0, loss_finite=True)   # the scale backs off to 4
        log.taken(optimizer=0, scale=4.0, loss_finite=True)
        assert [r.skipped for r in log.history] == [True, False] and log.scaler.scale == 4.0
        ```
    """

    def __init__(self, scaler: Optional[DynamicLossScaler], max_consecutive_skips: int) -> None:
        self.scaler = scaler
        self.max_consecutive_skips = max_consecutive_skips
        self.history: deque[StepRecord] = deque(maxlen=HISTORY)
        self.steps = 0
        self.skipped_steps = 0
        self.consecutive: dict[int, int] = {}  # skipped steps in a row, per optimizer index
        self.gate = ScheduleGate(enabled=False)  # the LR schedulers that skipped steps do not advance, if any

    def taken(self, optimizer: int, scale: float, loss_finite: bool) -> StepRecord:
        """The optimizer took a step decided clean."""
        record = self._record(optimizer, scale, loss_finite, skipped=False)
        self.consecutive[optimizer] = 0
        self.gate.note(optimizer, skipped=False)
        if self.scaler is not None:
            self.scaler.update(False)
        return record

    def skipped(
        self, optimizer: int, scale: float, loss_finite: bool, names: Any = (), nonfinite: Optional[Tensor] = None
    ) -> StepRecord:
        """A step skipped for non-finite gradients: the scale backs off. Raises
        :class:`~lightning_mpt.core.steps.NonFiniteGradientError` when the run cannot recover: too many skips in a row
        of this optimizer, or an overflow at the minimum scale. ``nonfinite`` (on the device, read only when asked)
        flags which of ``names``, the step's parameters, had non-finite gradients."""
        record = self._record(optimizer, scale, loss_finite, skipped=True)
        record._names, record._mask = list(names), nonfinite
        self.skipped_steps += 1
        self.consecutive[optimizer] = self.consecutive.get(optimizer, 0) + 1
        self.gate.note(optimizer, skipped=True)
        scaler = self.scaler
        measuring = scaler is not None and scaler.measuring
        if scaler is not None:
            scaler.update(True)
        # a measuring step (init_scale="auto") with a non-finite loss tells nothing of the gradients' range: measure
        # again at the next step; non-finite gradients of a finite loss at the floor are an overflow no scale avoids
        at_floor = (
            scaler is not None and not scaler.is_static and scale <= scaler.min_scale and (loss_finite or not measuring)
        )
        if measuring and not at_floor:
            warnings.warn(measuring_skipped(scale, loss_finite, scaler.scale if scaler else scale), stacklevel=2)
        if at_floor or self.consecutive[optimizer] >= self.max_consecutive_skips:
            streak = self.consecutive[optimizer]
            raise NonFiniteGradientError(
                stop_message(record, self.history, streak, at_floor, len(self.consecutive), scaler)
            )
        return record

    def _record(self, optimizer: int, scale: float, loss_finite: bool, skipped: bool) -> StepRecord:
        record = StepRecord(self.steps, scale, skipped, loss_finite, optimizer)
        self.steps += 1
        self.history.append(record)
        return record

    def state_dict(self) -> dict[str, Any]:
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": [self.consecutive.get(i, 0) for i in range(max(self.consecutive, default=-1) + 1)],
            "steps": self.steps,
            "schedules": self.gate.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> Optional[str]:
        """Restore :meth:`state_dict`; returns a warning to show, if any: the scaler state could not be restored, or
        the scaler is configured otherwise than the saved one (its configuration stays in force, the scale and its
        trackers are restored: :meth:`~lightning_mpt.core.scaler.DynamicLossScaler.restore_state`)."""
        warning = None
        saved = state.get("scaler")
        if self.scaler is not None and saved is not None:
            changed = self.scaler.restore_state(saved)
            warning = reconfigured(changed, self.scaler.scale) if changed else None
        elif (self.scaler is None) != (saved is None):
            warning = (
                f"the checkpoint was saved {'with' if saved else 'without'} a loss scaler and this plugin has "
                f"{'none' if self.scaler is None else 'one'}; the scaler state is not restored."
            )
        self.skipped_steps = int(state.get("skipped_steps", 0))
        consecutive = state.get("consecutive_skips", 0)
        if isinstance(consecutive, int):  # one counter for all optimizers, as the first release saved it
            consecutive = [consecutive]
        self.consecutive = {i: int(c) for i, c in enumerate(consecutive)}
        self.steps = int(state.get("steps", 0))
        # records of steps this state has not taken (a restore to an earlier point of the run: Lightning's lr_find and
        # batch-size finder restore the state they started from) would stand for its last steps
        kept = [r for r in self.history if r.step < self.steps]
        self.history.clear()
        self.history.extend(kept)
        self.gate.load_state_dict(state.get("schedules", []))
        return warning
