"""When the diagnostics measure, and the checks of their arguments (one error text for every front-end)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def due(step: int, every: int) -> bool:
    """Whether ``step`` is a measuring step of the cadence ``every`` (``0``: never)."""
    return every > 0 and step % every == 0


def check_every(owner: str, name: str, value: Any, allow_none: bool = False, allow_zero: bool = False) -> Any:
    """``value`` if it is a valid cadence argument ``name`` of ``owner``, else a ``ValueError`` that lists what is
    accepted: an int >= 1, or also ``0`` (off) with ``allow_zero``, ``None`` (the Trainer's ``log_every_n_steps``)
    with ``allow_none``."""
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


def check_choice(owner: str, name: str, value: T, choices: Sequence[T]) -> T:
    """``value`` if it is one of ``choices``, else a ``ValueError`` that lists them."""
    if value not in choices:
        raise ValueError(f"{owner}({name}={value!r}): expected one of {list(choices)}.")
    return value
