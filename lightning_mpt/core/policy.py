"""The step policy: decide whether an optimizer step is taken, in one host sync, and stop a run that keeps skipping.

Pure torch (no Lightning), shared by the Trainer plugin, the Fabric plugin and the FSDP2 path. Per optimizer step:

1. :meth:`StepPolicy.scale_loss` multiplies each loss by the scale (and notes on the device whether it was finite);
2. the caller unscales the gradients with the fused AMP kernel, which leaves a ``found_inf`` flag on the device;
3. :meth:`StepPolicy.sync` reads that flag and the loss flag on the host, all-reduced across processes first, so
   that every rank takes the same decision; this is the step's one host sync, before the optimizer runs;
4. the caller carries the decision out and :meth:`StepPolicy.record` s it: a step taken is followed by
   :meth:`StepPolicy.stepped`; a skip by :meth:`StepPolicy.check_guard`, which raises
   :class:`NonFiniteGradientError` once the run keeps overflowing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mpt.core.scaler import DynamicLossScaler

HISTORY = 1024  # optimizer steps kept in ``StepPolicy.history``


class NonFiniteGradientError(RuntimeError):
    """Raised when training keeps producing non-finite gradients (see ``MPTPrecision(max_consecutive_skips=...)``)."""


@dataclass
class StepRecord:
    """What happened at one optimizer step.

    ``scale`` is the loss scale the step's gradients were computed with; ``optimizer`` the index of the optimizer
    that stepped (its position in the Trainer's ``optimizers``). For a skipped step the names of the parameters whose
    gradients were non-finite are worked out on first access of :attr:`nonfinite_params` (one host sync), so
    recording them costs nothing when nobody asks.

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

    def blame(self, names: list[str], mask: Optional[Tensor]) -> None:
        """Name the culprits of a skipped step: ``mask`` (on the device, read lazily) flags which of ``names``."""
        self._names, self._mask = names, mask


class StepPolicy:
    """Loss scaling, the skip decision, counters, history and the guard of a mixed-precision run.

    Args:
        scaler: the loss scaler, ``None`` for no scaling (bf16); a non-finite gradient skips the step either way.
        max_consecutive_skips: stop after this many skipped steps in a row of one optimizer.

    Example:
        ```python
        policy = StepPolicy(DynamicLossScaler(init_scale=8.0), max_consecutive_skips=3)
        loss = policy.scale_loss(torch.tensor(0.5))           # 4.0: backward runs on this
        record = policy.decide(found_inf=torch.tensor(1.0))   # a gradient overflowed: skip
        assert record.skipped and policy.loss_scale == 4.0
        policy.check_guard(record)                            # 1 skip in a row: no error yet
        ```
    """

    def __init__(self, scaler: Optional[DynamicLossScaler], max_consecutive_skips: int) -> None:
        self.scaler = scaler
        self.max_consecutive_skips = max_consecutive_skips
        self.history: deque[StepRecord] = deque(maxlen=HISTORY)
        self.skipped_steps = 0
        self.steps = 0
        self.consecutive: dict[int, int] = {}  # skipped steps in a row, per optimizer index
        self.backward_scale = self.loss_scale
        self._loss_finite: Optional[Tensor] = None

    @property
    def loss_scale(self) -> float:
        """The scale in force now (1.0 without a scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def last_step_skipped(self) -> bool:
        return bool(self.history) and self.history[-1].skipped

    def scale_loss(self, loss: Tensor) -> Tensor:
        """Note whether ``loss`` is finite (on the device, no sync) and return it multiplied by the scale."""
        finite = torch.isfinite(loss.detach()).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        self.backward_scale = self.loss_scale
        return loss * self.backward_scale if self.scaler is not None else loss

    def sync(self, found_inf: Optional[Tensor], extra: Optional[Tensor] = None) -> tuple[bool, bool, list[float]]:
        """The step's one host sync: ``(skip, loss_finite, extra)``.

        ``skip``: whether a gradient was non-finite on any rank (all-reduced, so every rank takes the same decision).
        ``loss_finite``: whether every loss scaled since the last sync was finite, on every rank. ``extra``: device
        values of the caller's, read in the same sync (not
        reduced across ranks). Nothing is recorded until :meth:`record`, so a decision that is dropped (new gradients
        arrived before the step) leaves no trace.
        """
        loss_finite, self._loss_finite = self._loss_finite, None
        if found_inf is None and loss_finite is None and extra is None:
            return False, True, []
        device = next(t.device for t in (found_inf, loss_finite, extra) if t is not None)
        zero = torch.zeros((), device=device)
        flags = torch.stack([
            zero if found_inf is None else (found_inf.to(device) > 0).float(),
            zero if loss_finite is None else (~loss_finite).float().to(device),
        ])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if extra is not None:
            flags = torch.cat([flags, extra.to(device=device, dtype=flags.dtype).reshape(-1)])
        values = flags.tolist()  # the one host sync
        return values[0] > 0, values[1] == 0, values[2:]

    def record(
        self, skipped: bool, loss_finite: bool = True, optimizer: int = 0, scale: Optional[float] = None
    ) -> StepRecord:
        """Record a step as carried out. On a skip the scaler backs off and the optimizer's count of skips in a row
        grows; the caller then names the culprits (:meth:`StepRecord.blame`) and calls :meth:`check_guard`."""
        record = StepRecord(
            step=self.steps,
            scale=self.backward_scale if scale is None else scale,
            skipped=skipped,
            loss_finite=loss_finite,
            optimizer=optimizer,
        )
        self.steps += 1
        self.history.append(record)
        if skipped:
            self.skipped_steps += 1
            self.consecutive[optimizer] = self.consecutive.get(optimizer, 0) + 1
            if self.scaler is not None:
                self.scaler.update(True)
        return record

    def decide(self, found_inf: Optional[Tensor], optimizer: int = 0) -> StepRecord:
        """:meth:`sync` and :meth:`record` in one, for loops that carry out the decision at once."""
        skipped, loss_finite, _ = self.sync(found_inf)
        return self.record(skipped, loss_finite, optimizer)

    def stepped(self, optimizer: int = 0) -> None:
        """The optimizer took the step decided clean."""
        self.consecutive[optimizer] = 0
        if self.scaler is not None:
            self.scaler.update(False)

    def check_guard(self, record: StepRecord) -> None:
        """Raise :class:`NonFiniteGradientError` if the skipped step ``record`` means the run cannot recover: too many
        skips in a row of its optimizer, or an overflow at the minimum scale."""
        scaler = self.scaler
        at_floor = scaler is not None and not scaler.is_static and record.scale <= scaler.min_scale
        if at_floor or self.consecutive.get(record.optimizer, 0) >= self.max_consecutive_skips:
            raise NonFiniteGradientError(self._guard_message(record, at_floor))

    def _guard_message(self, record: StepRecord, at_floor: bool) -> str:
        names = record.nonfinite_params
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        trail = ", ".join(f"{r.scale:g}{'*' if r.skipped else ''}" for r in list(self.history)[-12:])
        why = (
            f"an overflow happened at the minimum loss scale ({record.scale:g})"
            if at_floor
            else f"{self.consecutive[record.optimizer]} optimizer steps in a row were skipped"
        )
        which = f" (optimizer {record.optimizer})" if record.optimizer or len(self.consecutive) > 1 else ""
        return (
            f"MPTPrecision stopped training: {why}{which} because of non-finite gradients.\n"
            f"  step {record.step}: parameters with non-finite gradients: {shown or '(none found)'}\n"
            f"  the loss itself was {'finite' if record.loss_finite else 'NON-FINITE (inf/NaN in the forward pass)'}\n"
            f"  recent loss scales (* = skipped): {trail}\n"
            "  hint: lower the learning rate, clip gradients (Trainer(gradient_clip_val=...)), check the data and the "
            "loss for inf/NaN, or use MPTPrecision('bf16'), whose range does not overflow."
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": [self.consecutive.get(i, 0) for i in range(max(self.consecutive, default=-1) + 1)],
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> Optional[str]:
        """Restore :meth:`state_dict`; returns a warning to show when the scaler state could not be restored, or when
        the scaler is configured otherwise than the saved one (this scaler's configuration stays in force, the scale
        and its trackers are restored: :meth:`DynamicLossScaler.restore_state`)."""
        warning = None
        scaler_state = state.get("scaler")
        if self.scaler is not None and scaler_state is not None:
            changed = self.scaler.restore_state(scaler_state)
            if changed:
                warning = _reconfigured(changed, self.scaler.scale)
        elif (self.scaler is None) != (scaler_state is None):
            warning = (
                f"the checkpoint was saved {'with' if scaler_state else 'without'} a loss scaler and this plugin has "
                f"{'none' if self.scaler is None else 'one'}; the scaler state is not restored."
            )
        self.skipped_steps = int(state.get("skipped_steps", 0))
        consecutive = state.get("consecutive_skips", 0)
        if isinstance(consecutive, int):  # saved by 0.1.0: one counter for all optimizers
            consecutive = [consecutive]
        self.consecutive = {i: int(c) for i, c in enumerate(consecutive)}
        self.steps = int(state.get("steps", 0))
        self.backward_scale = self.loss_scale
        return warning


def _reconfigured(changed: dict[str, tuple[Any, Any]], scale: float) -> str:
    """The warning for a scaler configured otherwise than the one in the checkpoint: which settings, both values, and
    which are in force."""
    settings = "; ".join(f"{k} {saved!r} in the checkpoint, {now!r} now" for k, (saved, now) in changed.items())
    saved = ", ".join(f"{k}={saved!r}" for k, (saved, _) in changed.items())
    return (
        f"the loss scaler is configured otherwise than the checkpoint's: {settings}. The new configuration is in "
        f"force; the scale ({scale:g}) and its trackers are restored from the checkpoint. To go on with the "
        f"checkpoint's configuration, pass scaler=DynamicLossScaler({saved}, ...) with your other settings."
    )
