"""What to change, and why: the advice at the end of ``lightning-mpt report``, each line backed by the run's numbers.

Every rule reads what the report already parsed (a :class:`~lightning_mpt.report_events.RunData` and its
:class:`~lightning_mpt.report.RunSummary`) and returns one :class:`Advice` or ``None``; :data:`RULES` lists them in
the order they are printed (what costs updates first). A rule that lacks the tags it needs stays silent: the report
never guesses. The scaler's configuration comes from the ``mpt/data/run`` record (``scaler``, ``loss_scaling``).

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.exponent_axis import FORMATS, FloatFormat
from lightning_mpt.report_events import RunData, Series
from lightning_mpt.report_fp8 import keep_in_bf16

if TYPE_CHECKING:
    from lightning_mpt.report import RunSummary

__all__ = ["RULES", "Advice", "advice_section", "advise"]

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
# A layer that lost 1% of its nonzero gradient values at one fp32 reference step learns from part of its gradient.
FLUSH_SHARE = 0.01
# A static scale that leaves 2^8 (256x) unused above the largest gradient at every measured step wastes range.
SPARE_BITS = 8.0
# 1% of the updates lost per step compounds into a visible stall within a few hundred steps (a weight that only
# moves every other step learns at half its learning rate).
UPDATE_SHARE = 0.01
# "One parameter causes most skips": counted over at least 3 skipped steps, non-finite at more than half of them
# and at least twice as often as the next parameter (not an inf that spread through the whole network).
BLAME_SKIPS = 3
BLAME_SHARE = 0.5
BLAME_LEAD = 2.0


@dataclass(frozen=True)
class Advice:
    """One line of advice: the rule that gave it, the sentence, and the numbers of the run behind it.

    Args:
        rule: the rule's id (the name of its function in :data:`RULES`, e.g. ``"static_overflow"``).
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
class _Facts:
    """What several rules read, gathered once from a run."""

    fmt: Optional[FloatFormat]
    scaling: Optional[str]  # loss_scaling of the run record: "dynamic", "static", "grad_scaler", "none"
    scaler: dict[str, Any]  # the scaler's configuration of the run record ({} when unknown)
    masters: Optional[bool]
    skips: list[int]  # the skipped optimizer steps, in order
    scale: Series
    headroom: Series  # log2(format max / largest scaled gradient): the fp32 reference's, else the stored one's


def _facts(run: RunData, summary: RunSummary) -> _Facts:
    record: dict[str, Any] = next(reversed(run.record_list(tags.RUN_RECORD)), {})
    skips = [int(r["step"]) for r in run.record_list(tags.SKIP_RECORD)]
    if not skips:  # a run logged without records: the 0/1 flags
        skips = [s for s, v in run.series(tags.OVERFLOW) if v > 0]
    headroom = run.series(tags.SCALE_HEADROOM) or run.series(tags.STORED_HEADROOM)
    return _Facts(
        fmt=next((f for f in FORMATS if f.name == summary.format), None),
        scaling=record.get("loss_scaling"),
        scaler=record.get("scaler") or {},
        masters=record.get("master_weights"),
        skips=sorted(set(skips)),
        scale=run.series(tags.LOSS_SCALE),
        headroom=[(s, h) for s, h in headroom if math.isfinite(h)],
    )


