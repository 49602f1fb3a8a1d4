"""The "Mixed precision" custom-scalars dashboard: its charts, and the layout TensorBoard's Custom Scalars tab reads.

:meth:`~lightning_mpt.diagnostics.sink.Sink.layout` writes it once per ``SummaryWriter`` with the charts of the
monitors present (every chart for Fabric's ``MixedPrecisionLogger``). TensorBoard's charts have a linear y axis,
smooth every line by 0.6 unless the address says otherwise, and join points with straight lines: the loss scale is
drawn as its log2 (a step function whose steps are growths and back-offs, where a scale of 1 is 0, not lost under
2^30), and :func:`dashboard_url` opens the dashboard unsmoothed.

Example:
    ```python
    from lightning_mpt.diagnostics.dashboard import CATEGORY, SCALE_TITLE, layout_dict, mixed_precision_layout
    layout = mixed_precision_layout()
    assert layout.category[0].title == CATEGORY == "Mixed precision"
    assert layout_dict(["scale"]) == {"Mixed precision": {SCALE_TITLE: ["Multiline", ["mpt/loss_scale_log2$"]]}}
    ```
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from tensorboard.plugins.custom_scalar import layout_pb2

from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.tags import CATEGORY

__all__ = ["CATEGORY", "CHARTS", "SCALE_TITLE", "FP8_CHARTS", "dashboard_url", "layout_dict", "mixed_precision_layout"]


def dashboard_url(host: str = "localhost", port: int = 6006) -> str:
    """The address that opens TensorBoard on the "Mixed precision" dashboard with smoothing off.

    Smoothing (0.6 by default) draws a loss scale the run never had and fractional scale changes: the dashboard's
    step functions are only readable unsmoothed.

    Args:
        host: where ``tensorboard --logdir ...`` serves.
        port: its ``--port`` (6006 by default).

    Example:
        ```python
        assert dashboard_url() == "http://localhost:6006/#custom_scalars&_smoothingWeight=0"
        ```
    """
    return f"http://{host}:{port}/#custom_scalars&_smoothingWeight=0"


def _exactly(tag: str) -> str:
    return tag + "$"  # TensorBoard matches a chart's regexes from the start of the tag


def _per_parameter(tag: str) -> str:
    return tags.per_parameter(tag, "")  # every "<tag>/<name>"


#: the loss-scale chart's title: its axis is log2, so the title says how to read it
SCALE_TITLE = "Loss scale, log2 (16 is 65536; 0 is a scale of 1)"

# key -> (title, tag regexes). No chart of mpt/scale_change: its points (+1, -1 at changes only) joined by straight
# lines draw a zigzag through values it never had; the log2 scale shows each change as a step of +1 or -1.
CHARTS: dict[str, tuple[str, list[str]]] = {
    "scale": (SCALE_TITLE, [_exactly(tags.LOSS_SCALE_LOG2)]),
    "skips": (
        "Skipped steps (cumulative) and overflows (0/1)",
        [_exactly(tags.SKIPPED_STEPS), _exactly(tags.OVERFLOW)],
    ),
    "nonfinite": (
        "Skipped steps: parameters with inf/NaN grads, non-finite loss",
        [_exactly(tags.NONFINITE_PARAMS), _exactly(tags.LOSS_NONFINITE)],
    ),
    "headroom": (
        "Scale headroom (log2 bits to overflow)",
        [_exactly(tags.SCALE_HEADROOM), _exactly(tags.STORED_HEADROOM)],
    ),
    "grad_classes": (
        "Stored gradients: zero, subnormal, flushed (underflow), overflow fractions",
        [_exactly(t) for t in (tags.GRAD_ZERO, tags.GRAD_SUBNORMAL, tags.GRAD_UNDERFLOW, tags.GRAD_OVERFLOW)],
    ),
    "update_underflow": ("Update underflow (updates a half weight would lose)", [_exactly(tags.UPDATE_UNDERFLOW)]),
    "underflow_by_param": ("Flush (underflow) fraction by parameter", [_per_parameter(tags.GRAD_UNDERFLOW)]),
    "subnormal_by_param": ("Subnormal fraction by parameter", [_per_parameter(tags.GRAD_SUBNORMAL)]),
    "overflow_by_param": ("Overflow fraction by parameter", [_per_parameter(tags.GRAD_OVERFLOW)]),
    "update_by_param": ("Update underflow by parameter", [_per_parameter(tags.UPDATE_UNDERFLOW)]),
    "fp8_casts": (
        "fp8 casts: saturated, flushed, subnormal fractions (all layers)",
        [_exactly(t) for t in (tags.FP8_SATURATED, tags.FP8_FLUSH, tags.FP8_SUBNORMAL)],
    ),
    "fp8_flush_by_layer": ("fp8 flush fraction by layer/role", [_per_parameter(tags.FP8_FLUSH)]),
    "fp8_saturated_by_layer": ("fp8 saturated fraction by layer/role", [_per_parameter(tags.FP8_SATURATED)]),
    "fp8_amax_by_layer": ("fp8 amax by layer/role", [_per_parameter(tags.FP8_AMAX)]),
    "fp8_scale_by_layer": ("fp8 scale by layer/role", [_per_parameter(tags.FP8_SCALE)]),
}


#: the charts of fp8 casts: on a dashboard only when ``Linear`` layers compute in fp8
FP8_CHARTS = tuple(key for key in CHARTS if key.startswith("fp8_"))


def _wanted(charts: Optional[Iterable[str]]) -> list[str]:
    wanted = set(CHARTS) if charts is None else set(charts)
    unknown = wanted - set(CHARTS)
    if unknown:
        raise ValueError(f"mixed_precision_layout: unknown charts {sorted(unknown)}; accepted: {list(CHARTS)}")
    return [key for key in CHARTS if key in wanted]


def layout_dict(charts: Optional[Iterable[str]] = None) -> dict[str, dict[str, list[Any]]]:
    """The layout as ``SummaryWriter.add_custom_scalars`` takes it: one category, "Mixed precision", with the given
    charts (keys of :data:`CHARTS`, all by default) in the order of :data:`CHARTS`, each a multiline chart."""
    return {CATEGORY: {CHARTS[key][0]: ["Multiline", list(CHARTS[key][1])] for key in _wanted(charts)}}


def mixed_precision_layout(charts: Optional[Iterable[str]] = None) -> layout_pb2.Layout:
    """The same layout as a ``tensorboard.plugins.custom_scalar.layout_pb2.Layout`` (what TensorBoard stores)."""
    category = layout_pb2.Category(title=CATEGORY)
    for key in _wanted(charts):
        title, regexes = CHARTS[key]
        category.chart.add(title=title, multiline=layout_pb2.MultilineChartContent(tag=regexes))
    return layout_pb2.Layout(category=[category])
