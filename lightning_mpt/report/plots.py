"""PNG plots of a :class:`~lightning_mpt.report.data.Report` (needs matplotlib: ``pip install lightning-mpt[plots]``).

Figures are built with matplotlib's object API (``Figure``, no ``pyplot``), so writing them changes no global
state: no backend switch, no open windows, nothing left in a notebook.

Example:
    ```python
    from lightning_mpt.report import build_report
    from lightning_mpt.report.plots import write_plots

    paths = write_plots(build_report("runs"), "runs/report")   # ImportError without matplotlib
    ```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

from lightning_mpt.diagnostics import tags
from lightning_mpt.report.data import UNDERFLOW_TAGS, ExponentHistogram, Report, RunData, RunSummary, format_scale

__all__ = [
    "exponent_figure",
    "plot_exponents",
    "plot_scale",
    "plot_underflow_heatmap",
    "underflow_figure",
    "write_plots",
]

SCALE_PNG = "scale.png"
HEATMAP_PNG = "underflow_heatmap.png"
EXPONENTS_PNG = "exponent_histogram.png"
COMPARISON_PNG = "scale_comparison.png"
MAX_HEATMAP_ROWS = 40  # the worst layers of a large model; the rest would be unreadable rows


def write_plots(report: Report, out: Union[str, Path]) -> list[Path]:
    """Write each run's plots under ``out`` and return their paths.

    One run: ``out/scale.png``, ``out/underflow_heatmap.png``, ``out/exponent_histogram.png`` (each when its data
    was logged). Several runs: the same under ``out/<run>/`` and the overlaid ``out/scale_comparison.png``.
    Raises ``ImportError`` without matplotlib, before anything is written.
    """
    import matplotlib  # noqa: F401  (fail before creating folders)

    out = Path(out)
    written: list[Path] = []
    several = len(report.runs) > 1
    for run, summary in zip(report.data, report.runs):
        folder = out / run.name if several else out
        folder.mkdir(parents=True, exist_ok=True)
        if run.series(tags.LOSS_SCALE):
            written.append(plot_scale([run], folder / SCALE_PNG))
        if summary.underflow_tag is not None:
            written.append(plot_underflow_heatmap(run, summary, folder / HEATMAP_PNG))
        if run.exponents is not None:
            scale = dict(run.series(tags.LOSS_SCALE)).get(run.exponents.step)
            written.append(plot_exponents(run.exponents, folder / EXPONENTS_PNG, scale))
    with_scale = [r for r in report.data if r.series(tags.LOSS_SCALE)]
    if several and with_scale:
        out.mkdir(parents=True, exist_ok=True)
        written.append(plot_scale(with_scale, out / COMPARISON_PNG))
    return written


def plot_scale(runs: Sequence[RunData], path: Union[str, Path]) -> Path:
    """The loss scale over the optimizer steps on a log2 axis, skipped steps marked ``x``; several runs overlaid."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, ax = _figure(8, 3.6)
    for i, run in enumerate(runs):
        color = f"C{i}"
        series = run.series(tags.LOSS_SCALE)
        scale_at = dict(series)
        skipped = [s for s, v in run.series(tags.OVERFLOW) if v > 0 and s in scale_at]
        label = f"{run.name} ({len(skipped)} skipped)" if len(runs) > 1 else f"loss scale ({len(skipped)} skipped)"
        ax.step([s for s, _ in series], [v for _, v in series], where="post", color=color, label=label)
        ax.scatter(
            skipped,
            [scale_at[s] for s in skipped],
            marker="x",
            color=color if len(runs) > 1 else "C3",
            zorder=3,
            label=None if len(runs) > 1 else "skipped step (overflow)",
        )
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"$2^{{{math.log2(v):g}}}$" if v > 0 else ""))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps are whole numbers
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale")
    ax.set_title("Loss scale" + (" by run" if len(runs) > 1 else "") + " (x: skipped steps)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    return _save(fig, path)


def plot_underflow_heatmap(run: RunData, summary: RunSummary, path: Union[str, Path]) -> Path:
    """Per-parameter underflow over time (the summary's ``underflow_tag``): one row per parameter, worst first; with
    a single logged step, one bar per parameter at that step instead (see :func:`underflow_figure`)."""
    return _save(underflow_figure(run, summary), path)


def underflow_figure(run: RunData, summary: RunSummary) -> Any:
    """The matplotlib ``Figure`` of :func:`plot_underflow_heatmap`: a heatmap over the optimizer steps, or bars when
    the underflow was logged at one step only (a heatmap of one column would invent a time axis around it), or the
    words "No underflow" when every logged value is 0.

    Args:
        run: the run's data (:func:`lightning_mpt.report.load_runs`).
        summary: its summary, whose ``underflow_tag`` picks the tag and ``worst_underflow`` the rows.

    Example:
        ```python
        from lightning_mpt.report import build_report

        report = build_report("runs")
        fig = underflow_figure(report.data[0], report.runs[0])
        print(fig.axes[0].get_xlabel())   # "optimizer step", or "flush fraction (%)" for one logged step
        # a run that lost nothing gets a figure that says so ("No underflow: ..."), not a blank heatmap
        ```
    """
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    tag = summary.underflow_tag
    if tag is None:
        raise ValueError(f"plot_underflow_heatmap: the run in {run.path} has no per-parameter underflow tags to plot.")
    per_param = run.per_parameter(tag)
    names = [r.name for r in summary.worst_underflow][:MAX_HEATMAP_ROWS]
    steps = sorted({s for n in names for s, _ in per_param[n]})
    if not any(v > 0 for n in names for _, v in per_param[n]):  # an all-zero heatmap would be a blank plot
        return _nothing(
            f"No underflow: the {UNDERFLOW_TAGS[tag]} was 0% for all {len(names)} parameters at all "
            f"{len(steps)} logged steps"
        )
    fig, ax = _figure(8, 1.6 + 0.28 * len(names))
    total = len(summary.worst_underflow)
    shown = f"of the worst {len(names)} of {total} parameters" if total > len(names) else "by parameter"
    if len(steps) == 1:
        ax.barh(range(len(names)), [100 * dict(per_param[n]).get(steps[0], math.nan) for n in names], color="C1")
        ax.set_yticks(range(len(names)), names, fontsize="small")
        ax.invert_yaxis()  # worst on top
        ax.set_xlabel(f"{UNDERFLOW_TAGS[tag]} (%)")
        ax.set_title(f"{UNDERFLOW_TAGS[tag].capitalize()} {shown} at step {steps[0]}, the one logged step")
        ax.grid(True, axis="x", alpha=0.3)
        return fig
    column = {s: j for j, s in enumerate(steps)}
    grid = np.full((len(names), len(steps)), np.nan)
    for i, name in enumerate(names):
        for s, v in per_param[name]:
            grid[i, column[s]] = 100 * v
    x = np.asarray(steps, dtype=float)
    half = np.diff(x).min() / 2
    edges = np.concatenate([[x[0] - half], (x[1:] + x[:-1]) / 2, [x[-1] + half]])
    top = np.nanmax(grid) if np.isfinite(grid).any() else 0.0
    mesh = ax.pcolormesh(
        edges, np.arange(len(names) + 1), np.ma.masked_invalid(grid), cmap="magma_r", vmin=0.0, vmax=max(top, 1e-3)
    )
    fig.colorbar(mesh, ax=ax, label=f"{UNDERFLOW_TAGS[tag]} (%)")
    ax.set_yticks(np.arange(len(names)) + 0.5, names, fontsize="small")
    ax.invert_yaxis()  # worst on top
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title(f"{UNDERFLOW_TAGS[tag].capitalize()} {shown}, max {top:.3g}%")
    return fig


def plot_exponents(hist: ExponentHistogram, path: Union[str, Path], scale: Optional[float] = None) -> Path:
    """The exponent histogram ``floor(log2|g * scale|)`` of the stored gradients at the last logged step, with the
    format's flush region, subnormal range, min normal and max marked; zeros and inf/NaN in their own bars.
    ``scale``, the loss scale at that step, goes into the title (see :func:`exponent_figure`)."""
    return _save(exponent_figure(hist, scale), path)


def exponent_figure(hist: ExponentHistogram, scale: Optional[float] = None) -> Any:
    """The matplotlib ``Figure`` of :func:`plot_exponents`.

    Args:
        hist: the summed exponent histogram (``RunSummary.exponents``).
        scale: the loss scale at its step, for the title.

    Example:
        ```python
        from lightning_mpt.report import build_report

        (run,) = build_report("runs").runs
        labels = [t.get_text() for t in exponent_figure(run.exponents).axes[0].get_xticklabels()]
        assert labels[0] == "zero" and labels[-1] == "inf/NaN" and labels.count("0") == 1
        ```
    """
    fmt = hist.fmt
    lo, normal, hi = fmt.min_exponent, fmt.normal_exponent, fmt.max_exponent
    fig, ax = _figure(8, 3.8)
    exps = list(range(lo, hi + 1))
    ax.bar(exps, [hist.counts.get(e, 0.0) for e in exps], width=0.9, color="C0", label="stored values")
    ax.bar([lo - 3], [hist.zero], width=0.9, color="0.45", label="exact zeros")
    ax.bar([hi + 3], [hist.nonfinite], width=0.9, color="C3", label="inf / NaN")
    ax.axvspan(lo - 2, lo - 0.5, color="0.85", lw=0)  # below 2^lo: flushed to zero
    ax.axvspan(lo - 0.5, normal - 0.5, color="C1", alpha=0.15, lw=0, label=f"subnormal (2^{lo} .. 2^{normal})")
    ax.axvspan(hi + 0.5, hi + 2, color="C3", alpha=0.15, lw=0)  # above the max: overflows to inf
    # labels outside the subnormal band, so that they do not overlap where the band is narrow (bf16)
    marks = (
        (lo - 0.5, f"min subnormal 2^{lo}", "right"),
        (normal - 0.5, f"min normal 2^{normal}", "left"),
        (hi + 0.5, f"max {fmt.max:.5g}", "right"),
    )
    for x, text, side in marks:
        ax.axvline(x, color="k", ls="--", lw=0.8)
        ax.annotate(
            text, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha=side, fontsize="x-small"
        )
    every = 4 if fmt.name == "fp16" else 32
    # exponent ticks, minus those that would collide with the "zero" and "inf/NaN" labels at the ends; the bar of
    # exact zeros is "zero", not "0", which is the tick of exponent 0 (2^0 = 1)
    ticks = [t for t in range(lo, hi + 1) if t % every == 0 and lo - 3 + every / 2 <= t <= hi + 3 - every / 2]
    ax.set_xticks([lo - 3, *ticks, hi + 3], ["zero", *map(str, ticks), "inf/NaN"], fontsize="small")
    ax.set_xlim(lo - 4, hi + 4)
    ax.set_yscale("symlog", linthresh=1)  # the one inf and the bulk of the values on one chart
    ax.set_xlabel("exponent floor(log2 |g x scale|) of the stored gradient")
    ax.set_ylabel("values")
    at = f"step {hist.step}" + (f", loss scale {format_scale(scale)}" if scale is not None else "")
    ax.set_title(f"Stored {fmt.name} gradients at {at} ({len(hist.parameters)} parameters)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small")
    return fig


def _nothing(message: str) -> Any:
    """A small figure whose one (bare) axes says ``message``, instead of a plot with nothing on it."""
    fig, ax = _figure(8, 2)
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    return fig


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots()


def _save(fig: Any, path: Union[str, Path]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
