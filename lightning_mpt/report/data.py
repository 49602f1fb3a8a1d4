"""The report's data types, the bottom of ``lightning_mpt.report``: what was read from a run, its summary, the
advice, and how their numbers are written. Every other module of the package imports these; this one imports none
of them.

Example:
    ```python
    from lightning_mpt.report.data import Advice, Stats, format_scale

    stats = Stats.of([(0, 1024.0), (1, 512.0), (2, float("nan"))])   # non-finite points are left out
    assert (stats.points, stats.max, stats.last_step) == (2, 1024.0, 1)
    assert format_scale(2.0**28) == "2^28" and format_scale(2.0**28, code=True) == "2.0**28"
    assert Advice("masters", "Turn master_weights on.").numbers == {}
    ```
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.exponent_axis import FORMATS, FloatFormat

__all__ = [
    "UNDERFLOW_TAGS",
    "Advice",
    "ExponentHistogram",
    "Fp8Row",
    "Ranked",
    "Report",
    "ReportError",
    "RunData",
    "RunSummary",
    "Series",
    "SkipKinds",
    "Stats",
    "format_scale",
]

Series = list[tuple[int, float]]
Records = list[tuple[int, dict[str, Any]]]

# per-parameter tags that rank the layers, best evidence first: the flush fraction (fp32 reference) sees the values
# the half format lost; without a reference, a large subnormal share is where flushing starts; zeros come last
# because they include structural zeros (dead ReLUs, unused embedding rows)
UNDERFLOW_TAGS = {
    tags.GRAD_UNDERFLOW: "flush fraction",
    tags.GRAD_SUBNORMAL: "subnormal fraction",
    tags.GRAD_ZERO: "zero fraction",
}


class ReportError(ValueError):
    """The log directory cannot be reported on; the message says what was wrong and what is expected."""


@dataclass(frozen=True)
class ExponentHistogram:
    """The exponent histogram of stored half gradients (``mpt/grad_exponent/*``) at one step, summed over the
    parameters logged at that step: ``counts[e]`` values with ``floor(log2|g * scale|) == e``."""

    step: int
    format: str
    zero: float
    nonfinite: float
    counts: dict[int, float]
    parameters: list[str]

    @property
    def fmt(self) -> FloatFormat:
        return next(f for f in FORMATS if f.name == self.format)


@dataclass
class RunData:
    """What was read from one run's event files: its ``mpt/`` scalars, its records (``mpt/data/*``, decoded JSON
    objects in step order) and the last exponent histograms.

    ``unreadable`` says why the run's records were left out (the first bad record: another schema, a field of the
    wrong type, not JSON); the run is then summarised from its scalars, which are the fixed contract of the tags.
    """

    name: str  # path relative to the log directory ("." for the log directory itself)
    path: Path
    scalars: dict[str, Series]
    records: dict[str, Records]
    exponents: Optional[ExponentHistogram]
    unreadable: Optional[str] = None

    def series(self, tag: str) -> Series:
        return self.scalars.get(tag, [])

    def record_list(self, tag: str) -> list[dict[str, Any]]:
        """The records of ``tag`` (e.g. :data:`lightning_mpt.diagnostics.tags.SKIP_RECORD`), in step order."""
        return [r for _, r in self.records.get(tag, [])]

    def run_record(self) -> dict[str, Any]:
        """The last ``mpt/data/run`` record (the precision plugin, the scaler's configuration), ``{}`` without one."""
        found = self.record_list(tags.RUN_RECORD)
        return found[-1] if found else {}

    def per_parameter(self, tag: str) -> dict[str, Series]:
        """``{parameter name: series}`` of the tags ``<tag>/<parameter name>``."""
        prefix = tag + "/"
        return {t[len(prefix) :]: s for t, s in self.scalars.items() if t.startswith(prefix)}


@dataclass(frozen=True)
class Stats:
    """Statistics of one logged series (finite points only)."""

    points: int
    min: float
    median: float
    mean: float
    max: float
    last: float
    last_step: int

    @classmethod
    def of(cls, series: Series) -> Optional[Stats]:
        """The statistics of ``series`` (``(step, value)`` pairs in step order), ``None`` without a finite point."""
        finite = [(s, v) for s, v in series if math.isfinite(v)]
        if not finite:
            return None
        values = [v for _, v in finite]
        return cls(
            len(values),
            min(values),
            statistics.median(values),
            statistics.fmean(values),
            max(values),
            values[-1],
            finite[-1][0],
        )


@dataclass(frozen=True)
class Ranked:
    """A parameter and the statistics of one of its per-parameter series."""

    name: str
    stats: Stats


@dataclass(frozen=True)
class Fp8Row:
    """One layer and role of the fp8 casts over the logged steps: worst saturation, mean and max flush, last scale."""

    layer: str
    role: str
    saturated: float  # max over logged steps
    flush: float  # mean over logged steps
    flush_max: float
    subnormal: float  # mean over logged steps
    amax: Optional[float]  # last logged
    scale: Optional[float]  # last logged


@dataclass(frozen=True)
class Advice:
    """One line of advice: the rule that gave it, the sentence, and the numbers of the run behind it.

    Args:
        rule: the rule's id (the name of its function in ``lightning_mpt.report.advice.RULES``, e.g.
            ``"static_overflow"``).
        text: the sentence the report prints.
        numbers: the measured values the sentence quotes (plain JSON values).

    Example:
        ```python
        advice = Advice("skips_at_start", "The first 4 optimizer steps were skipped ...", {"leading_skips": 4})
        assert advice.numbers["leading_skips"] == 4
        ```
    """

    rule: str
    text: str
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SkipKinds:
    """The skipped steps of a run by kind, each list in step order.

    Args:
        start: the skips at steps 0, 1, 2, ... in a row while a dynamic scale backed off from its initial value.
        probes: skips at a scale the dynamic scaler had just grown to (one per growth that overflowed).
        other: the rest: overflows at a scale that had worked, every skip under a static scale.

    Example:
        ```python
        kinds = SkipKinds(start=[0, 1, 2], probes=[25, 55], other=[100])
        assert len(kinds.start) + len(kinds.probes) + len(kinds.other) == 6
        ```
    """

    start: list[int] = field(default_factory=list)
    probes: list[int] = field(default_factory=list)
    other: list[int] = field(default_factory=list)


@dataclass
class RunSummary:
    """The numbers ``lightning-mpt report`` prints for one run (see ``lightning_mpt.report.summarize``)."""

    run: str
    path: str
    format: Optional[str]  # "fp16" or "bf16" (from the exponent histograms or the format marks), None if unknown
    steps: int  # optimizer steps: 1 + the last step an mpt/ scalar was logged at, or the end-of-training record's
    skipped_steps: int
    skipped_share: float
    first_overflow_step: Optional[int]
    loss_nonfinite_steps: int  # skipped steps whose loss itself was inf/NaN
    scale: Optional[Stats]  # mpt/loss_scale over its logged points
    nonfinite_params: dict[str, int]  # parameter -> skipped steps with an inf/NaN gradient in it, most first
    nonfinite_names_complete: bool  # False when some skipped steps have no record of their names
    stopped: Optional[dict[str, Any]]  # the guard stopped training: {"step", "error", "message"}, else None
    underflow_tag: Optional[str]  # the per-parameter tag that ranks the layers (UNDERFLOW_TAGS, first present)
    worst_underflow: list[Ranked]  # by mean of underflow_tag, worst first (all parameters)
    flush: Optional[Stats]  # mpt/grad_underflow_fraction (fp32 reference steps)
    subnormal: Optional[Stats]  # mpt/grad_subnormal_fraction
    update_underflow: Optional[Stats]  # mpt/update_underflow_fraction
    worst_update_underflow: list[Ranked]
    exponents: Optional[ExponentHistogram]
    fp8: list[Fp8Row] = field(default_factory=list)  # torchao's fp8 casts by layer and role, worst first
    advice: list[Advice] = field(default_factory=list)  # what to change and why (lightning_mpt.report.advice)
    precision: Optional[str] = None  # the precision plugin's name of it ("16-mixed", "bf16-true", ...; the run record)
    master_weights: Optional[bool] = None  # fp32 masters of MPTPrecision (the run record); None: not ours or unknown
    skips: SkipKinds = field(default_factory=SkipKinds)  # the skipped steps by kind (lightning_mpt.report.skips)


@dataclass
class Report:
    """Summaries of the runs under one log directory, with what was read to make them."""

    logdir: str
    runs: list[RunSummary]
    data: list[RunData] = field(repr=False)
    ignored: list[str]  # runs with readable event files but no mpt/ tags
    # what could not be read, {path relative to logdir: what is wrong}: damaged event files, folders that cannot be
    # listed, broken links, runs whose records are of another schema or malformed
    unreadable: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The summaries as plain data (what ``--json`` prints); non-finite numbers become ``None``."""
        data: dict[str, Any] = _finite({
            "logdir": self.logdir,
            "runs": [asdict(r) for r in self.runs],
            "ignored": self.ignored,
            "unreadable": self.unreadable,
        })
        return data

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def format_scale(x: Optional[float], code: bool = False) -> str:
    """A loss scale as text: powers of two from 16 up as ``2^28`` (``2.0**28`` with ``code``), not ``2.68435e+08``;
    other numbers as they are, ``-`` for ``None``."""
    if x is None:
        return "-"
    exponent = math.log2(x) if x > 0 else 0.5
    if exponent.is_integer() and abs(exponent) >= 4:
        return f"2.0**{exponent:.0f}" if code else f"2^{exponent:.0f}"
    return f"{x:g}"


def pct(x: Optional[float]) -> str:
    """A share as a percent with 3 significant digits (``"0%"`` for 0, ``"-"`` for ``None``)."""
    if x is None:
        return "-"
    return f"{100 * x:.3g}%" if x else "0%"
