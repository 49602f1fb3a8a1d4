"""The numerics definitions of DESIGN section 4 on a single tensor, written plainly: the references the batched
statistics of ``lightning_mpt.core.numerics`` are checked against."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_mpt.core.numerics import FloatFormat, exponent_histograms, flush_counts, stored_counts


def _numel(x: Tensor) -> Tensor:
    return torch.full((), float(x.numel()) if x.numel() else math.nan, device=x.device)


def zero_fraction(x: Tensor) -> Tensor:
    """Share of exact zeros among all values of ``x`` (NaN for an empty tensor). No host sync."""
    return (x == 0).sum() / _numel(x)


def subnormal_fraction(x: Tensor, fmt: FloatFormat) -> Tensor:
    """Share of subnormal values (``0 < |x| < min_normal`` once stored in ``fmt``) among the nonzero finite ones."""
    c = stored_counts(exponent_histograms([x], fmt), fmt)[0]
    return c[2] / c[3]


def overflow_fraction(x: Tensor, fmt: FloatFormat, scale: float = 1.0) -> Tensor:
    """Share of values that are non-finite once multiplied by ``scale`` and stored in ``fmt``."""
    scaled = x.float() * scale if scale != 1.0 else x
    return (~torch.isfinite(fmt.cast(scaled))).sum() / _numel(x)


def flush_fraction(x: Tensor, scale: float, fmt: FloatFormat) -> Tensor:
    """Of the nonzero values of the fp32 tensor ``x``, the share that become 0 when multiplied by ``scale`` and
    stored in ``fmt`` (NaN when ``x`` has no nonzero value)."""
    counts = flush_counts([x], scale, fmt)[0]
    return counts[1] / counts[0]


def update_underflow_fraction(w: Tensor, u: Tensor, fmt: FloatFormat) -> Tensor:
    """Of the nonzero updates ``u`` to the fp32 weights ``w``, the share where ``cast(w + u) == cast(w)`` in
    ``fmt``: the updates a weight stored in ``fmt`` alone would lose (NaN when ``u`` has no nonzero value)."""
    w = w.float()
    nonzero = u != 0
    lost = nonzero & (fmt.cast(w + u) == fmt.cast(w))
    return lost.sum() / nonzero.sum()
