"""The TensorBoard tags of the diagnostic callbacks (DESIGN.md §5) and the "Mixed precision" custom-scalars layout.

The layout is a ``tensorboard.plugins.custom_scalar.layout_pb2.Layout`` written once per run (per
``SummaryWriter``) by the first monitor in ``trainer.callbacks``; it holds the charts of the monitors present.

Example:
    ```python
    from lightning_mpt.callbacks.dashboard import CATEGORY, mixed_precision_layout
    layout = mixed_precision_layout()
    assert layout.category[0].title == CATEGORY == "Mixed precision"
    ```
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional
from weakref import WeakSet

from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.custom_scalar import layout_pb2, metadata

CATEGORY = "Mixed precision"

# ---------------------------------------------------------------------------------------------- tags (DESIGN §5)
LOSS_SCALE = "mpt/loss_scale"
SKIPPED_STEPS = "mpt/skipped_steps"  # cumulative
OVERFLOW = "mpt/overflow"  # 0/1 per step
SCALE_CHANGE = "mpt/scale_change"  # log2(new/old) at steps after which the scale changed (+1 growth, -1 back-off)
NONFINITE_PARAMS = "mpt/nonfinite_param_count"  # parameters with inf/NaN gradients, at skipped steps
LOSS_NONFINITE = "mpt/loss_nonfinite"  # 0/1 at skipped steps
NONFINITE_TEXT = "mpt/nonfinite_params"  # text: names of the parameters with inf/NaN gradients
OVERFLOW_SUMMARY = "mpt/overflow_summary"  # text at the end of training
GRAD_ZERO = "mpt/grad_zero_fraction"
GRAD_SUBNORMAL = "mpt/grad_subnormal_fraction"
GRAD_UNDERFLOW = "mpt/grad_underflow_fraction"
GRAD_OVERFLOW = "mpt/grad_overflow_fraction"
UPDATE_UNDERFLOW = "mpt/update_underflow_fraction"
SCALE_HEADROOM = "mpt/scale_headroom"  # log2(format max / max |scaled fp32 reference grad|)
STORED_HEADROOM = "mpt/stored_headroom"  # log2(format max / max |stored scaled grad|), every fraction step
GRAD_HIST = "mpt/grad"  # + "/<name>": histograms of the unscaled gradients
GRAD_EXPONENT = "mpt/grad_exponent"  # + "/<name>": exponent histograms of the stored half gradients
EXPONENT_LEGEND = "mpt/legend/grad_exponent"  # text, once
FORMAT_MARKS = "mpt/format"  # + "/min_subnormal_exponent" etc., once: the format's marks on the exponent axis
TENSOR_CORES = "mpt/tensor_cores"  # text, once

# ---------------------------------------------------------------------------------------------------- the charts
# key -> (title, tag regexes; TensorBoard matches each from the start of the tag)
CHARTS: dict[str, tuple[str, list[str]]] = {
    "scale": ("Loss scale", [LOSS_SCALE + "$"]),
    "skips": ("Skipped steps (cumulative) and overflows (0/1)", [SKIPPED_STEPS + "$", OVERFLOW + "$"]),
    "scale_change": ("Scale changes (log2 factor: +1 growth, -1 back-off)", [SCALE_CHANGE + "$"]),
    "nonfinite": ("Skipped steps: parameters with inf/NaN grads, non-finite loss", [NONFINITE_PARAMS + "$", LOSS_NONFINITE + "$"]),
    "headroom": ("Scale headroom (log2 bits to overflow)", [SCALE_HEADROOM + "$", STORED_HEADROOM + "$"]),
    "grad_classes": (
        "Stored gradients: zero, subnormal, flushed (underflow), overflow fractions",
        [GRAD_ZERO + "$", GRAD_SUBNORMAL + "$", GRAD_UNDERFLOW + "$", GRAD_OVERFLOW + "$"],
    ),
    "update_underflow": ("Update underflow (updates a half weight would lose)", [UPDATE_UNDERFLOW + "$"]),
    "underflow_by_param": ("Flush (underflow) fraction by parameter", [GRAD_UNDERFLOW + "/"]),
    "subnormal_by_param": ("Subnormal fraction by parameter", [GRAD_SUBNORMAL + "/"]),
    "overflow_by_param": ("Overflow fraction by parameter", [GRAD_OVERFLOW + "/"]),
    "update_by_param": ("Update underflow by parameter", [UPDATE_UNDERFLOW + "/"]),
}


def mixed_precision_layout(charts: Optional[Iterable[str]] = None) -> layout_pb2.Layout:
    """The custom-scalars layout: one category, "Mixed precision", with the given charts (keys of :data:`CHARTS`,
    all by default) in the order of :data:`CHARTS`."""
    wanted = set(CHARTS) if charts is None else set(charts)
    unknown = wanted - set(CHARTS)
    if unknown:
        raise ValueError(f"mixed_precision_layout: unknown charts {sorted(unknown)}; accepted: {list(CHARTS)}")
    category = layout_pb2.Category(title=CATEGORY)
    for key, (title, tags) in CHARTS.items():
        if key in wanted:
            category.chart.add(title=title, multiline=layout_pb2.MultilineChartContent(tag=tags))
    return layout_pb2.Layout(category=[category])


def layout_summary(layout: layout_pb2.Layout) -> Summary:
    """A ``Summary`` holding ``layout`` for TensorBoard's custom-scalars plugin (what its ``summary.pb`` builds,
    without TensorFlow)."""
    tensor = TensorProto(dtype="DT_STRING", string_val=[layout.SerializeToString()], tensor_shape=TensorShapeProto())
    value = Summary.Value(tag=metadata.CONFIG_SUMMARY_TAG, tensor=tensor, metadata=metadata.create_summary_metadata())
    return Summary(value=[value])


_WRITTEN: WeakSet[Any] = WeakSet()


def write_dashboard(writer: Any, charts: Optional[Iterable[str]] = None) -> bool:
    """Write the layout to a ``SummaryWriter`` unless it already holds one; return whether it wrote."""
    if writer in _WRITTEN:
        return False
    writer._get_file_writer().add_summary(layout_summary(mixed_precision_layout(charts)))
    _WRITTEN.add(writer)
    return True
