"""Floating-point formats and batched statistics of tensors in them (pure torch, no Lightning).

The definitions are those of docs/concepts.md#definitions:

* **zero fraction**: exact zeros over all values of the stored half-precision tensor (structural zeros included);
* **subnormal fraction**: stored values with ``0 < |x| < min normal``, over the nonzero finite values;
* **overflow fraction**: values that are non-finite, or ``>= 65520`` (fp16) once scaled and rounded, over all values;
* **underflow (flush) fraction**: of the nonzero fp32 values, the share that round to 0 when multiplied by the loss
  scale and cast to the half format (only an fp32 reference shows this: a stored half tensor has already lost them);
* **update underflow fraction**: of the nonzero master updates ``u``, the share where
  ``cast_half(w + u) == cast_half(w)``, computed by cast-and-compare;
* **exponent histogram**: counts of ``floor(log2|x|)`` over the format's exponent range, plus a zero bin and a
  non-finite bin (see :func:`exponent_bins`).

Every batched function takes a sequence of tensors (one per parameter), returns per-tensor counts stacked in one
device tensor and never synchronises with the host: read all of them with a single ``.tolist()``.

Example:
    ```python
    import torch
    from lightning_mpt.core.numerics import FP16, FP32, flush_counts, update_underflow_counts

    w, u = torch.tensor([0.5]), torch.tensor([-3e-7])
    assert update_underflow_counts([w], [w + u], FP16).tolist() == [[1, 1]]  # fp16 weights would lose the update
    assert update_underflow_counts([w], [w + u], FP32).tolist() == [[1, 0]]  # an fp32 master keeps it
    g = torch.tensor([1e-9, 1e-3])
    assert flush_counts([g], scale=1.0, fmt=FP16).tolist() == [[2, 1]]  # 1e-9 < 2**-25: flushed to zero in fp16
    ```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_mpt._compat import foreach_norm

__all__ = [
    "BF16",
    "FP16",
    "FP32",
    "FloatFormat",
    "exponent_bins",
    "exponent_histograms",
    "flush_counts",
    "format_of",
    "max_abs",
    "stored_counts",
    "STORED_COUNTS",
    "update_underflow_counts",
    "value_histograms",
    "value_ranges",
]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: its range and precision (docs/concepts.md#definitions).

    Example:
        ```python
        from lightning_mpt.core.numerics import FP16
        assert FP16.max == 65504.0 and FP16.min_normal == 2.0**-14 and FP16.min_subnormal == 2.0**-24
        assert FP16.overflow_threshold == 65520.0 and FP16.flush_threshold == 2.0**-25
        ```
    """

    name: str
    dtype: torch.dtype
    max: float  # largest finite value
    min_normal: float
    min_subnormal: float
    eps: float  # 2**-mantissa_bits: spacing of the values in [1, 2)

    @property
    def min_exponent(self) -> int:
        """``floor(log2)`` of the smallest subnormal: the lowest exponent a nonzero value can have (-24 for fp16)."""
        return round(math.log2(self.min_subnormal))

    @property
    def normal_exponent(self) -> int:
        """``log2`` of the smallest normal value (-14 for fp16); lower exponents are subnormal."""
        return round(math.log2(self.min_normal))

    @property
    def max_exponent(self) -> int:
        """``floor(log2(max))``: the highest exponent a finite value can have (15 for fp16)."""
        return math.floor(math.log2(self.max))

    @property
    def overflow_threshold(self) -> float:
        """Smallest magnitude that rounds to inf: ``max`` plus half its spacing (65520 for fp16)."""
        return self.max + 2.0 ** (self.max_exponent - 1) * self.eps

    @property
    def flush_threshold(self) -> float:
        """Magnitudes at or below this round to zero: half the smallest subnormal (``2**-25`` for fp16)."""
        return self.min_subnormal / 2

    def cast(self, x: Tensor) -> Tensor:
        """``x`` rounded to this format (round to nearest even), as storing it would."""
        return x if x.dtype == self.dtype else x.to(self.dtype)


