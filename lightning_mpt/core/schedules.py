"""LR schedules that skipped steps do not advance (Megatron-LM's and DeepSpeed's semantics), as an option.

By default a step skipped for non-finite gradients counts for the LR schedulers, as under Lightning's ``"16-mixed"``
and ``torch.amp.GradScaler``: the schedule runs ahead of the updates actually applied, by one step per skip.
:class:`ScheduleGate` makes a scheduler's ``step()`` do nothing when every optimizer step of its optimizer since the
scheduler's previous ``step()`` was skipped (and there was at least one). One rule covers each way a scheduler is
stepped: after every optimizer step (``interval="step"``), every few (``frequency``), once an epoch (the epoch counts
unless all its steps were skipped), or by the user's own code.

The gate changes the scheduler's class to a subclass made on the fly whose ``step`` asks the gate first, as
Lightning's ``LightningOptimizer`` does for optimizers: the scheduler stays the same object (what Lightning and the
user hold), and nothing enters its ``__dict__``, which torch saves as its ``state_dict``.
"""

from __future__ import annotations

from typing import Any, Optional
from weakref import WeakKeyDictionary

# what happened to the scheduler's optimizer since the scheduler's last step()
IDLE, SKIPPED, TAKEN = 0, 1, 2

_GATES: WeakKeyDictionary[Any, ScheduleGate] = WeakKeyDictionary()
_CLASSES: dict[type, type] = {}  # scheduler class -> its gated subclass


def _gated_step(self: Any, *args: Any, **kwargs: Any) -> Any:
    gate = _GATES.get(self)
    if gate is not None and not gate.admits(self):
        return None
    return super(type(self), self).step(*args, **kwargs)


def _gated_class(cls: type) -> type:
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = _CLASSES[cls] = type(cls.__name__, (cls,), {"step": _gated_step, "__module__": __name__})
    return sub


class ScheduleGate:
    """Drop a scheduler's ``step()`` when its optimizer's steps since the last one were all skipped.

    Args:
        enabled: ``False`` attaches nothing: every ``step()`` goes through (Lightning's behaviour).

    Example:
        ```python
        import torch

        param = torch.nn.Parameter(torch.zeros(1))
        scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([param], lr=1.0), step_size=1, gamma=0.5)
        gate = ScheduleGate()
        gate.attach(scheduler, optimizer=0)
        gate.note(optimizer=0, skipped=True)
        scheduler.step()  # dropped: the only step since was skipped
        gate.note(optimizer=0, skipped=False)
        scheduler.step()
        assert scheduler.get_last_lr() == [0.5]
        gate.release()
        ```
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._schedulers: list[tuple[Any, int]] = []  # (scheduler, its optimizer's index), in attach order
        self._state: list[int] = []
        self._loaded: Optional[list[int]] = None  # state loaded before the schedulers were attached

    def attach(self, scheduler: Any, optimizer: int) -> None:
        """Gate ``scheduler``, which steps the LR of the optimizer with index ``optimizer``."""
        if not self.enabled or any(s is scheduler for s, _ in self._schedulers):
            return
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"expected an LR scheduler with a step() method, got {type(scheduler).__name__}")
        self._schedulers.append((scheduler, optimizer))
        self._state.append(IDLE)
        if self._loaded is not None and len(self._loaded) >= len(self._state):
            self._state[-1] = self._loaded[len(self._state) - 1]
        scheduler.__class__ = _gated_class(type(scheduler))
        _GATES[scheduler] = self

    def note(self, optimizer: int, skipped: bool) -> None:
        """The optimizer with index ``optimizer`` took a step, or skipped one."""
        for i, (_, index) in enumerate(self._schedulers):
            if index == optimizer:
                self._state[i] = TAKEN if not skipped else max(self._state[i], SKIPPED)

    def admits(self, scheduler: Any) -> bool:
        """Whether ``scheduler.step()`` may advance it now; either way its window starts afresh."""
        for i, (s, _) in enumerate(self._schedulers):
            if s is scheduler:
                state, self._state[i] = self._state[i], IDLE
                return state != SKIPPED
        return True

    def release(self) -> None:
        """Give every scheduler its own class back and forget them."""
        for scheduler, _ in self._schedulers:
            if _GATES.get(scheduler) is self:
                del _GATES[scheduler]
                scheduler.__class__ = type(scheduler).__mro__[1]
        self._schedulers.clear()
        self._state.clear()

    def state_dict(self) -> list[int]:
        """Per scheduler, in attach order, what its optimizer did since its last step (a resumed run continues)."""
        return list(self._state) if self._schedulers else list(self._loaded or [])

    def load_state_dict(self, state: list[int]) -> None:
        """Restore :meth:`state_dict`, now or when the schedulers are attached."""
        self._loaded = [int(s) for s in state]
        for i in range(min(len(self._state), len(self._loaded))):
            self._state[i] = self._loaded[i]
