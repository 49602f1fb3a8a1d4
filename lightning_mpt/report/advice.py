"""What to change, and why: the advice at the end of ``lightning-mpt report``, each line backed by the run's numbers.

Every rule reads what the report already parsed (a :class:`~lightning_mpt.report.data.RunData` and its
:class:`~lightning_mpt.report.data.RunSummary`) and returns one :class:`~lightning_mpt.report.data.Advice` or
``None``; :data:`RULES` lists them in the order they are printed (what costs updates first). A rule speaks only past
a threshold that separates a problem from normal operation (each named below with its reason), and only to advise a
change that measurably helps; a rule that lacks the tags it needs stays silent: the report never guesses. Facts that
change nothing (the parameters most often non-finite, the updates the fp32 masters keep, the growth probes of a
dynamic scale) are in the summary, not here. The scaler's configuration comes from the ``mpt/data/run`` record
(``scaler``, ``loss_scaling``).

Example:
    ```python
    from lightning_mpt.report import build_report

    for run in build_report("runs").runs:
        for advice in run.advice:          # computed by summarize() with advise()
            print(advice.rule, advice.text, advice.numbers)
    ```
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.exponent_axis import FORMATS, FloatFormat
from lightning_mpt.report.data import Advice, RunData, RunSummary, Series, SkipKinds, format_scale
from lightning_mpt.report.fp8 import keep_in_bf16

__all__ = ["RULES", "advise", "run_scaling"]

# ----------------------------------------------------------------------------------------------- thresholds
# One or two skipped steps while a dynamic scale probes down from its initial value are the scaler at work (the
# default 2^16 often costs one); from three on, a lower init_scale would have saved those batches.
START_SKIPS = 3
# Recommended scales keep the largest gradient at least this many bits (2x) below the format's max: the next batch's
# largest gradient is rarely the same as the measured one.
MARGIN_BITS = 1
# A dynamic scale "could have grown" when the largest gradient left room for one growth plus the margin.
GROWTH_ROOM_BITS = 2.0
# A percent of the stored gradients in the subnormal range: they keep fewer significant bits, and flushing to zero
# starts right below them. Below that share a higher scale buys nothing measurable.
SUBNORMAL_SHARE = 0.01
# A layer that lost 1% of its nonzero gradient values at one fp32 reference step learns from part of its gradient;
# the same share of all gradient values flushed is where a higher scale starts to matter. A healthy fine-tuning run
# flushes about 1e-5 of them at the default scale: nothing to change for that.
FLUSH_SHARE = 0.01
# A static scale that leaves 2^8 (256x) unused above the largest gradient at every measured step wastes range.
SPARE_BITS = 8.0
# The parameter whose gradient held the inf/NaN at more than half of a static scale's overflows, and at least twice
# as often as the next one, is named: that is where the overflow starts (not an inf that spread through the network).
BLAME_SHARE = 0.5
BLAME_LEAD = 2.0


@dataclass(frozen=True)
class _Facts:
    """What several rules read, gathered once from a run."""

    fmt: Optional[FloatFormat]
    scaling: Optional[str]  # "dynamic", "static", "grad_scaler", "none" (run record, else inferred from the scale)
    scaler: dict[str, Any]  # the scaler's configuration of the run record ({} when unknown)
    skips: list[int]  # the skipped optimizer steps, in order
    kinds: SkipKinds  # the same, by kind (start, growth probes, other)
    scale: Series
    headroom: Series  # log2(format max / largest scaled gradient): the fp32 reference's, else the stored one's


def _facts(run: RunData, summary: RunSummary) -> _Facts:
    record = run.run_record()
    kinds = summary.skips
    headroom = run.series(tags.SCALE_HEADROOM) or run.series(tags.STORED_HEADROOM)
    return _Facts(
        fmt=next((f for f in FORMATS if f.name == summary.format), None),
        scaling=run_scaling(run),
        scaler=record.get("scaler") or {},
        skips=sorted([*kinds.start, *kinds.probes, *kinds.other]),
        kinds=kinds,
        scale=run.series(tags.LOSS_SCALE),
        headroom=[(s, h) for s, h in headroom if math.isfinite(h)],
    )


# -------------------------------------------------------------------------------------------------- the rules
def static_overflow(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[Advice]:
    """A static scale overflowed: each overflow lost a step, and a static scale never adapts. What helps is a scale
    that fits: the dynamic scaler finds one, or a static scale below what the fp32 reference measured."""
    overflows = summary.skipped_steps - summary.loss_nonfinite_steps  # a non-finite loss is not the scale's doing
    if facts.scaling != "static" or overflows <= 0 or not facts.scale:
        return None
    scale = facts.scale[0][1]
    numbers: dict[str, Any] = {"scale": scale, "overflow_steps": overflows, "steps": summary.steps}
    numbers["first_overflow_step"] = summary.first_overflow_step
    where = ""
    (name, count), (_, second), *_ = [*summary.nonfinite_params.items(), ("", 0), ("", 0)]
    if count > BLAME_SHARE * overflows and count >= BLAME_LEAD * second:
        numbers.update(param=name, skips_with_param=count)
        where = f"; it starts in {name}'s gradient, non-finite at {count} of them"
    text = (
        f"The static loss scale {format_scale(scale)} overflowed at {overflows} of {summary.steps} steps (first at "
        f"step {summary.first_overflow_step}{where}): each skipped an update, and a static scale never adapts. Use the "
        "dynamic scaler (MPTPrecision without scaler=), which backs off to a scale the gradients fit"
    )
    reference = [h for _, h in facts.headroom]
    if reference and min(reference) < 0:  # the fp32 reference measured by how much the scale overflowed
        safe = scale * 2.0 ** (math.floor(min(reference)) - MARGIN_BITS)
        numbers.update(min_headroom_bits=min(reference), suggested_scale=safe)
        text += f", or a static scale of at most {format_scale(safe)} (the largest gradient was "
        text += f"{-min(reference):.1f} bits above the format's max)"
    return Advice("static_overflow", text + ".", numbers)


def skips_at_start(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[Advice]:
    """A dynamic scale started too high: its first steps were skipped while it backed off. What helps is a lower
    first scale: the one it settled at, or ``init_scale="auto"``, which measures it from the first gradients."""
    leading = len(facts.kinds.start)
    scale_at = dict(facts.scale)
    # the scale after the last leading skip: its record says it, else the scale logged at the next step
    after = {int(r["step"]): r.get("scale_after") for r in run.record_list(tags.SKIP_RECORD)}
    settled = after.get(leading - 1) or scale_at.get(leading)
    if leading < START_SKIPS or 0 not in scale_at or settled is None:
        return None
    start = scale_at[0]
    numbers = {"leading_skips": leading, "initial_scale": start, "settled_scale": settled, "steps": summary.steps}
    if leading >= summary.steps:  # no step went through: no scale is known to work
        return Advice(
            "skips_at_start",
            f"All {leading} optimizer steps were skipped (overflow) while the scale backed off from "
            f"{format_scale(start)} to {format_scale(settled)}: no scale tried let a step through, so the gradients "
            "may be inf/NaN at any scale. Look at the parameters most often non-finite and at the loss; no init_scale "
            "can be advised yet.",
            numbers,
        )
    numbers["suggested_init_scale"] = settled
    auto = 'DynamicLossScaler(init_scale="auto")'
    if facts.scaling == "grad_scaler":  # torch's GradScaler has no automatic first scale: MPTPrecision's has
        auto = f"MPTPrecision('fp16', scaler={auto})"
    return Advice(
        "skips_at_start",
        f"The first {leading} optimizer steps were skipped (overflow) while the scale backed off from "
        f"{format_scale(start)} to {format_scale(settled)}: those batches trained nothing. Start at "
        f"init_scale={format_scale(settled, code=True)}, or let the scaler measure its first scale from the first "
        f"gradients: {auto}.",
        numbers,
    )


def bf16(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[Advice]:
    """An fp16 run measured an overflow no loss scale prevents, or an underflow no safe scale recovers."""
    if summary.format != "fp16" or facts.fmt is None:
        return None
    fmt, bf = facts.fmt, FORMATS[1]
    if summary.loss_nonfinite_steps:
        why = (
            f"{_count(summary.loss_nonfinite_steps, 'skipped step')} had an inf/NaN loss: the forward pass itself "
            f"exceeded fp16's "
            f"max ({fmt.max:g}), which no loss scale prevents"
        )
        numbers: dict[str, Any] = {"loss_nonfinite_steps": summary.loss_nonfinite_steps}
    else:
        flushed = _flush(run, summary, facts)
        if flushed is None or flushed[2] >= MARGIN_BITS + 1:  # a higher fp16 scale would still keep them
            return None
        layers, step, room, scale = flushed
        why = (
            f"at step {step} {_layers(layers)} lost gradients to zero while the largest gradient was {room:.1f} bits "
            f"below fp16's max at scale {format_scale(scale)}: the gradients span more than fp16's "
            f"{fmt.max_exponent - fmt.min_exponent + 1} bits, so no loss scale keeps both ends"
        )
        numbers = {"flush": layers, "step": step, "headroom_bits": room, "scale": scale}
    numbers["bf16_bits"] = bf.max_exponent - bf.min_exponent + 1
    return Advice(
        "bf16",
        f"{why[0].upper()}{why[1:]}. bf16 (MPTPrecision('bf16'), max {bf.max:.2g}, "
        f"{numbers['bf16_bits']} bits of exponent range, no loss scale needed) would avoid it, where the hardware "
        "supports it.",
        numbers,
    )


def underflow(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[Advice]:
    """Gradients flush below the scale's reach: in which layers, and the scale that would keep them."""
    flushed = _flush(run, summary, facts)
    if flushed is None or facts.fmt is None:
        return None
    layers, step, room, scale = flushed
    fmt = facts.fmt
    numbers: dict[str, Any] = {"flush": layers, "step": step, "scale": scale, "headroom_bits": room}
    numbers["lost_below"] = fmt.flush_threshold / scale
    text = (
        f"Gradients flush to zero below the scale's reach: at scale {format_scale(scale)} every |gradient| <= "
        f"{numbers['lost_below']:.3g} becomes 0 in {fmt.name}; at step {step} {_layers(layers)} lost them. "
    )
    bits = math.floor(room) - MARGIN_BITS
    if bits < 1:
        text += f"The largest gradient is {room:.1f} bits below the max: no higher {fmt.name} scale is safe."
    else:
        numbers["suggested_scale"] = scale * 2.0**bits
        numbers["kept_above"] = fmt.flush_threshold / numbers["suggested_scale"]
        text += (
            f"A scale of {format_scale(numbers['suggested_scale'])} keeps gradients down to "
            f"{numbers['kept_above']:.3g} and the largest one 2^{MARGIN_BITS} below the max ({room:.1f} bits of "
            "headroom measured)"
        )
        ceiling = facts.scaler.get("max_scale") if facts.scaling == "dynamic" else None
        if ceiling is not None and numbers["suggested_scale"] > ceiling:  # the dynamic scale cannot grow that far
            text += f"; it is above the scaler's max_scale={format_scale(ceiling, code=True)}: raise max_scale"
        text += "."
    return Advice("underflow", text, numbers)


