"""What happened at an optimizer step (:class:`StepRecord`), the error that stops a run which keeps skipping
(:class:`NonFiniteGradientError`), and the texts that explain both. The engine's
:class:`~lightning_mpt.core.engine.StepLog` keeps the records."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor

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
    record: StepRecord, history: Iterable[StepRecord], streak: int, at_floor: bool, optimizers: int
) -> str:
    """Why the guard stopped the run at the skipped step ``record``: the culprits, whether the loss was finite, the
    recent scales (``streak``: skips in a row of its optimizer; ``optimizers``: how many have stepped)."""
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
        "  hint: lower the learning rate, clip gradients (Trainer(gradient_clip_val=...)), check the data and the "
        "loss for inf/NaN, or use MPTPrecision('bf16'), whose range does not overflow."
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
