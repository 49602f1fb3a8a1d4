"""The report's fp8 part: what torchao's casts did to each converted layer, and the layers to keep in bf16.

Example:
    ```python
    from lightning_mpt.report.events import load_runs

    runs, _ = load_runs("runs")
    for row in fp8_rows(runs[0])[:3]:
        print(row.layer, row.role, row.saturated, row.flush)
    ```
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_mpt.diagnostics import tags
from lightning_mpt.report.data import Advice, Fp8Row, RunData, RunSummary

__all__ = ["fp8_lines", "fp8_rows", "is_bad", "keep_in_bf16"]

#: a layer whose fp8 cast saturates at least this share of a role's values, at some logged step, is named
SATURATED_SHARE = 0.001
#: a layer whose fp8 cast flushes at least this share of a role's nonzero values, on average, is named
FLUSH_SHARE = 0.01


def is_bad(row: Fp8Row) -> bool:
    """Whether the casts of ``row`` saturate or flush enough values to name the layer (the thresholds above).

    Args:
        row: one layer and role of the fp8 casts.

    Example:
        ```python
        from lightning_mpt.report.data import Fp8Row

        assert is_bad(Fp8Row("fc1", "input", 0.0, 0.05, 0.06, 0.6, 90.0, 0.011))      # 5% flushed
        assert not is_bad(Fp8Row("fc2", "input", 0.0, 0.001, 0.002, 0.0, 1.0, 448.0))
        ```
    """
    return row.saturated >= SATURATED_SHARE or row.flush >= FLUSH_SHARE


def _per_role(run: RunData, tag: str) -> dict[tuple[str, str], list[float]]:
    found: dict[tuple[str, str], list[float]] = {}
    for full, series in run.scalars.items():
        key = tags.fp8_layer_role(tag, full)
        if key is not None:
            found[key] = [v for _, v in series]
    return found


def fp8_rows(run: RunData) -> list[Fp8Row]:
    """Every layer and role with fp8 statistics in ``run``, worst first (saturation, then flush)."""
    saturated, flush = _per_role(run, tags.FP8_SATURATED), _per_role(run, tags.FP8_FLUSH)
    subnormal, amax, scale = (_per_role(run, t) for t in (tags.FP8_SUBNORMAL, tags.FP8_AMAX, tags.FP8_SCALE))
    rows = []
    for key in sorted(set(saturated) | set(flush)):
        f, s, n = flush.get(key) or [0.0], saturated.get(key) or [0.0], subnormal.get(key) or [0.0]
        rows.append(
            Fp8Row(
                key[0],
                key[1],
                max(s),
                sum(f) / len(f),
                max(f),
                sum(n) / len(n),
                _last(amax.get(key)),
                _last(scale.get(key)),
            )
        )
    return sorted(rows, key=lambda r: (-r.saturated, -r.flush, r.layer, r.role))


def fp8_lines(rows: list[Fp8Row], top: int) -> list[str]:
    """The report's lines for one run: the worst ``top`` layers and roles (nothing when fp8 was not logged)."""
    if not rows:
        return []
    lines = [
        f"  fp8 casts by layer/role (saturated max, flush mean/max, subnormal mean, last scale), {len(rows)} in all:"
    ]
    for r in rows[:top]:
        scale = "?" if r.scale is None else f"{r.scale:.4g}"
        lines.append(
            f"    {r.layer}/{r.role}: {_pct(r.saturated)}, {_pct(r.flush)}/{_pct(r.flush_max)}, {_pct(r.subnormal)},"
            f" {scale}"
        )
    return lines


def keep_in_bf16(run: RunData, summary: RunSummary, facts: Any) -> Optional[Advice]:
    """Advice: the layers whose fp8 casts saturate or flush a lot, with the ``fp8_filter`` that keeps them in bf16."""
    bad = [r for r in summary.fp8 if is_bad(r)]
    if not bad:
        return None
    layers = sorted({r.layer for r in bad})
    why = "; ".join(f"{r.layer} {r.role}: {_pct(r.saturated)} saturated, {_pct(r.flush)} flushed" for r in bad[:3]) + (
        "; ..." if len(bad) > 3 else ""
    )
    names = ", ".join(repr(n) for n in layers)
    return Advice(
        "fp8_keep_bf16",
        f"Keep {', '.join(layers)} in bf16: their fp8 casts lose values ({why}). Pass "
        f"MPTPrecision('bf16', fp8=..., fp8_filter=lambda module, fqn: fqn not in {{{names}}}).",
        {
            "layers": layers,
            "saturated": {f"{r.layer}/{r.role}": r.saturated for r in bad},
            "flush": {f"{r.layer}/{r.role}": r.flush for r in bad},
        },
    )


def _last(values: Optional[list[float]]) -> Optional[float]:
    return values[-1] if values else None


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"
