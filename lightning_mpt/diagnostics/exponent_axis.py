"""The x axis of the exponent histograms (``mpt/grad_exponent/<name>``): how their buckets are written and read back.

The axis is in powers of two and always spans the whole format (fp16 numbers shown): one bucket ``(e, e + 1]`` per
exponent ``e = floor(log2|g|)`` from the min subnormal exponent (-24) to the max (15; the min normal is -14); exact
zeros in ``(lo - 3, lo - 2]`` left of a gap, inf/NaN in ``(hi + 3, hi + 4]`` right of a gap. The histogram's
``min``/``max`` are ``lo - 3``/``hi + 4``, which tell the format.

Example:
    ```python
    from lightning_mpt.core.numerics import FP16, exponent_bins
    from lightning_mpt.diagnostics.exponent_axis import decode, encode

    row = [0.0] * len(exponent_bins(FP16))
    row[0], row[1 + 24 - 3], row[-1] = 2.0, 5.0, 1.0         # 2 zeros, 5 values of exponent -3, 1 inf
    (low, high), _, (limits, counts) = encode(row, FP16)
    fmt, zeros, nonfinite, by_exponent = decode(low, high, limits, counts)
    assert (fmt, zeros, nonfinite, by_exponent) == (FP16, 2.0, 1.0, {-3: 5.0})
    ```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from lightning_mpt.core.numerics import BF16, FP16, FloatFormat

__all__ = ["FORMATS", "FloatFormat", "decode", "encode"]

#: the formats whose exponent histograms the diagnostics write
FORMATS = (FP16, BF16)


def encode(
    row: Sequence[float], fmt: FloatFormat
) -> Optional[tuple[tuple[float, float], tuple[float, float, float], tuple[list[float], list[float]]]]:
    """``((min, max), (count, sum, sum of squares), (bucket right edges, counts))`` of one row of
    :func:`~lightning_mpt.core.numerics.exponent_histograms` (zeros, one count per exponent, non-finite); ``None``
    for a row without values. The sums place each count at the middle of its bucket."""
    num = sum(row)
    if num <= 0:
        return None
    lo, hi = fmt.min_exponent, fmt.max_exponent
    limits = [lo - 2, lo, *range(lo + 1, hi + 2), hi + 3, hi + 4]
    centers = [lo - 2.5, 0.0, *(e + 0.5 for e in range(lo, hi + 1)), 0.0, hi + 3.5]
    counts = [row[0], 0.0, *row[1:-1], 0.0, row[-1]]
    total = sum(c * x for c, x in zip(counts, centers))
    squares = sum(c * x * x for c, x in zip(counts, centers))
    return (float(lo - 3), float(hi + 4)), (num, total, squares), ([float(x) for x in limits], counts)


def decode(
    low: float, high: float, limits: Sequence[float], counts: Sequence[float]
) -> Optional[tuple[FloatFormat, float, float, dict[int, float]]]:
    """``(format, zeros, non-finite, {exponent: count})`` of a histogram :func:`encode` wrote (runs of empty buckets
    may have been merged: only nonzero buckets matter); ``None`` when its range is neither fp16's nor bf16's."""
    lo, hi = round(low) + 3, round(high) - 4
    fmt = next((f for f in FORMATS if (f.min_exponent, f.max_exponent) == (lo, hi)), None)
    if fmt is None:
        return None
    zero = nonfinite = 0.0
    found: dict[int, float] = {}
    for limit, count in zip(limits, counts):
        edge = round(limit)
        if count == 0:
            continue
        if edge == lo - 2:
            zero += count
        elif edge == hi + 4:
            nonfinite += count
        elif lo < edge <= hi + 1:
            found[edge - 1] = found.get(edge - 1, 0.0) + count
    return fmt, zero, nonfinite, found