def growth_interval(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[Advice]:
    """A dynamic scale that never grew because its ``growth_interval`` is longer than the run's clean stretches."""
    interval, factor = facts.scaler.get("growth_interval"), facts.scaler.get("growth_factor") or 2.0
    if facts.scaling not in ("dynamic", "grad_scaler") or not interval or not facts.scale or not facts.headroom:
        return None
    if any(b > a for (_, a), (_, b) in zip(facts.scale, facts.scale[1:])):
        return None  # it grew
    bounds = [-1, *facts.skips, summary.steps]
    clean = max(b - a - 1 for a, b in zip(bounds, bounds[1:]))
    step, room = facts.headroom[-1]
    sub = summary.subnormal.mean if summary.subnormal else 0.0
    flush = summary.flush.max if summary.flush else 0.0
    if clean >= interval or room < GROWTH_ROOM_BITS or (sub < SUBNORMAL_SHARE and flush < FLUSH_SHARE):
        return None
    bits = math.floor(room) - MARGIN_BITS
    ceiling, scale = facts.scaler.get("max_scale"), facts.scale[-1][1]
    if ceiling is not None and scale > 0:  # it cannot grow past max_scale, however long the run
        bits = min(bits, math.floor(math.log2(ceiling / scale)))
    if bits < 1:
        return None
    growths = max(1, math.ceil(bits / math.log2(factor)))
    suggested = max(1, clean // growths)
    numbers = {"growth_interval": interval, "longest_clean_steps": clean, "steps": summary.steps}
    numbers.update(headroom_bits=room, headroom_step=step, subnormal_mean=sub, flush_max=flush)
    numbers["suggested_growth_interval"] = suggested
    return Advice(
        "growth_interval",
        f"The loss scale never grew: growth_interval={interval} is longer than the longest run of clean steps "
        f"({clean} of {summary.steps}). Yet the largest gradient left {room:.1f} bits of headroom at step {step}, and "
        f"{_pct(sub)} of the stored gradients were subnormal (flush max {_pct(flush)}). With growth_interval <= "
        f"{suggested} the scale could grow {growths} times within such a stretch.",
        numbers,
    )


def headroom(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[Advice]:
    """A fixed scale far below what the largest gradient allows, while small gradients sit in the subnormal range."""
    if facts.scaling not in ("static", "none") or summary.format != "fp16" or not facts.headroom or not facts.scale:
        return None
    step, least = min(facts.headroom, key=lambda p: p[1])
    sub = summary.subnormal.mean if summary.subnormal else 0.0
    flush = summary.flush.max if summary.flush else 0.0
    if least < SPARE_BITS or (sub < SUBNORMAL_SHARE and flush < FLUSH_SHARE):
        return None
    flushed = _flush(run, summary, facts)
    if flushed is not None and math.floor(flushed[2]) - MARGIN_BITS >= 1:
        return None  # the underflow rule names the layers and the scale already
    scale = facts.scale[-1][1]
    suggested = scale * 2.0 ** (math.floor(least) - MARGIN_BITS)
    numbers = {"min_headroom_bits": least, "step": step, "scale": scale, "suggested_scale": suggested}
    numbers.update(subnormal_mean=sub, flush_max=flush)
    return Advice(
        "headroom",
        f"The largest gradient stayed at least {least:.1f} bits below fp16's max at every measured step (least at "
        f"step {step}), while {_pct(sub)} of the stored gradients were subnormal: the fixed scale "
        f"{format_scale(scale)} leaves that range unused. A scale of {format_scale(suggested)} keeps a "
        f"2^{MARGIN_BITS} margin, or use the dynamic scaler.",
        numbers,
    )


Rule = Callable[[RunData, RunSummary, _Facts], Optional[Advice]]
#: the rules, in the order their advice is printed: what skips steps first, then what loses gradient values
RULES: tuple[Rule, ...] = (static_overflow, skips_at_start, bf16, underflow, growth_interval, headroom, keep_in_bf16)


def run_scaling(run: RunData) -> Optional[str]:
    """How ``run`` scaled its loss: ``loss_scaling`` of its run record, else ``"dynamic"`` when the logged scale
    changed and ``"static"`` when it did not (``None`` without a logged scale).

    Args:
        run: what was read of the run.

    Example:
        ```python
        from lightning_mpt.report.events import load_runs

        runs, _ = load_runs("runs")
        assert run_scaling(runs[0]) in ("dynamic", "static", "grad_scaler", "none", None)
        ```
    """
    scaling = run.run_record().get("loss_scaling")
    if scaling is not None:
        return str(scaling)
    scales = {v for _, v in run.series(tags.LOSS_SCALE)}
    return None if not scales else "dynamic" if len(scales) > 1 else "static"


def advise(run: RunData, summary: RunSummary) -> list[Advice]:
    """The advice of every rule of :data:`RULES` that applies to ``run``, in their order.

    Args:
        run: what was read from the run's event files.
        summary: the report's summary of it (:func:`lightning_mpt.report.summarize`).

    Example:
        ```python
        from lightning_mpt.report import load_runs, summarize

        runs, _ = load_runs("runs")
        for advice in advise(runs[0], summarize(runs[0])):
            print(f"[{advice.rule}] {advice.text}")
        ```
    """
    facts = _facts(run, summary)
    return [a for rule in RULES if (a := rule(run, summary, facts)) is not None]


# ----------------------------------------------------------------------------------------------------- helpers
def _flush(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[tuple[dict[str, float], int, float, float]]:
    """The layers that lost at least :data:`FLUSH_SHARE` at the last fp32 reference step, that step, the headroom and
    the scale measured there; ``None`` without an fp32 reference or such a layer. The last step, not the worst: a
    dynamic scale that grew out of an early underflow has fixed it."""
    if summary.underflow_tag != tags.GRAD_UNDERFLOW:
        return None
    per_param = run.per_parameter(tags.GRAD_UNDERFLOW)
    room = dict(run.series(tags.SCALE_HEADROOM))
    steps = sorted({s for series in per_param.values() for s, _ in series if s in room})
    if not steps:
        return None
    step = steps[-1]
    layers = {n: v for n, series in per_param.items() for s, v in series if s == step and v >= FLUSH_SHARE}
    if not layers:
        return None
    scale = next((v for s, v in reversed(facts.scale) if s <= step), 1.0)
    return dict(sorted(layers.items(), key=lambda kv: (-kv[1], kv[0]))), step, room[step], scale


def _layers(layers: dict[str, float], top: int = 3) -> str:
    shown = ", ".join(f"{n} ({_pct(v)})" for n, v in list(layers.items())[:top])
    return shown + (f" and {len(layers) - top} more layers" if len(layers) > top else "")


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"
