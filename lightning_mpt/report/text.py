"""The report as text: a table comparing the runs, each run's lists, the advice, and what could not be read.

The table has one column per run. It fits ``width`` characters (a terminal's): when the runs' full names do not fit
side by side, the columns are named by the shortest names that tell the runs apart (the path parts all runs share
left out), or by number, with a legend, and the columns go into as many tables as the width needs.

Example:
    ```python
    from lightning_mpt.report import build_report

    text = format_text(build_report("runs"), top=10, width=100)
    assert max(len(line) for line in text.splitlines()[:20]) <= 100
    ```
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Optional

from lightning_mpt.diagnostics import tags
from lightning_mpt.report.data import UNDERFLOW_TAGS, Advice, Ranked, Report, RunSummary, Stats, format_scale, pct
from lightning_mpt.report.fp8 import fp8_lines

__all__ = ["WIDTH", "advice_section", "format_text", "run_labels"]

#: the width the text fits when none is given: a terminal's of 100 columns
WIDTH = 100
# a column named by a shortened path longer than this is named by number instead; a cell longer than this (a long
# parameter name) keeps its end, which holds the layer and the number
_NAME = 20
_CELL = 30
_GAP = "  "


def format_text(report: Report, top: int = 5, width: int = WIDTH) -> str:
    """The report as text: the table comparing the runs (fitting ``width`` characters), each run's lists (``top``
    entries each), the advice, and what could not be read.

    Args:
        report: what :func:`~lightning_mpt.report.summary.build_report` returned.
        top: entries per list.
        width: the characters per line the table fits (the per-run lists and the advice are sentences: they wrap as
            the terminal wraps them).

    Example:
        ```python
        from lightning_mpt.report import build_report

        print(format_text(build_report("runs"), top=10))
        ```
    """
    runs = report.runs
    names = [r.run if r.run != "." else Path(r.path).name for r in runs]
    lines = [f"lightning-mpt report: {report.logdir} ({len(runs)} run{'s' if len(runs) != 1 else ''})", ""]
    lines += _table(runs, names, width)
    for r, name in zip(runs, names):
        lines += ["", f"{name}:", *_run_lines(r, top)]
    lines += advice_section(names, [r.advice for r in runs], width)
    if report.ignored:
        lines += ["", f"no {tags.PREFIX} tags, not reported: {', '.join(report.ignored)}"]
    if report.unreadable:
        lines += ["", "unreadable (what could not be read is not in this report):"]
        lines += [f"  {path}: {what}" for path, what in report.unreadable.items()]
    return "\n".join(lines)


def run_labels(names: list[str], limit: int = _NAME) -> list[str]:
    """Short names for the columns of ``names`` (runs' paths): the path parts all of them share at the start and at
    the end left out; ``#1``, ``#2``, ... when one is still longer than ``limit`` or two are the same.

    Args:
        names: the runs' names (paths relative to the log directory).
        limit: the longest short name kept.

    Example:
        ```python
        assert run_labels(["story/dynamic/version_0", "story/unscaled/version_0"]) == ["dynamic", "unscaled"]
        assert run_labels(["a/very/long/path/name/of/a/run", "b"]) == ["#1", "#2"]
        ```
    """
    parts = [n.split("/") for n in names]
    if len(parts) > 1:
        while all(len(p) > 1 for p in parts) and len({p[0] for p in parts}) == 1:
            parts = [p[1:] for p in parts]
        while all(len(p) > 1 for p in parts) and len({p[-1] for p in parts}) == 1:
            parts = [p[:-1] for p in parts]
    short = ["/".join(p) for p in parts]
    if len(set(short)) < len(short) or any(len(s) > limit for s in short):
        return [f"#{i}" for i in range(1, len(names) + 1)]
    return short


def advice_section(names: list[str], advice: list[list[Advice]], width: int = WIDTH) -> list[str]:
    """The report's closing section: a blank line, its title, then each run's name and its advice, each item wrapped
    to ``width`` characters (``nothing to change`` for a run no rule applies to).

    Args:
        names: the runs' names as the table shows them.
        advice: each run's advice (:func:`~lightning_mpt.report.advice.advise`), in the same order.
        width: the characters per line.

    Example:
        ```python
        lines = advice_section(["a", "b"], [[], [Advice("underflow", "Raise the scale.", {})]])
        assert lines[1:] == ["advice (what to change, and why):", "a: nothing to change (no rule applies)", "b:",
                             "  - Raise the scale. [underflow]"]
        ```
    """
    lines = ["", "advice (what to change, and why):"]
    for name, found in zip(names, advice):
        if not found:
            lines.append(f"{name}: nothing to change (no rule applies)")
            continue
        lines.append(f"{name}:")
        for a in found:
            lines += textwrap.wrap(
                f"{a.text} [{a.rule}]",
                width,
                initial_indent="  - ",
                subsequent_indent="    ",
                break_long_words=False,
                break_on_hyphens=False,
            )
    return lines


def _table(runs: list[RunSummary], names: list[str], width: int) -> list[str]:
    rows: list[tuple[str, list[str]]] = [
        ("format", [r.format or "?" for r in runs]),
        ("optimizer steps", [str(r.steps) for r in runs]),
        ("skipped steps", [f"{r.skipped_steps} ({pct(r.skipped_share)})" for r in runs]),
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
    label = max(len(text) for text, _ in rows)
    columns = [[name, *(cells[i] for _, cells in rows)] for i, name in enumerate(names)]
    if label + sum(len(_GAP) + max(map(len, c)) for c in columns) <= width:
        return _block([text for text, _ in rows], columns)  # the full names fit side by side
    labels = run_labels(names)
    columns = [[head, *(_fit(cell) for cell in c[1:])] for head, c in zip(labels, columns)]
    legend = [f"  {head}: {name}" for head, name in zip(labels, names) if head != name]
    lines = ["columns:", *legend] if legend else []
    block: list[list[str]] = []
    for column in columns:  # as many columns per table as fit the width (at least one)
        used = label + sum(len(_GAP) + max(map(len, c)) for c in [*block, column])
        if block and used > width:
            lines += [*([""] if lines else []), *_block([text for text, _ in rows], block)]
            block = []
        block.append(column)
    return [*lines, *([""] if lines else []), *_block([text for text, _ in rows], block)]


def _block(labels: list[str], columns: list[list[str]]) -> list[str]:
    table = [["", *labels], *columns]
    widths = [max(map(len, column)) for column in table]
    return [_GAP.join(column[i].ljust(w) for column, w in zip(table, widths)).rstrip() for i in range(len(labels) + 1)]


def _fit(cell: str) -> str:
    return cell if len(cell) <= _CELL else "..." + cell[-(_CELL - 3) :]


def _run_lines(r: RunSummary, top: int) -> list[str]:
    lines = []
    if r.stopped is not None:
        first = str(r.stopped.get("message") or "").strip().splitlines()[:1]
        lines.append(
            f"  stopped at step {r.stopped.get('step')} by {r.stopped.get('error')}"
            + (f": {first[0]}" if first else "")
        )
    kinds = r.skips
    if kinds.start or kinds.probes:  # a dynamic scale at work: say which skips were its doing
        lines += [
            "  skipped steps by kind:",
            f"    at the start, while the scale backed off: {len(kinds.start)}",
            f"    growth probes (an overflow at a scale just grown: the dynamic scaler at work): {len(kinds.probes)}",
            f"    other: {len(kinds.other)}",
        ]
    lines += _listing(
        "parameters most often non-finite (skipped steps)", [f"{n}: {c}" for n, c in r.nonfinite_params.items()], top
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
    # what a half weight would lose; whether it is lost depends on what holds the weights (a fact, not advice)
    kept = ""
    if r.master_weights:
        kept = "; the fp32 master weights keep these updates"
    elif r.master_weights is None and (r.precision or "").endswith("-mixed"):
        kept = "; the weights are fp32 (autocast): these updates are kept"
    lines += _listing(
        f"update underflow by layer (mean/last{kept})",
        [f"{x.name}: {_mean_last(x.stats)}" for x in r.worst_update_underflow if x.stats.max > 0],
        top,
        "none above 0%",
    )
    return lines + fp8_lines(r.fp8, top)


def _listing(title: str, items: list[str], top: int, empty: str = "none") -> list[str]:
    if not items:
        return [f"  {title}: {empty}"]
    more = [f"    ... and {len(items) - top} more"] if len(items) > top else []
    return [f"  {title}:", *(f"    {item}" for item in items[:top]), *more]


def _opt(x: Optional[int]) -> str:
    return "-" if x is None else str(x)


def _mean_max(s: Optional[Stats]) -> str:
    return "-" if s is None else f"{pct(s.mean)} / {pct(s.max)}"


def _mean_last(s: Optional[Stats]) -> str:
    return "-" if s is None else f"{pct(s.mean)} / {pct(s.last)}"


def _first_count(counts: dict[str, int]) -> str:
    return next((f"{n} ({c})" for n, c in counts.items()), "-")


def _first_ranked(ranked: list[Ranked]) -> str:
    return f"{ranked[0].name} ({pct(ranked[0].stats.mean)})" if ranked and ranked[0].stats.max > 0 else "-"
