"""The checks of :class:`~lightning_mpt.core.scaler.DynamicLossScaler`'s configuration and of the state dicts it loads
(its own, or a :class:`torch.amp.GradScaler`'s): each invalid value a ``ValueError`` (a missing key a ``KeyError``)
that says what is accepted. No torch: Python floats, rounded to float32 as torch holds a scale."""

from __future__ import annotations

import math
import numbers
import struct
import warnings
from typing import Any

STATE_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")
CONFIG_KEYS = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "consecutive_hysteresis",
    "min_scale",
    "max_scale",
)
GRADSCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
ACCEPTED = (
    f"accepted: a dict from DynamicLossScaler.state_dict() (keys {list(STATE_KEYS + CONFIG_KEYS)}; "
    f"'scale' and 'growth_tracker' required) or from torch.amp.GradScaler.state_dict() (keys {list(GRADSCALER_KEYS)})"
)
# native byte order: a plain C cast to float (round to nearest even, inf beyond float32's range), where the
# standard sizes ('<f') would raise OverflowError instead
FLOAT32 = struct.Struct("f")


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as ``torch.tensor(x, dtype=torch.float32).item()`` (15x cheaper)."""
    value: float = FLOAT32.unpack(FLOAT32.pack(x))[0]
    return value


def checked_state(state_dict: dict[str, Any], config: dict[str, Any], name: str) -> dict[str, Any]:
    """The scaler's configuration and state read from ``state_dict`` (a :meth:`DynamicLossScaler.state_dict` or a
    GradScaler's), checked: the configuration keys present replace those of ``config`` (the scaler's now); the
    scale is brought into ``[min_scale, max_scale]`` with a warning. ``name`` says who loads, in the messages.

    Example:
        ```python
        state = checked_state({"scale": 8.0, "growth_tracker": 3}, {"growth_factor": 2.0, "backoff_factor": 0.5,
            "growth_interval": 10, "hysteresis": 1, "consecutive_hysteresis": False, "min_scale": 1.0,
            "max_scale": 2.0**24}, "load")
        assert state["scale"] == 8.0 and state["growth_tracker"] == 3 and state["hysteresis_tracker"] == 1
        ```
    """
    if not state_dict:
        raise KeyError(f"{name}: the state dict is empty (a disabled GradScaler's is); {ACCEPTED}")
    gradscaler = "_growth_tracker" in state_dict
    required = GRADSCALER_KEYS if gradscaler else ("scale", "growth_tracker")
    missing = [k for k in required if k not in state_dict]
    if missing:
        raise KeyError(f"{name}: missing keys {missing} (got {sorted(state_dict)}); {ACCEPTED}")
    try:
        checked = checked_config(**{k: state_dict.get(k, config[k]) for k in CONFIG_KEYS})
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    growth_tracker = state_dict["_growth_tracker" if gradscaler else "growth_tracker"]
    check(
        is_int(growth_tracker) and growth_tracker >= 0,
        f"{name}: growth_tracker must be an int >= 0, got {growth_tracker!r}",
    )
    h = checked["hysteresis"]
    hysteresis_tracker = h if gradscaler else state_dict.get("hysteresis_tracker", h)
    check(
        is_int(hysteresis_tracker) and hysteresis_tracker <= h,
        f"{name}: hysteresis_tracker must be an int <= hysteresis ({h}), got {hysteresis_tracker!r}",
    )
    return {
        **checked,
        "scale": _loaded_scale(state_dict["scale"], checked["min_scale"], checked["max_scale"], name),
        "growth_tracker": int(growth_tracker),
        "hysteresis_tracker": int(hysteresis_tracker),
        "measuring": state_dict.get("measuring") is True,  # a measured scale is never measured again
    }


def checked_config(
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    consecutive_hysteresis: bool,
    min_scale: float,
    max_scale: float,
) -> dict[str, Any]:
    """The configuration normalised (bounds rounded to float32), or a ValueError that says what is accepted."""
    check(
        is_real(growth_factor) and math.isfinite(growth_factor) and growth_factor > 1,
        f"growth_factor must be a finite number > 1, got {growth_factor!r}",
    )
    check(
        is_real(backoff_factor) and 0 < backoff_factor < 1,
        f"backoff_factor must be in the open interval (0, 1), got {backoff_factor!r}",
    )
    check(
        is_int(growth_interval) and growth_interval >= 1,
        f"growth_interval must be an int >= 1, got {growth_interval!r}",
    )
    check(is_int(hysteresis) and hysteresis >= 1, f"hysteresis must be an int >= 1, got {hysteresis!r}")
    check(
        isinstance(consecutive_hysteresis, bool),
        f"consecutive_hysteresis must be a bool, got {consecutive_hysteresis!r}",
    )
    check(
        is_real(min_scale) and is_real(max_scale),
        f"min_scale and max_scale must be numbers, got {min_scale!r} and {max_scale!r}",
    )
    low, high = f32(float(min_scale)), f32(float(max_scale))
    check(
        math.isfinite(min_scale) and low > 0,
        f"min_scale must be a finite number > 0 that float32 does not round to 0 (2**-149 or more), got {min_scale!r}",
    )
    check(max_scale >= min_scale, f"min_scale ({min_scale!r}) must not exceed max_scale ({max_scale!r})")
    return {
        "growth_factor": float(growth_factor),
        "backoff_factor": float(backoff_factor),
        "growth_interval": int(growth_interval),
        "hysteresis": int(hysteresis),
        "consecutive_hysteresis": consecutive_hysteresis,
        "min_scale": low,
        "max_scale": high,
    }


def _loaded_scale(value: Any, low: float, high: float, name: str) -> float:
    """A loaded scale as a float32 value in ``[low, high]``, with a warning if it had to be moved there."""
    try:
        scale = f32(float(value))
    except (TypeError, ValueError):
        raise ValueError(f"{name}: scale must be a number, got {value!r}") from None
    check(
        math.isfinite(scale) and scale > 0,
        f"{name}: scale must be a finite number > 0 within float32's range, got {value!r}; "
        "a checkpoint taken after the scale went to inf or 0 cannot resume the scaler",
    )
    if not low <= scale <= high:
        bound, side = (low, "below min_scale") if scale < low else (high, "above max_scale")
        warnings.warn(f"{name}: the loaded scale {scale!r} is {side} ({bound!r}); using {bound!r}.", stacklevel=4)
        scale = bound
    return scale


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
