"""Every TensorBoard tag lightning-mpt writes or reads, in one place.

The diagnostic callbacks write these tags and ``lightning-mpt report`` reads them; both import the names from here
and no other module spells a tag. The names of docs/concepts.md#tensorboard-tags are a contract: ``mpt/loss_scale``,
``mpt/skipped_steps``, ``mpt/overflow``, ``mpt/grad_zero_fraction``, ``mpt/grad_subnormal_fraction``,
``mpt/grad_underflow_fraction``, ``mpt/update_underflow_fraction`` (global values; per-parameter ones append
``/<param name>``), the histograms ``mpt/grad/<param name>`` and ``mpt/grad_exponent/<param name>``, and the
custom-scalars category "Mixed precision".

Three kinds of data live under ``mpt/``:

* **scalars** (TensorBoard's Scalars tab and the "Mixed precision" dashboard),
* **histograms** (``mpt/grad/...``, ``mpt/grad_exponent/...``) and a few **texts** for people (Text tab),
* **records** under ``mpt/data/``: JSON objects in tensor summaries of the plugin :data:`PLUGIN_NAME`, written for
  programs (``lightning-mpt report``) so that nothing has to parse the Markdown of the texts. Each record is one
  JSON object with a ``"schema"`` version; :data:`RECORD_FIELDS` lists their fields.

This module imports nothing, so a log reader can use it without torch or Lightning.

Example:
    ```python
    from lightning_mpt.diagnostics import tags

    assert tags.LOSS_SCALE == "mpt/loss_scale"
    assert tags.per_parameter(tags.GRAD_UNDERFLOW, "encoder.0.weight") == "mpt/grad_underflow_fraction/encoder.0.weight"
    assert tags.parameter_of(tags.GRAD_UNDERFLOW, "mpt/grad_underflow_fraction/encoder.0.weight") == "encoder.0.weight"
    assert tags.parameter_of(tags.GRAD_UNDERFLOW, "mpt/loss_scale") is None
    ```
"""

from __future__ import annotations

from typing import Optional

PREFIX = "mpt/"
CATEGORY = "Mixed precision"  # the custom-scalars category of the dashboard (docs/concepts.md#tensorboard-tags)

# ---------------------------------------------------------------------------------- scalars: the loss scale
LOSS_SCALE = "mpt/loss_scale"  # the scale the step's gradients were computed with
# log2 of the scale, at the steps of LOSS_SCALE and the step after each change: the dashboard draws it as a step
# chart on TensorBoard's linear axis, where a scale of 1 is 0 and 2^16 is 16
LOSS_SCALE_LOG2 = "mpt/loss_scale_log2"
SKIPPED_STEPS = "mpt/skipped_steps"  # cumulative
OVERFLOW = "mpt/overflow"  # 0/1 per optimizer step
SCALE_CHANGE = "mpt/scale_change"  # log2(new/old) at steps after which the scale changed (+1 growth, -1 back-off)
NONFINITE_PARAMS = "mpt/nonfinite_param_count"  # parameters with inf/NaN gradients, at skipped steps
LOSS_NONFINITE = "mpt/loss_nonfinite"  # 0/1 at skipped steps

# --------------------------------------------------------------------------------- scalars: the gradients
GRAD_ZERO = "mpt/grad_zero_fraction"
GRAD_SUBNORMAL = "mpt/grad_subnormal_fraction"
GRAD_UNDERFLOW = "mpt/grad_underflow_fraction"  # the flush fraction, from the fp32 reference
GRAD_OVERFLOW = "mpt/grad_overflow_fraction"
UPDATE_UNDERFLOW = "mpt/update_underflow_fraction"
SCALE_HEADROOM = "mpt/scale_headroom"  # log2(format max / max |scaled fp32 reference grad|)
STORED_HEADROOM = "mpt/stored_headroom"  # log2(format max / max |stored scaled grad|)

# ------------------------------------------------------- scalars: torchao's fp8 casts (per layer: "/<layer>/<role>")
FP8 = "mpt/fp8"
FP8_AMAX = "mpt/fp8/amax"  # max |x| of the high-precision tensor a role casts
FP8_SCALE = "mpt/fp8/scale"  # fp8_max / amax as torchao computes it (rowwise: the smallest row scale)
FP8_SATURATED = "mpt/fp8/saturated_fraction"  # of all values: clamped to the format's max (non-finite included)
FP8_FLUSH = "mpt/fp8/flush_fraction"  # of the nonzero finite values: cast to 0
FP8_SUBNORMAL = "mpt/fp8/subnormal_fraction"  # of the nonzero finite values: subnormal in fp8
FP8_ROLES = ("input", "weight", "grad_output")  # the roles' names, the last part of a per-layer tag