FP16 = FloatFormat("fp16", torch.float16, 65504.0, 2.0**-14, 2.0**-24, 2.0**-10)
BF16 = FloatFormat("bf16", torch.bfloat16, (2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133, 2.0**-7)
FP32 = FloatFormat("fp32", torch.float32, (2 - 2.0**-23) * 2.0**127, 2.0**-126, 2.0**-149, 2.0**-23)
_FORMATS = {f.dtype: f for f in (FP16, BF16, FP32)}


def format_of(dtype: torch.dtype) -> FloatFormat:
    """The :class:`FloatFormat` of ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``."""
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise ValueError(f"format_of({dtype}): expected one of {[str(d) for d in _FORMATS]}") from None


# ---------------------------------------------------------------------------------------------- exponent histograms
def exponent_bins(fmt: FloatFormat) -> list[str]:
    """Labels of the bins of :func:`exponent_histograms` for ``fmt``: ``"zero"``, then one bin per exponent
    ``e`` (values with ``floor(log2|x|) == e``) from ``fmt.min_exponent`` to ``fmt.max_exponent``, then
    ``"nonfinite"`` (inf and NaN).

    Example:
        ```python
        from lightning_mpt.core.numerics import FP16, exponent_bins
        bins = exponent_bins(FP16)
        assert bins[0] == "zero" and bins[1] == "-24" and bins[-2] == "15" and bins[-1] == "nonfinite"
        ```
    """
    return ["zero", *(str(e) for e in range(fmt.min_exponent, fmt.max_exponent + 1)), "nonfinite"]


def _num_bins(fmt: FloatFormat) -> int:
    return fmt.max_exponent - fmt.min_exponent + 3


def _exponent_index(x: Tensor, fmt: FloatFormat) -> Tensor:
    """Bin index (see :func:`exponent_bins`) of each value of ``x``, already in ``fmt``."""
    top = fmt.max_exponent - fmt.min_exponent + 1
    _, e = torch.frexp(x)  # x = m * 2**e with 0.5 <= |m| < 1, exact: floor(log2|x|) == e - 1
    idx = (e - fmt.min_exponent).clamp_(1, top)  # 1 + (e - 1 - min_exponent)
    idx = torch.where(x == 0, 0, idx)
    return torch.where(torch.isfinite(x), idx, top + 1)


def exponent_histograms(tensors: Sequence[Optional[Tensor]], fmt: FloatFormat, scale: float = 1.0) -> Tensor:
    """Exponent histograms of ``tensors`` once multiplied by ``scale`` and rounded to ``fmt``, as stored.

    Returns an int64 tensor of shape ``(len(tensors), len(exponent_bins(fmt)))`` on the first tensor's device;
    ``None`` entries give a row of zeros. No host sync.

    Example:
        ```python
        import torch
        from lightning_mpt.core.numerics import FP16, exponent_histograms
        h = exponent_histograms([torch.tensor([0.0, 1.0, 3.0, float("inf")])], FP16)
        assert h[0, 0] == 1 and h[0, -1] == 1 and h[0, 1 + 0 - FP16.min_exponent] == 1   # zero, inf, 1.0
        ```
    """
    nb = _num_bins(fmt)
    device = _first_device(tensors)
    zeros = torch.zeros(nb, dtype=torch.int64, device=device)
    rows = []
    for t in tensors:
        if t is None or t.numel() == 0:
            rows.append(zeros)
            continue
        x = fmt.cast(t.detach() * scale if scale != 1.0 else t.detach()).reshape(-1)
        if x.element_size() == 2:
            # 16-bit formats: count the 2**15 magnitude bit patterns, then fold them into bins with a table
            # (two cheap passes over the tensor instead of frexp and a chain of masks)
            patterns = _bincount((x.view(torch.int16) & 0x7FFF).long(), 1 << 15)
            table = _pattern_bins(fmt, patterns.device)
            row = torch.zeros(nb, dtype=torch.int64, device=patterns.device).index_add_(0, table, patterns)
        else:
            row = _bincount(_exponent_index(x, fmt).long(), nb)
        rows.append(row.to(device))
    if not rows:
        return torch.zeros(0, nb, dtype=torch.int64, device=device)
    return torch.stack(rows)


_PATTERN_BINS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _pattern_bins(fmt: FloatFormat, device: torch.device) -> Tensor:
    """The exponent-histogram bin of each nonnegative 16-bit pattern of ``fmt`` (cached per device)."""
    key = (fmt.dtype, device)
    table = _PATTERN_BINS.get(key)
    if table is None:
        values = torch.arange(1 << 15, dtype=torch.int16).view(fmt.dtype)
        table = _PATTERN_BINS[key] = _exponent_index(values, fmt).long().to(device)
    return table


def _bincount(idx: Tensor, n: int) -> Tensor:
    """Counts of the values ``0 .. n-1`` in ``idx`` (int64, length ``n``), without a host sync (``torch.bincount``
    reads the largest value on the host to size its output)."""
    if idx.is_cuda and torch.are_deterministic_algorithms_enabled():
        # CUDA index_add_ is flagged nondeterministic: count by sorting instead
        edges = torch.arange(n + 1, device=idx.device, dtype=idx.dtype)
        return torch.searchsorted(idx.sort().values, edges).diff().to(torch.int64)
    out = torch.zeros(n, dtype=torch.int64, device=idx.device)
    return out.index_add_(0, idx, torch.ones((), dtype=torch.int64, device=idx.device).expand(idx.numel()))


# columns of :func:`stored_counts`
STORED_COUNTS = ("numel", "zero", "subnormal", "nonzero_finite", "overflow")


def stored_counts(histograms: Tensor, fmt: FloatFormat) -> Tensor:
    """Counts behind the stored-gradient fractions, from :func:`exponent_histograms` of the stored values.

    Returns shape ``(P, 5)``, columns :data:`STORED_COUNTS`: all values, zeros, subnormals, nonzero finite values,
    non-finite values (a value ``>= overflow_threshold`` is inf once stored). Fractions: ``zero / numel``,
    ``subnormal / nonzero_finite``, ``overflow / numel``.
    """
    sub_bins = fmt.normal_exponent - fmt.min_exponent  # exponents min_exponent .. normal_exponent - 1
    numel = histograms.sum(1)
    zero, nonfinite = histograms[:, 0], histograms[:, -1]
    subnormal = histograms[:, 1 : 1 + sub_bins].sum(1)
    return torch.stack([numel, zero, subnormal, numel - zero - nonfinite, nonfinite], dim=1)


# ----------------------------------------------------------------------------------------------- flush (underflow)
def flush_counts(grads: Sequence[Optional[Tensor]], scale: float, fmt: FloatFormat) -> Tensor:
    """Per tensor, ``(nonzero, flushed)``: nonzero values, and those that become 0 when multiplied by ``scale``
    and cast to ``fmt``. ``grads`` are fp32 reference gradients (unscaled). Shape ``(P, 2)``, int64, no sync.

    Example:
        ```python
        import torch
        from lightning_mpt.core.numerics import FP16, flush_counts
        scale = 1024.0
        g = torch.tensor([0.0, 0.9 * 2**-25 / scale, 2**-25 / scale, 1.5 * 2**-25 / scale, 1e-3])
        assert flush_counts([g], scale, FP16).tolist() == [[4, 2]]   # at or below 2**-25 once scaled: flushed
        ```
    """
    device = _first_device(grads)
    rows = []
    for g in grads:
        if g is None:
            rows.append(torch.zeros(2, dtype=torch.int64, device=device))
            continue
        g = g.detach()
        nonzero = g != 0
        scaled = g.float() * scale if scale != 1.0 else g
        flushed = nonzero & (fmt.cast(scaled) == 0)
        rows.append(torch.stack([nonzero.sum(), flushed.sum()]).to(device))
    if not rows:
        return torch.zeros(0, 2, dtype=torch.int64, device=device)
    return torch.stack(rows)


def update_underflow_counts(old: Sequence[Tensor], new: Sequence[Tensor], fmt: FloatFormat) -> Tensor:
    """Per fp32 master tensor, ``(changed, lost)``: elements the optimizer step changed (``new != old``), and those
    whose change a weight in ``fmt`` would not see (``cast(new) == cast(old)``). Shape ``(P, 2)``, int64, no sync.
    """
    device = _first_device(new)
    rows = []
    for w0, w1 in zip(old, new):
        changed = w1 != w0
        lost = changed & (fmt.cast(w1) == fmt.cast(w0))
        rows.append(torch.stack([changed.sum(), lost.sum()]).to(device))
    if not rows:
        return torch.zeros(0, 2, dtype=torch.int64, device=device)
    return torch.stack(rows)


# ------------------------------------------------------------------------------------------------ value statistics
def max_abs(tensors: Sequence[Tensor]) -> Tensor:
    """``max |x|`` of each tensor as a float32 vector (inf or NaN when a tensor holds them; 0 for an empty tensor),
    with one foreach kernel per device and dtype. No host sync.

    Example:
        ```python
        import torch
        from lightning_mpt.core.numerics import max_abs
        m = max_abs([torch.tensor(-3.0), torch.empty(0), torch.tensor([1.0, float("inf")])])
        assert m.tolist() == [3.0, 0.0, float("inf")]   # a 0-dim tensor, an empty one, an inf
        ```
    """
    if not tensors:
        return torch.zeros(0)
    device = tensors[0].device
    out: list[Optional[Tensor]] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            out[i] = torch.zeros((), device=device)  # the infinity norm of nothing is undefined in torch: no value
        else:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for idx in groups.values():
        for i, n in zip(idx, foreach_norm([tensors[i].detach() for i in idx], math.inf)):
            out[i] = n.float().to(device)
    return torch.stack(out)  # type: ignore[arg-type]


def _unscaled(t: Tensor, device: torch.device, inv: Optional[Tensor]) -> Tensor:
    """``t`` flattened in fp32 on ``device``, multiplied by the fp32 ``inv`` (as the AMP unscale kernel does)."""
    x = t.detach().reshape(-1).float().to(device)
    return x if inv is None else x * inv


def _inverse(scale: float, device: torch.device) -> Optional[Tensor]:
    return None if scale == 1.0 else torch.full((), 1.0 / scale, dtype=torch.float32, device=device)


def value_ranges(groups: Sequence[Sequence[Tensor]], scale: float = 1.0) -> Tensor:
    """The finite minimum and maximum of each group of tensors: float64 of shape ``(len(groups), 2)``, ``(inf, -inf)``
    for a group without finite values. No host sync. ``scale``: the tensors are scaled gradients; their values are
    taken unscaled (multiplied by ``1 / scale`` in fp32, as ``torch.amp``'s unscale kernel does).

    The range of values that are split over several processes (FSDP2's shards) is the elementwise minimum and maximum
    of the processes' ranges; pass it to :func:`value_histograms` so that every process bins with the same edges.

    Example:
        ```python
        import torch
        from lightning_mpt.core.numerics import value_ranges
        r = value_ranges([[torch.tensor([2.0, -1.0]), torch.tensor([float("inf")])], [torch.empty(0)]])
        assert r.tolist() == [[-1.0, 2.0], [float("inf"), float("-inf")]]
        ```
    """
    device = _first_device([t for g in groups for t in g])
    out = torch.empty(len(groups), 2, dtype=torch.float64, device=device)
    out[:, 0], out[:, 1] = math.inf, -math.inf
    inf = torch.full((), math.inf, device=device)
    inv = _inverse(scale, device)
    for row, group in zip(out, groups):
        flat = [_unscaled(t, device, inv) for t in group if t.numel()]
        if not flat:
            continue
        finite = [torch.isfinite(t) for t in flat]
        row[0] = torch.stack([torch.where(f, t, inf).amin() for t, f in zip(flat, finite)]).amin()
        row[1] = torch.stack([torch.where(f, t, -inf).amax() for t, f in zip(flat, finite)]).amax()
    return out


def value_histograms(
    groups: Sequence[Sequence[Tensor]], bins: int = 32, ranges: Optional[Tensor] = None, scale: float = 1.0
) -> Tensor:
    """Histograms of the finite values of each group of tensors, in ``bins`` equal-width buckets between the
    group's finite minimum and maximum.

    Returns float64 of shape ``(len(groups), 5 + bins)``: ``min, max, num, sum, sum_squares, counts...`` (the
    arguments of TensorBoard's ``add_histogram_raw``); a group without finite values has ``num == 0``. No host sync.

    ``ranges``: the ``(len(groups), 2)`` minimum and maximum to bin between (:func:`value_ranges`), by default those of
    ``groups``. Values split over processes are binned with their global range by each process; the counts, ``num``,
    ``sum`` and ``sum_squares`` of the processes then add up to those of the whole tensors. ``scale``: as in
    :func:`value_ranges`.

    Example:
        ```python
        import torch
        from lightning_mpt.core.numerics import value_histograms, value_ranges
        a, b = torch.tensor([0.0, 1.0]), torch.tensor([3.0, 4.0])   # one tensor split in two shards
        whole = value_histograms([[torch.cat([a, b])]], bins=4)
        ra, rb = value_ranges([[a]]), value_ranges([[b]])
        ranges = torch.stack([torch.minimum(ra[:, 0], rb[:, 0]), torch.maximum(ra[:, 1], rb[:, 1])], dim=1)
        parts = value_histograms([[a]], 4, ranges) + value_histograms([[b]], 4, ranges)
        assert torch.equal(parts[0, 2:], whole[0, 2:]) and torch.equal(ranges[0], whole[0, :2])
        ```
    """
    if bins < 1:
        raise ValueError(f"value_histograms(bins={bins!r}): expected an int >= 1")
    device = _first_device([t for g in groups for t in g])
    if ranges is None:
        ranges = value_ranges(groups, scale)
    ranges = ranges.to(device=device, dtype=torch.float64)
    out = torch.zeros(len(groups), 5 + bins, dtype=torch.float64, device=device)
    out[:, :2] = ranges
    inv = _inverse(scale, device)
    for row, group, (lo64, hi64) in zip(out, groups, ranges):
        flat = [_unscaled(t, device, inv) for t in group if t.numel()]
        if not flat:
            continue
        lo, hi = lo64.float(), hi64.float()  # the values' own format: exact, the extremes are values
        width = torch.where(hi > lo, (hi - lo) / bins, torch.ones((), device=device))
        counts = torch.zeros(bins + 1, dtype=torch.int64, device=device)
        stats = torch.zeros(3, dtype=torch.float64, device=device)
        for t in flat:
            f = torch.isfinite(t)
            v = torch.where(f, t, 0.0)
            idx = ((v - lo) / width).floor_().clamp_(0, bins - 1).long()
            counts += _bincount(torch.where(f, idx, bins), bins + 1)  # non-finite values go to a dropped bin
            stats += torch.stack([f.sum().double(), v.sum(dtype=torch.float64), (v.double() * v).sum()])
        row[2:5] = stats
        row[5:] = counts[:bins]
    return out


def _first_device(tensors: Sequence[Optional[Tensor]]) -> torch.device:
    return next((t.device for t in tensors if t is not None), torch.device("cpu"))
