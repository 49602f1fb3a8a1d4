"""Summarise what the loss scaler did and where precision was lost in the ``mpt/`` tags of one or more runs: the
logic behind ``lightning-mpt report``, usable from Python.

Every directory under the log directory that holds event files is a run (each real folder once: links are followed
without loops or doubles); runs without ``mpt/`` tags are listed in :attr:`Report.ignored`, and whatever cannot be
read (damaged event files, folders that cannot be listed, broken links, records of another schema) in
:attr:`Report.unreadable`, with what is wrong with each. All steps are optimizer steps, counted from 0 with skipped
steps included (the x axis of the monitors).

The modules, each importing only those above it in this list: :mod:`~lightning_mpt.report.data` (the types),
:mod:`~lightning_mpt.report.folders` (finding the runs), :mod:`~lightning_mpt.report.records` (checking the
records), :mod:`~lightning_mpt.report.events` (reading the event files), :mod:`~lightning_mpt.report.skips` (the
skipped steps by kind), :mod:`~lightning_mpt.report.fp8`, :mod:`~lightning_mpt.report.advice` (the rules),
:mod:`~lightning_mpt.report.summary` (the summary of a run, :func:`build_report`), :mod:`~lightning_mpt.report.text`
and :mod:`~lightning_mpt.report.plots` (matplotlib, imported on its own). The command ``lightning-mpt`` is
:mod:`lightning_mpt.cli`, on top.

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

from lightning_mpt.report.advice import RULES, advise
from lightning_mpt.report.data import (
    UNDERFLOW_TAGS,
    Advice,
    ExponentHistogram,
    Fp8Row,
    Ranked,
    Report,
    ReportError,
    RunData,
    RunSummary,
    SkipKinds,
    Stats,
    format_scale,
)
from lightning_mpt.report.events import check_event_file, decode_exponent_histogram, load_runs
from lightning_mpt.report.summary import build_report, summarize
from lightning_mpt.report.text import advice_section, format_text

__all__ = [
    "RULES",
    "UNDERFLOW_TAGS",
    "Advice",
    "ExponentHistogram",
    "Fp8Row",
    "Ranked",
    "Report",
    "ReportError",
    "RunData",
    "RunSummary",
    "SkipKinds",
    "Stats",
    "advice_section",
    "advise",
    "build_report",
    "check_event_file",
    "decode_exponent_histogram",
    "format_scale",
    "format_text",
    "load_runs",
    "summarize",
]
