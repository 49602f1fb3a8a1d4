"""Why each step was skipped, as far as the scale tells: while a dynamic scale backed off at the start, as a growth
probe, or otherwise.

A dynamic scale finds its level by overflowing: it starts high and backs off through the first steps, and after every
``growth_interval`` clean steps it grows and tries a higher scale, which overflows again when the gradients do not
fit (one skipped step, then the scale is back where it was). Those skips are the scaler at work, not a fault of the
run or of a parameter. A skip is a **growth probe** when the scale it ran at is above the lowest scale in force since
the previous skip: the scale grew into it.

Example:
    ```python
    from lightning_mpt.report.events import load_runs

    runs, _ = load_runs("runs")
    print(classify_skips(runs[0], scaling="dynamic"))   # SkipKinds(start=[...], probes=[...], other=[...])
    ```
"""

from __future__ import annotations

from typing import Optional

from lightning_mpt.diagnostics import tags
from lightning_mpt.report.data import RunData, SkipKinds

__all__ = ["classify_skips", "skipped_steps"]


def skipped_steps(run: RunData) -> list[int]:
    """The skipped optimizer steps of ``run``, in order: from the records, else from the 0/1 overflow flags.

    Args:
        run: what was read of the run.

    Example:
        ```python
        from lightning_mpt.report.events import load_runs

        runs, _ = load_runs("runs")
        print(skipped_steps(runs[0]))   # [2]
        ```
    """
    skips = [int(r["step"]) for r in run.record_list(tags.SKIP_RECORD)]
    if not skips:  # a run logged without records: the 0/1 flags
        skips = [s for s, v in run.series(tags.OVERFLOW) if v > 0]
    return sorted(set(skips))


def classify_skips(run: RunData, scaling: Optional[str]) -> SkipKinds:
    """The skipped steps of ``run`` by kind (see :class:`~lightning_mpt.report.data.SkipKinds`).

    Args:
        run: what was read of the run.
        scaling: ``loss_scaling`` of its run record: ``"dynamic"`` and ``"grad_scaler"`` back off and grow; with a
            static scale (or an unknown one) every skip is ``other``.

    Example:
        ```python
        from lightning_mpt.report.events import load_runs

        runs, _ = load_runs("runs")
        kinds = classify_skips(runs[0], "dynamic")
        print(kinds.start, kinds.probes, kinds.other)
        ```
    """
    skips = skipped_steps(run)
    if scaling not in ("dynamic", "grad_scaler"):
        return SkipKinds(other=skips)
    leading = next((i for i, s in enumerate(skips) if s != i), len(skips))
    scales = run.series(tags.LOSS_SCALE)
    at = dict(scales)
    records = {int(r["step"]): r for r in run.record_list(tags.SKIP_RECORD)}
    probes: list[int] = []
    other: list[int] = []
    for i in range(leading, len(skips)):
        step, previous = skips[i], skips[i - 1] if i else -1
        scale = records.get(step, {}).get("scale") or at.get(step)
        since = [v for s, v in scales if previous < s < step]
        after = records.get(previous, {}).get("scale_after")
        if after is not None:
            since.append(after)
        grew = scale is not None and bool(since) and scale > min(since)
        (probes if grew else other).append(step)
    return SkipKinds(skips[:leading], probes, other)
