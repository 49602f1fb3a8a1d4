"""The summary of each run: steps, skips, the loss scale, where precision was lost, and the advice; and
:func:`build_report`, which reads a log directory and summarises every run in it.

All steps are optimizer steps, counted from 0 with skipped steps included (the x axis of the monitors). The parameters
with inf/NaN gradients, whether the loss was finite and a stop by ``MPTPrecision``'s guard come from the monitors'
**records** (``mpt/data/*``), never from the texts meant for people.

Example:
    ```python
    report = build_report("runs")
    run = report.runs[0]
    print(run.steps, run.skipped_steps, run.skips.probes, [a.rule for a in run.advice])
    ```
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional, Union

from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.exponent_axis import FORMATS
from lightning_mpt.report.advice import advise, run_scaling
from lightning_mpt.report.data import UNDERFLOW_TAGS, Ranked, Report, ReportError, RunData, RunSummary, Stats
from lightning_mpt.report.events import read_runs, unreadable_files
from lightning_mpt.report.folders import find_runs
from lightning_mpt.report.fp8 import fp8_rows
from lightning_mpt.report.skips import classify_skips

__all__ = ["build_report", "summarize"]


# ---------------------------------------------------------------------------------------------------- summaries
def summarize(run: RunData) -> RunSummary:
    """The summary of one run: steps, skips, scale statistics, the first overflow, the parameters most often
    non-finite, a stop by the guard, the layers with the worst underflow and the update underflow.

    Args:
        run: what was read of the run (:func:`~lightning_mpt.report.events.load_runs`).

    Example:
        ```python
        from lightning_mpt.report.events import load_runs

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
        precision=run.run_record().get("precision"),
        master_weights=run.run_record().get("master_weights"),
        skips=classify_skips(run, run_scaling(run)),
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

    Raises :class:`~lightning_mpt.report.data.ReportError` for a missing directory, one without event files, and one
    with nothing to report (naming what could not be read, and what is wrong with each). Whatever else cannot be read
    (damaged event files, folders that cannot be listed, broken links, records of another schema or malformed) is
    named in :attr:`Report.unreadable`, and the rest is reported.

    Args:
        logdir: a TensorBoard log directory (a ``TensorBoardLogger``'s ``save_dir``, or one run's folder).

    Example:
        ```python
        report = build_report("runs")
        worst = {r.run: r.worst_underflow[0].name for r in report.runs if r.worst_underflow}
        print(report.unreadable)  # {"version_1/events.out.tfevents...": "truncated: it ends at byte ..."}
        ```
    """
    found = find_runs(logdir)
    data, ignored = read_runs(found)
    damaged, lost = unreadable_files(found.root, [d.name for d in data] + ignored)
    ignored = [name for name in ignored if name not in lost]  # named with their files below, not as "no mpt/ tags"
    unreadable = {**found.unreadable, **damaged}
    runs, summaries = [], []
    for run in data:
        try:
            summary = summarize(run)
        except (ArithmeticError, LookupError, TypeError, ValueError) as error:  # values no check foresaw: this run only
            unreadable[run.name] = f"it cannot be summarised ({type(error).__name__}: {error})"
            continue
        if run.unreadable:
            unreadable[run.name] = f"its records are not read, the run is reported from its scalars: {run.unreadable}"
        runs.append(run)
        summaries.append(summary)
    unreadable = dict(sorted(unreadable.items()))
    if not runs:
        listed = "".join(f"\n  {path}: {what}" for path, what in unreadable.items())
        without = f"no {tags.PREFIX} tags in the event files of {', '.join(ignored)}" if ignored else ""
        raise ReportError(
            f"{logdir}: nothing to report: "
            + (f"{without}; " if without else "")
            + (f"unreadable:{listed}\n" if listed else "")
            + "expected a run trained with lightning_mpt's callbacks (LossScaleMonitor, UnderflowMonitor, "
            "GradientHistogramMonitor) and a TensorBoardLogger."
        )
    return Report(str(logdir), summaries, runs, ignored, unreadable)
