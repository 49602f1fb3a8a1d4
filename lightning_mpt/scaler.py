"""Dynamic loss scaling: a small state machine on Python floats (no Lightning, no device syncs of its own).

The trajectory rule, with ``hysteresis=1``, is the one of :class:`torch.amp.GradScaler`:

* a step whose gradients are non-finite multiplies the scale by ``backoff_factor`` and resets the count of
  consecutive clean steps;
* after ``growth_interval`` consecutive clean steps the scale is multiplied by ``growth_factor``.

With ``hysteresis=h > 1`` the scale backs off only on the h-th overflow since the scale last changed
(Megatron-LM and DeepSpeed use ``h=2``); every overflowing step is still skipped by the caller. The scale never
leaves ``[min_scale, max_scale]``. A scaler with ``min_scale == max_scale`` is a static scale.
"""

from __future__ import annotations

import math
from typing import Any, Union

from torch import Tensor

_STATE_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")
_CONFIG_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale")


class DynamicLossScaler:
    """Loss scale that grows after a run of clean steps and backs off on overflow.

    Args:
        init_scale: the scale of the first step (``2**16`` as :class:`torch.amp.GradScaler`).
        growth_factor: factor applied after ``growth_interval`` clean steps; must be ``> 1``.
        backoff_factor: factor applied on (the ``hysteresis``-th) overflow; must be in ``(0, 1)``.
        growth_interval: number of consecutive clean steps before the scale grows; ``>= 1``.
        hysteresis: overflows tolerated since the last change of scale before backing off; ``>= 1``.
        min_scale: floor of the scale; ``> 0``.
        max_scale: ceiling of the scale; ``>= min_scale`` (``math.inf`` for none).

    Example:
        ```python
        scaler = DynamicLossScaler(init_scale=1024, growth_interval=100, hysteresis=2)
        scaler.update(found_inf=True)   # first overflow: tolerated by hysteresis
        scaler.update(found_inf=True)   # second: backs off
        assert scaler.get_scale() == 512.0
        ```
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        _check(
            math.isfinite(init_scale) and init_scale > 0,
            f"init_scale must be a finite number > 0, got {init_scale!r}",
        )
        _check(
            math.isfinite(growth_factor) and growth_factor > 1,
            f"growth_factor must be a finite number > 1, got {growth_factor!r}",
        )
        _check(0 < backoff_factor < 1, f"backoff_factor must be in the open interval (0, 1), got {backoff_factor!r}")
        _check(_is_int(growth_interval) and growth_interval >= 1, f"growth_interval must be an int >= 1, got {growth_interval!r}")
        _check(_is_int(hysteresis) and hysteresis >= 1, f"hysteresis must be an int >= 1, got {hysteresis!r}")
        _check(math.isfinite(min_scale) and min_scale > 0, f"min_scale must be a finite number > 0, got {min_scale!r}")
        _check(max_scale >= min_scale, f"min_scale ({min_scale!r}) must not exceed max_scale ({max_scale!r})")
        _check(
            min_scale <= init_scale <= max_scale,
            f"init_scale ({init_scale!r}) must lie in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]",
        )
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self._scale = float(init_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @classmethod
    def static(cls, scale: float) -> DynamicLossScaler:
        """A scaler that never changes: ``min_scale == max_scale == scale``.

        Example:
            ```python
            assert DynamicLossScaler.static(1024.0).is_static
            ```
        """
        return cls(init_scale=scale, min_scale=scale, max_scale=scale)

    @property
    def scale(self) -> float:
        """The scale in force now."""
        return self._scale

    def get_scale(self) -> float:
        """The scale in force now (the name of :meth:`torch.amp.GradScaler.get_scale`)."""
        return self._scale

    @property
    def is_static(self) -> bool:
        """Whether the scale can never change (``min_scale == max_scale``)."""
        return self.min_scale == self.max_scale

    @property
    def growth_tracker(self) -> int:
        """Consecutive clean steps since the last overflow or growth."""
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows still tolerated before the next back-off."""
        return self._hysteresis_tracker

    def update(self, found_inf: Union[bool, Tensor]) -> None:
        """Advance the state machine by one optimizer step.

        Args:
            found_inf: whether the step's gradients held a non-finite value (a bool or a 0-dim/1-element tensor;
                a tensor costs one host sync, so callers that already synced should pass a bool).
        """
        if isinstance(found_inf, Tensor):
            found_inf = bool(found_inf.item())
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._change(self.backoff_factor)
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._growth_tracker = 0
                self._change(self.growth_factor)

    def _change(self, factor: float) -> None:
        # a growth or back-off (even one clamped at a bound) restarts the hysteresis count
        new_scale = min(max(self._scale * factor, self.min_scale), self.max_scale)
        if math.isfinite(new_scale):  # as GradScaler: a growth that would reach inf is dropped
            self._scale = new_scale
        self._hysteresis_tracker = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """The scale, the trackers and the configuration.

        Example:
            ```python
            other = DynamicLossScaler()
            other.load_state_dict(DynamicLossScaler(init_scale=8.0).state_dict())
            assert other.scale == 8.0
            ```
        """
        state = {k: getattr(self, "_" + k) for k in _STATE_KEYS}
        state.update({k: getattr(self, k) for k in _CONFIG_KEYS})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (also accepts a :class:`torch.amp.GradScaler` state dict)."""
        if "_growth_tracker" in state_dict:  # torch.amp.GradScaler's format
            state_dict = {
                "scale": state_dict["scale"],
                "growth_tracker": state_dict["_growth_tracker"],
                "growth_factor": state_dict["growth_factor"],
                "backoff_factor": state_dict["backoff_factor"],
                "growth_interval": state_dict["growth_interval"],
            }
        missing = [k for k in ("scale", "growth_tracker") if k not in state_dict]
        if missing:
            raise KeyError(f"DynamicLossScaler.load_state_dict: missing keys {missing}; got {sorted(state_dict)}")
        for k in _CONFIG_KEYS:
            if k in state_dict:
                setattr(self, k, type(getattr(self, k))(state_dict[k]))
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict.get("hysteresis_tracker", self.hysteresis))

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={getattr(self, k)!r}" for k in _CONFIG_KEYS)
        return f"{type(self).__name__}(scale={self._scale!r}, {cfg})"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
