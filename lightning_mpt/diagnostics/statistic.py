"""The unit of the diagnostics that fails alone: :class:`Statistic`, and strict mode.

A diagnostic never stops a training run (docs/diagnostics.md#when-a-statistic-fails): an internal error in one
statistic is one :class:`DiagnosticsWarning` with its traceback and turns that statistic off; the others and
training go on. Strict mode (``strict=True``, or ``LIGHTNING_MPT_STRICT_DIAGNOSTICS=1`` as the tests run) raises the
error instead.

Example:
    ```python
    import warnings

    from lightning_mpt.diagnostics.statistic import DiagnosticsWarning, Statistic

    stat = Statistic("MyMonitor", "the ratio", strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with stat.guarded():
            1 / 0
    assert not stat.enabled and isinstance(stat.error, ZeroDivisionError)
    assert caught[0].category is DiagnosticsWarning
    ```
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import Optional

import torch

from lightning_mpt.core.numerics import FloatFormat

STRICT_ENV = "LIGHTNING_MPT_STRICT_DIAGNOSTICS"


def strict_from_env() -> bool:
    """Whether ``LIGHTNING_MPT_STRICT_DIAGNOSTICS`` asks for strict diagnostics (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class DiagnosticsWarning(UserWarning):
    """A diagnostic statistic failed and was turned off; training goes on."""


class Statistic:
    """A statistic that fails alone: an exception inside :meth:`guarded` turns it off with one
    :class:`DiagnosticsWarning` holding the traceback (or propagates, when ``strict``).

    Args:
        owner: who computes it, for the message (a callback's class name).
        what: what it is, for the message (e.g. ``"the fp32 reference (<its tags>)"``).
        strict: re-raise internal errors; ``None`` reads ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``.
    """

    def __init__(self, owner: str, what: str, strict: Optional[bool] = None) -> None:
        self.owner = owner
        self.what = what
        self.strict = strict_from_env() if strict is None else strict
        self.enabled = True
        self.retired = False  # off on every process (sharded parameters: see Recorder.submit)
        self.error: Optional[BaseException] = None

    def guarded(self) -> _FailureGuard:
        """A context that hands an ``Exception`` raised in it to :meth:`fail` (and swallows it unless strict)."""
        return _FailureGuard(self)

    def fail(self, error: BaseException) -> None:
        """Turn this statistic off with one warning, or raise ``error`` when strict."""
        if self.strict:
            raise error
        if not self.enabled:
            return
        self.enabled = False
        self.error = error
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        rank = process_rank()
        warnings.warn(
            f"{self.owner}: {self.what} failed{f' on rank {rank}' if rank else ''} with {type(error).__name__}: "
            f"{error}. It is off for the rest of this run; training and the other statistics go on. Set "
            f"{STRICT_ENV}=1 (or the callback's strict=True) to raise instead.\n{trace}",
            DiagnosticsWarning,
            stacklevel=3,
        )

    def retire(self, reason: str = "failed on another process (its warning holds the traceback)") -> None:
        """Turn this statistic off on every process, because of what happened on some process; say ``reason`` here
        unless this process already warned."""
        self.retired = True
        if self.enabled:
            self.enabled = False
            warnings.warn(
                f"{self.owner}: {self.what} {reason}. It is off on every process for the rest of this run; training "
                "and the other statistics go on.",
                DiagnosticsWarning,
                stacklevel=3,
            )


class PerParameter(Statistic):
    """A statistic of named parameters in a half format, written in total and, with ``per_parameter``, for each
    parameter under its name. Subclasses say what they measure in :attr:`what`.

    Args:
        names: the parameters' names, one per tensor the statistic is given.
        fmt: the half format.
        per_parameter: also write each parameter's figures.
        owner: who measures (for messages).
        strict: raise rather than warn when the statistic fails (``None``: ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).
    """

    what = "a per-parameter statistic"

    def __init__(
        self,
        names: Sequence[str],
        fmt: FloatFormat,
        per_parameter: bool = True,
        owner: str = "diagnostics",
        strict: Optional[bool] = None,
    ) -> None:
        super().__init__(owner, self.what, strict)
        self.names, self.fmt, self.per_parameter = list(names), fmt, per_parameter


def ratio(num: float, den: float) -> Optional[float]:
    """``num / den``, ``None`` when undefined (no values to take a share of)."""
    return num / den if den > 0 else None


class _FailureGuard:
    def __init__(self, stat: Statistic) -> None:
        self.stat = stat

    def __enter__(self) -> Statistic:
        return self.stat

    def __exit__(self, kind: Optional[type], error: Optional[BaseException], trace: Optional[TracebackType]) -> bool:
        if error is None or not isinstance(error, Exception) or self.stat.strict:
            return False  # nothing happened, an interrupt, or strict: let it propagate
        self.stat.fail(error)
        return True


def process_rank() -> int:
    """This process's rank in ``torch.distributed``, 0 without it."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
