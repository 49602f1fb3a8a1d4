"""Summarise what the loss scaler did and where precision was lost in the ``mpt/`` tags of one or more runs: the
logic behind ``lightning-mpt report``, usable from Python.

Every directory under the log directory that holds event files is a run (read by
:mod:`lightning_mpt.report_events`); runs without ``mpt/`` tags are listed in :attr:`Report.ignored`, truncated or
corrupt event files in :attr:`Report.unreadable`. All steps are optimizer steps, counted from 0 with skipped steps
included (the x axis of the monitors). The parameters with inf/NaN gradients, whether the loss was finite and a stop
by ``MPTPrecision``'s guard come from the monitors' **records** (``mpt/data/*``), never from the texts meant for
people.

Example:
    ```python
    from lightning_mpt.report import build_report, format_text

    report = build_report("runs")            # a TensorBoardLogger save_dir, or one version_N folder
    print(format_text(report))
    run = report.runs[0]
    print(run.skipped_steps, run.scale.median if run.scale else None, run.first_overflow_step)
    print(report.to_json())
    ```
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.exponent_axis import FORMATS
from lightning_mpt.report_advice import Advice, advice_section, advise
from lightning_mpt.report_events import (
    ExponentHistogram,
    ReportError,
    RunData,
    Series,
    check_event_file,
    decode_exponent_histogram,
    load_runs,
    unreadable_files,
)
from lightning_mpt.report_fp8 import Fp8Row, fp8_lines, fp8_rows

__all__ = [
    "UNDERFLOW_TAGS",
    "ExponentHistogram",
    "Ranked",
    "Report",
    "ReportError",
    "RunData",
    "RunSummary",
    "Stats",
    "build_report",
    "check_event_file",
    "decode_exponent_histogram",
    "format_scale",
    "format_text",
    "load_runs",
    "summarize",
]

PREFIX = tags.PREFIX
# per-parameter tags that rank the layers, best evidence first: the flush fraction (fp32 reference) sees the values
# the half format lost; without a reference, a large subnormal share is where flushing starts; zeros come last
# because they include structural zeros (dead ReLUs, unused embedding rows)
UNDERFLOW_TAGS = {
    tags.GRAD_UNDERFLOW: "flush fraction",
    tags.GRAD_SUBNORMAL: "subnormal fraction",
    tags.GRAD_ZERO: "zero fraction",
}


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


@dataclass
class RunSummary:
    """The numbers ``lightning-mpt report`` prints for one run (see :func:`summarize`)."""

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
    advice: list[Advice] = field(default_factory=list)  # what to change and why (lightning_mpt.report_advice)


@dataclass
class Report:
    """Summaries of the runs under one log directory, with what was read to make them."""

    logdir: str
    runs: list[RunSummary]
    data: list[RunData] = field(repr=False)
    ignored: list[str]  # runs with readable event files but no mpt/ tags
    unreadable: dict[str, str] = field(default_factory=dict)  # event file (relative path) -> what is wrong with it

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


# ---------------------------------------------------------------------------------------------------- summaries
def summarize(run: RunData) -> RunSummary:
    """The summary of one run: steps, skips, scale statistics, the first overflow, the parameters most often
    non-finite, a stop by the guard, the layers with the worst underflow and the update underflow.

    Example:
        ```python
        runs, _ = load_runs("runs")
        summary = summarize(runs[0])
        print(summary.skipped_steps, summary.first_overflow_step, list(summary.nonfinite_params)[:3])
        ```
    """
    # the format marks are written at step 0 whether or not a step was taken; the end-of-training record knows the
    # steps that no scalar was logged at (a LossScaleMonitor(every_n_steps) that missed the last ones)
    logged = (s for tag, series in run.scalars.items() if not tag.startswith(tags.FORMAT_MARKS) for s, _ in series)
    ends = run.record_list(tags.SUMMARY_RECORD)
    steps = max(1 + max(logged, default=-1), int(ends[-1].get("step", 0)) if ends else 0)
    overflow = run.series(tags.OVERFLOW)
    skipped_series = run.series(tags.SKIPPED_STEPS)
    # the cumulative count also covers steps before a resume; without it count the 0/1 flags
    skipped = int(skipped_series[-1][1]) if skipped_series else sum(v > 0 for _, v in overflow)
    skips = run.record_list(tags.SKIP_RECORD)
    names, complete = _nonfinite_params(run, skipped)
    if skips:
        first_overflow = min(r["step"] for r in skips)
        loss_nonfinite = sum(r.get("loss_finite") is False for r in skips)
    else:  # a run logged without records (no TensorBoard logger for them): the scalars
        first_overflow = next((s for s, v in overflow if v > 0), None)
        loss_nonfinite = sum(v > 0 for _, v in run.series(tags.LOSS_NONFINITE))
    stops = run.record_list(tags.STOP_RECORD)
    underflow_tag = next((t for t in UNDERFLOW_TAGS if run.per_parameter(t)), None)
    summary = RunSummary(
        run=run.name,
        path=str(run.path),
        format=_format(run),
        steps=steps,
        skipped_steps=skipped,
        skipped_share=skipped / steps if steps else 0.0,
        first_overflow_step=first_overflow,
        loss_nonfinite_steps=loss_nonfinite,
        scale=Stats.of(run.series(tags.LOSS_SCALE)),
        nonfinite_params=names,
        nonfinite_names_complete=complete,
        stopped={k: stops[-1].get(k) for k in ("step", "error", "message")} if stops else None,
        underflow_tag=underflow_tag,
        worst_underflow=_ranked(run, underflow_tag) if underflow_tag else [],
        flush=Stats.of(run.series(tags.GRAD_UNDERFLOW)),
        subnormal=Stats.of(run.series(tags.GRAD_SUBNORMAL)),
        update_underflow=Stats.of(run.series(tags.UPDATE_UNDERFLOW)),
        worst_update_underflow=_ranked(run, tags.UPDATE_UNDERFLOW),
        exponents=run.exponents,
        fp8=fp8_rows(run),
    )
    summary.advice = advise(run, summary)  # what to change, from the numbers above
    return summary


def _ranked(run: RunData, tag: str) -> list[Ranked]:
    ranked = [Ranked(name, st) for name, series in run.per_parameter(tag).items() if (st := Stats.of(series))]
    return sorted(ranked, key=lambda r: (-r.stats.mean, r.name))


def _nonfinite_params(run: RunData, skipped: int) -> tuple[dict[str, int], bool]:
    """Per parameter, the skipped steps its gradient was non-finite at, and whether every skipped step is counted.

    The end-of-training summary record counts every skipped step of the run, also those before a resume (the
    monitor's checkpointed counts); without it (training ended on an error other than the guard, or is still
    running) the skipped-step records of this log are counted.
    """
    summaries = run.record_list(tags.SUMMARY_RECORD)
    if summaries:
        counts = {str(k): int(v) for k, v in summaries[-1].get("params", {}).items()}
        complete = True
    else:
        skips = run.record_list(tags.SKIP_RECORD)
        counts = dict(Counter(name for r in skips for name in r.get("params", [])))
        complete = len(skips) >= skipped
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))), complete


def _format(run: RunData) -> Optional[str]:
    """fp16 or bf16: from the run record, else the exponent histograms, else the format marks."""
    for record in reversed(run.record_list(tags.RUN_RECORD)):
        if record.get("format"):
            return str(record["format"])
    return run.exponents.format if run.exponents is not None else _format_from_marks(run)


def _format_from_marks(run: RunData) -> Optional[str]:
    marks = run.series(tags.MIN_SUBNORMAL_EXPONENT)
    if not marks:
        return None
    return next((f.name for f in FORMATS if f.min_exponent == round(marks[-1][1])), None)


def build_report(logdir: Union[str, Path]) -> Report:
    """Read and summarise every run under ``logdir``.

    Raises :class:`ReportError` for a missing directory, one without event files, and runs without ``mpt/`` tags
    (naming the event files that are truncated or corrupt, and what is wrong with each).

    Example:
        ```python
        report = build_report("runs")
        worst = {r.run: r.worst_underflow[0].name for r in report.runs if r.worst_underflow}
        print(report.unreadable)  # {"version_1/events.out.tfevents...": "truncated: it ends at byte ..."}
        ```
    """
    data, ignored = load_runs(logdir)
    unreadable, lost = unreadable_files(Path(logdir), [d.name for d in data] + ignored)
    ignored = [name for name in ignored if name not in lost]  # named with their files below, not as "no mpt/ tags"
    if not data:
        damaged = "".join(f"\n  {path}: {what}" for path, what in unreadable.items())
        without = f"no {PREFIX} tags in the event files of {', '.join(ignored)}" if ignored else ""
        raise ReportError(
            f"{logdir}: nothing to report: "
            + (f"{without}; " if without else "")
            + (f"unreadable event files:{damaged}\n" if damaged else "")
            + "expected a run trained with lightning_mpt's callbacks (LossScaleMonitor, UnderflowMonitor, "
            "GradientHistogramMonitor) and a TensorBoardLogger."
        )
    return Report(str(logdir), [summarize(r) for r in data], data, ignored, unreadable)


# ---------------------------------------------------------------------------------------------------- the text
def format_text(report: Report, top: int = 5) -> str:
    """The report as text: a table with one column per run, then each run's lists (``top`` entries each).

    Example:
        ```python
        print(format_text(build_report("runs"), top=10))
        ```
    """
    runs = report.runs
    rows: list[tuple[str, list[str]]] = [
        ("format", [r.format or "?" for r in runs]),
        ("optimizer steps", [str(r.steps) for r in runs]),
        ("skipped steps", [f"{r.skipped_steps} ({_pct(r.skipped_share)})" for r in runs]),
        ("first overflow at step", [_opt(r.first_overflow_step) for r in runs]),
        ("skips with non-finite loss", [str(r.loss_nonfinite_steps) for r in runs]),
        ("stopped by the guard at step", [_opt(r.stopped.get("step") if r.stopped else None) for r in runs]),
        ("loss scale min", [format_scale(r.scale.min if r.scale else None) for r in runs]),
        ("loss scale median", [format_scale(r.scale.median if r.scale else None) for r in runs]),
        ("loss scale max", [format_scale(r.scale.max if r.scale else None) for r in runs]),
        ("loss scale last", [format_scale(r.scale.last if r.scale else None) for r in runs]),
        ("most often non-finite", [_first_count(r.nonfinite_params) for r in runs]),
        ("flush fraction mean/max", [_mean_max(r.flush) for r in runs]),
        ("subnormal fraction mean/max", [_mean_max(r.subnormal) for r in runs]),
        ("worst underflow layer", [_first_ranked(r.worst_underflow) for r in runs]),
        ("update underflow mean/last", [_mean_last(r.update_underflow) for r in runs]),
    ]
    head = ["", *(r.run if r.run != "." else Path(r.path).name for r in runs)]
    table = [head, *([label, *cells] for label, cells in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = [f"lightning-mpt report: {report.logdir} ({len(runs)} run{'s' if len(runs) != 1 else ''})", ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    for r, name in zip(runs, head[1:]):
        lines += ["", f"{name}:"]
        if r.stopped is not None:
            first = str(r.stopped.get("message") or "").strip().splitlines()[:1]
            lines.append(
                f"  stopped at step {r.stopped.get('step')} by {r.stopped.get('error')}"
                + (f": {first[0]}" if first else "")
            )
        lines += _listing(
            "parameters most often non-finite (skipped steps)",
            [f"{n}: {c}" for n, c in r.nonfinite_params.items()],
            top,
        )
        if not r.nonfinite_names_complete:
            lines.append("    (some skipped steps have no record of their names: counts are lower bounds)")
        if r.underflow_tag is None:
            lines.append("  worst underflow by layer: not logged (UnderflowMonitor with per_parameter=True)")
        else:
            what = UNDERFLOW_TAGS[r.underflow_tag]
            lines += _listing(
                f"worst underflow by layer ({what}, mean/max over logged steps)",
                [f"{x.name}: {_mean_max(x.stats)}" for x in r.worst_underflow if x.stats.max > 0],
                top,
                "none above 0%",
            )
        lines += _listing(
            "update underflow by layer (mean/last)",
            [f"{x.name}: {_mean_last(x.stats)}" for x in r.worst_update_underflow if x.stats.max > 0],
            top,
            "none above 0%",
        )
        lines += fp8_lines(r.fp8, top)
    lines += advice_section(head[1:], [r.advice for r in runs])
    if report.ignored:
        lines += ["", f"no {PREFIX} tags, not reported: {', '.join(report.ignored)}"]
    if report.unreadable:
        lines += ["", "unreadable event files (what could not be read is not in this report):"]
        lines += [f"  {path}: {what}" for path, what in report.unreadable.items()]
    return "\n".join(lines)


def _listing(title: str, items: list[str], top: int, empty: str = "none") -> list[str]:
    if not items:
        return [f"  {title}: {empty}"]
    more = [f"    ... and {len(items) - top} more"] if len(items) > top else []
    return [f"  {title}:", *(f"    {item}" for item in items[:top]), *more]


def _pct(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.3g}%" if x else "0%"


def format_scale(x: Optional[float]) -> str:
    """A loss scale as text: powers of two from 16 up as ``2^28`` (not ``2.68435e+08``), ``-`` for ``None``."""
    if x is None:
        return "-"
    exponent = math.log2(x) if x > 0 else 0.5
    return f"2^{exponent:.0f}" if exponent.is_integer() and abs(exponent) >= 4 else f"{x:g}"


def _opt(x: Optional[int]) -> str:
    return "-" if x is None else str(x)


def _mean_max(s: Optional[Stats]) -> str:
    return "-" if s is None else f"{_pct(s.mean)} / {_pct(s.max)}"


def _mean_last(s: Optional[Stats]) -> str:
    return "-" if s is None else f"{_pct(s.mean)} / {_pct(s.last)}"


def _first_count(counts: dict[str, int]) -> str:
    return next((f"{n} ({c})" for n, c in counts.items()), "-")


def _first_ranked(ranked: list[Ranked]) -> str:
    return f"{ranked[0].name} ({_pct(ranked[0].stats.mean)})" if ranked and ranked[0].stats.max > 0 else "-"