# -------------------------------------------------------------------------------------------------- the rules
def static_overflow(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[Advice]:
    """A static scale overflowed: each overflow lost a step, and a static scale never adapts."""
    overflows = summary.skipped_steps - summary.loss_nonfinite_steps  # a non-finite loss is not the scale's doing
    if facts.scaling != "static" or overflows <= 0 or not facts.scale:
        return None
    scale = facts.scale[0][1]
    numbers: dict[str, Any] = {"scale": scale, "overflow_steps": overflows, "steps": summary.steps}
    numbers["first_overflow_step"] = summary.first_overflow_step
    text = (
        f"The static loss scale {_scale(scale)} overflowed at {overflows} of {summary.steps} steps (first at step "
        f"{summary.first_overflow_step}); each of them skipped an update. Use the dynamic scaler (MPTPrecision without "
        "scaler=)"
    )
    reference = [h for _, h in facts.headroom]
    if reference and min(reference) < 0:  # the fp32 reference measured by how much the scale overflowed
        safe = scale * 2.0 ** (math.floor(min(reference)) - MARGIN_BITS)
        numbers.update(min_headroom_bits=min(reference), suggested_scale=safe)
        text += f", or a static scale of at most {_scale(safe)} (the largest gradient was {-min(reference):.1f} bits "
        text += "above the format's max)"
    return Advice("static_overflow", text + ".", numbers)


def skips_at_start(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[Advice]:
    """A dynamic scale started too high: its first steps were skipped while it backed off."""
    leading = next((i for i, s in enumerate(facts.skips) if s != i), len(facts.skips))
    scale_at = dict(facts.scale)
    # the scale after the last leading skip: its record says it, else the scale logged at the next step
    after = {int(r["step"]): r.get("scale_after") for r in run.record_list(tags.SKIP_RECORD)}
    settled = after.get(leading - 1) or scale_at.get(leading)
    if facts.scaling == "static" or leading < START_SKIPS or 0 not in scale_at or settled is None:
        return None
    start = scale_at[0]
    numbers = {"leading_skips": leading, "initial_scale": start, "settled_scale": settled, "steps": summary.steps}
    if leading >= summary.steps:  # no step went through: no scale is known to work
        return Advice(
            "skips_at_start",
            f"All {leading} optimizer steps were skipped (overflow) while the scale backed off from {_scale(start)} "
            f"to {_scale(settled)}: no scale tried let a step through, so the gradients may be inf/NaN at any scale. "
            "Look at the parameters most often non-finite and at the loss; no init_scale can be advised yet.",
            numbers,
        )
    return Advice(
        "skips_at_start",
        f"The first {leading} optimizer steps were skipped (overflow) while the scale backed off from {_scale(start)} "
        f"to {_scale(settled)}: those batches trained nothing. Start at init_scale={_scale(settled, code=True)}.",
        numbers,
    )


def one_param(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[Advice]:
    """One parameter holds the inf/NaN at most skipped steps: the overflow starts there, not everywhere."""
    counts = list(summary.nonfinite_params.items())
    if summary.skipped_steps < BLAME_SKIPS or not counts:
        return None
    (name, top), second = counts[0], (counts[1] if len(counts) > 1 else ("", 0))
    if top <= BLAME_SHARE * summary.skipped_steps or top < BLAME_LEAD * second[1]:
        return None
    numbers = {"param": name, "skips_with_param": top, "skipped_steps": summary.skipped_steps}
    numbers.update(next_param=second[0] or None, next_count=second[1])
    after = f" (next: {second[0]}, {second[1]})" if second[1] else " (no other parameter)"
    bound = "" if summary.nonfinite_names_complete else " at least"
    return Advice(
        "one_param",
        f"{name} had an inf/NaN gradient at{bound} {top} of {summary.skipped_steps} skipped steps{after}: most skips "
        "start in its gradient. Clip gradients (gradient_clip_val), lower its learning rate, or keep its module in "
        "fp32 (keep_fp32).",
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
            f"below fp16's max at scale {_scale(scale)}: the gradients span more than fp16's "
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
        f"Gradients flush to zero below the scale's reach: at scale {_scale(scale)} every |gradient| <= "
        f"{numbers['lost_below']:.3g} becomes 0 in {fmt.name}; at step {step} {_layers(layers)} lost them. "
    )
    bits = math.floor(room) - MARGIN_BITS
    if bits < 1:
        text += f"The largest gradient is {room:.1f} bits below the max: no higher {fmt.name} scale is safe."
    else:
        numbers["suggested_scale"] = scale * 2.0**bits
        numbers["kept_above"] = fmt.flush_threshold / numbers["suggested_scale"]
        text += (
            f"A scale of {_scale(numbers['suggested_scale'])} keeps gradients down to "
            f"{numbers['kept_above']:.3g} and the largest one 2^{MARGIN_BITS} below the max ({room:.1f} bits of "
            "headroom measured)"
        )
        ceiling = facts.scaler.get("max_scale") if facts.scaling == "dynamic" else None
        if ceiling is not None and numbers["suggested_scale"] > ceiling:  # the dynamic scale cannot grow that far
            text += f"; it is above the scaler's max_scale={_scale(ceiling, code=True)}: raise max_scale"
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
    if clean >= interval or room < GROWTH_ROOM_BITS or (sub < SUBNORMAL_SHARE and flush <= 0):
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
    if least < SPARE_BITS or (sub < SUBNORMAL_SHARE and flush <= 0):
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
        f"step {step}), while {_pct(sub)} of the stored gradients were subnormal: the fixed scale {_scale(scale)} "
        f"leaves that range unused. A scale of {_scale(suggested)} keeps a 2^{MARGIN_BITS} margin, or use the dynamic "
        "scaler.",
        numbers,
    )


def masters(run: RunData, summary: RunSummary, facts: _Facts) -> Optional[Advice]:
    """The update underflow in words: the share of updates a half-precision weight alone would lose."""
    stats = summary.update_underflow
    if stats is None or stats.mean < UPDATE_SHARE:
        return None
    fmt = summary.format or "the half format"
    worst = summary.worst_update_underflow[0] if summary.worst_update_underflow else None
    numbers: dict[str, Any] = {"mean": stats.mean, "last": stats.last, "last_step": stats.last_step}
    numbers.update(points=stats.points, worst_param=worst.name if worst else None)
    where = f"; worst: {worst.name} ({_pct(worst.stats.mean)})" if worst else ""
    lost = (
        f"{_pct(stats.last)} of the updates at step {stats.last_step} ({_pct(stats.mean)} on average over "
        f"{stats.points} logged steps{where}) are too small to change a weight stored in {fmt} (w + u rounds back to w)"
    )
    if facts.masters is False:
        return Advice("masters", f"Without fp32 master weights, {lost}. Turn master_weights on.", numbers)
    return Advice(
        "masters",
        f"Without fp32 master weights (master_weights=False, or precision='16-true'/'bf16-true'), {lost}: those "
        "updates would be lost. Keep the masters.",
        numbers,
    )


Rule = Callable[[RunData, "RunSummary", _Facts], Optional[Advice]]
#: the rules, in the order their advice is printed: what skips steps first, then what loses gradient values
RULES: tuple[Rule, ...] = (static_overflow, skips_at_start, one_param, bf16)
RULES += (underflow, growth_interval, headroom, masters, keep_in_bf16)


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


def advice_section(names: list[str], advice: list[list[Advice]]) -> list[str]:
    """The report's closing section: a blank line, its title, then each run's name and its advice, one line each
    (``nothing to change`` for a run no rule applies to).

    Args:
        names: the runs' names as the table shows them.
        advice: each run's advice (:func:`advise`), in the same order.

    Example:
        ```python
        lines = advice_section(["a", "b"], [[], [Advice("masters", "Keep them.", {})]])
        assert lines[1:] == ["advice (what to change, and why):", "a: nothing to change (no rule applies)", "b:",
                             "  - Keep them. [masters]"]
        ```
    """
    lines = ["", "advice (what to change, and why):"]
    for name, found in zip(names, advice):
        lines += (
            [f"{name}:", *(f"  - {a.text} [{a.rule}]" for a in found)]
            if found
            else [f"{name}: nothing to change (no rule applies)"]
        )
    return lines


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


def _scale(x: float, code: bool = False) -> str:
    """A scale as ``2^k`` (``2.0**k`` for code) when it is a power of two from 16 up (as the report's table shows
    scales), else as a number."""
    k = math.log2(x) if x > 0 else 0.5
    if k.is_integer() and abs(k) >= 4:
        return f"2.0**{k:.0f}" if code else f"2^{k:.0f}"
    return f"{x:g}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"