# --------------------------------------------------------------------------- the format's marks (scalars, once)
FORMAT_MARKS = "mpt/format"
MIN_SUBNORMAL_EXPONENT = "mpt/format/min_subnormal_exponent"
MIN_NORMAL_EXPONENT = "mpt/format/min_normal_exponent"
MAX_EXPONENT = "mpt/format/max_exponent"

# ------------------------------------------------------------------------------------------------ histograms
GRAD_HIST = "mpt/grad"  # + "/<name>": the unscaled gradients
GRAD_EXPONENT = "mpt/grad_exponent"  # + "/<name>": exponents of the stored half gradients

# ------------------------------------------------------------------------------------- texts (for people)
NONFINITE_TEXT = "mpt/nonfinite_params"  # per skipped step: names of the parameters with inf/NaN gradients
OVERFLOW_SUMMARY = "mpt/overflow_summary"  # at the end of training: a table, most frequent first
EXPONENT_LEGEND = "mpt/legend/grad_exponent"  # once: how to read the exponent histograms
TENSOR_CORES = "mpt/tensor_cores"  # once: layers whose dimensions keep matmuls off Tensor Cores
TEXT_SUFFIX = "/text_summary"  # what ``SummaryWriter.add_text`` appends to a text's tag

# ------------------------------------------------------------------------------------ records (for programs)
PLUGIN_NAME = "lightning_mpt"  # the plugin name of the records' tensor summaries
RECORDS = "mpt/data"
RUN_RECORD = "mpt/data/run"  # once per fit
SKIP_RECORD = "mpt/data/skipped_step"  # at every skipped optimizer step
STOP_RECORD = "mpt/data/stopped"  # when the guard (NonFiniteGradientError) stopped training
SUMMARY_RECORD = "mpt/data/overflow_summary"  # at the end of training (also after a stop)
RECORD_SCHEMA = 1
RECORD_FIELDS: dict[str, tuple[str, ...]] = {
    # format: "fp16" | "bf16" | None; precision: the plugin's class and precision name; loss_scaling: "dynamic",
    # "static", "grad_scaler" or "none"; scaler: the scaler's configuration at the start (scale, growth_interval, ...;
    # null without one), so that the report can tell why the scale never grew; master_weights: true/false, null when
    # the plugin has no such option; master_remainders, chunked_step: the plugin's options (null when it has none); fp8:
    # {"recipe", "emulate"} when Linear layers compute in fp8, else null; monitors: the callbacks' class names
    RUN_RECORD: (
        "schema",
        "format",
        "plugin",
        "precision",
        "loss_scaling",
        "scaler",
        "master_weights",
        "master_remainders",
        "chunked_step",
        "fp8",
        "monitors",
    ),
    # params: every parameter whose gradient held inf/NaN; loss_finite: true/false, null when unknown
    SKIP_RECORD: ("schema", "step", "scale", "scale_after", "params", "loss_finite"),
    # error: the exception's class name; message: its text (names the parameters, the scale history, a hint)
    STOP_RECORD: ("schema", "step", "error", "message"),
    # skipped_steps and params count every skipped step of the run, also those before a resume
    SUMMARY_RECORD: ("schema", "step", "skipped_steps", "params"),
}


def per_parameter(tag: str, name: str) -> str:
    """The tag of one parameter's (or module's) value of ``tag``: ``tag + "/" + name``."""
    return f"{tag}/{name}"


def fp8_layer_role(tag: str, full: str) -> Optional[tuple[str, str]]:
    """``(layer, role)`` of a per-layer fp8 tag of ``tag`` (``mpt/fp8/flush_fraction/blocks.0.fc1/input``), else
    ``None``."""
    rest = parameter_of(tag, full)
    if rest is None or "/" not in rest:
        return None
    layer, role = rest.rsplit("/", 1)
    return (layer, role) if role in FP8_ROLES else None


def parameter_of(tag: str, full: str) -> Optional[str]:
    """The parameter name in a per-parameter tag of ``tag``, ``None`` when ``full`` is not one."""
    prefix = tag + "/"
    return full[len(prefix) :] if full.startswith(prefix) else None
