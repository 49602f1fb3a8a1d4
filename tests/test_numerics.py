"""The numerics of docs/concepts.md#definitions on hand-built tensors, checked against torch's own rounding and
Python's frexp."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_fractions import (
    flush_fraction,
    overflow_fraction,
    subnormal_fraction,
    update_underflow_fraction,
    zero_fraction,
)

from lightning_mpt.core.numerics import (
    BF16,
    FP16,
    FP32,
    STORED_COUNTS,
    exponent_bins,
    exponent_histograms,
    flush_counts,
    format_of,
    max_abs,
    stored_counts,
    update_underflow_counts,
    value_histograms,
)

INF, NAN = math.inf, math.nan


# ----------------------------------------------------------------------------------------------------- formats
def test_fp16_constants_are_the_contract():
    assert FP16.max == 65504.0
    assert FP16.min_normal == 2.0**-14
    assert f"{FP16.min_normal:.3g}" == "6.1e-05"
    assert FP16.min_subnormal == 2.0**-24
    assert f"{FP16.min_subnormal:.3g}" == "5.96e-08"
    assert FP16.eps == 2.0**-10
    assert BF16.eps == 2.0**-7
    assert (FP16.min_exponent, FP16.normal_exponent, FP16.max_exponent) == (-24, -14, 15)
    assert (BF16.min_exponent, BF16.normal_exponent, BF16.max_exponent) == (-133, -126, 127)
    assert FP16.overflow_threshold == 65520.0
    assert FP16.flush_threshold == 2.0**-25


@pytest.mark.parametrize("fmt", [FP16, BF16], ids=lambda f: f.name)
def test_format_constants_match_torch_rounding(fmt):
    finfo = torch.finfo(fmt.dtype)
    assert fmt.max == finfo.max
    assert fmt.min_normal == finfo.tiny
    assert fmt.eps == finfo.eps
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)
    up = lambda x: torch.nextafter(f32(x), f32(INF)).item()
    down = lambda x: torch.nextafter(f32(x), f32(0.0)).item()
    values = f32([
        fmt.min_subnormal,
        fmt.flush_threshold,
        up(fmt.flush_threshold),
        down(fmt.overflow_threshold),
        fmt.overflow_threshold,
    ])
    assert fmt.cast(values).double().tolist() == [fmt.min_subnormal, 0.0, fmt.min_subnormal, fmt.max, INF]


def test_format_of():
    assert format_of(torch.float16) is FP16
    assert format_of(torch.bfloat16) is BF16
    assert format_of(torch.float32) is FP32
    with pytest.raises(ValueError, match="torch.float16"):
        format_of(torch.int8)


# ------------------------------------------------------------------------------------------- flush (underflow)
@pytest.mark.parametrize("scale", [1.0, 1024.0, 65536.0])
def test_flush_below_2_pow_minus_25_over_scale(scale):
    t = 2.0**-25 / scale
    g = torch.tensor([0.0, 0.5 * t, t, -t, 1.01 * t, 3 * t, 1e-3, -0.25 * t])
    # at or below 2**-25 once scaled -> 0 (ties to even); just above -> the min subnormal; zeros are not counted
    assert flush_counts([g], scale, FP16).tolist() == [[7, 4]]
    assert flush_fraction(g, scale, FP16).item() == pytest.approx(4 / 7)
    assert flush_fraction(g, scale, BF16).item() == 0.0  # bf16 keeps values down to 2**-133
    assert math.isnan(flush_fraction(torch.zeros(3), scale, FP16).item())


def test_flush_counts_per_tensor_and_missing_gradients():
    a = torch.tensor([1e-9, 1e-9, 1.0])
    b = torch.tensor([1e-3, 0.0])
    assert flush_counts([a, None, b], 1.0, FP16).tolist() == [[3, 2], [0, 0], [1, 0]]
    assert flush_counts([a], 2.0**10, FP16).tolist() == [[3, 0]]  # a larger scale rescues them


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(min_value=-(2.0**-10), max_value=2.0**-10, allow_nan=False, width=32), min_size=1, max_size=40),
    st.sampled_from([1.0, 8.0, 2.0**12, 2.0**16]),
)
def test_flush_counts_match_elementwise_definition(values, scale):
    g = torch.tensor(values, dtype=torch.float32)
    expected_nonzero = sum(v != 0 for v in values)
    expected = sum(v != 0 and torch.tensor(v * scale, dtype=torch.float32).half().item() == 0 for v in values)
    assert flush_counts([g], scale, FP16).tolist() == [[expected_nonzero, expected]]


# ------------------------------------------------------------------------------------- stored-gradient fractions
def test_stored_fractions_fp16_hand_built():
    sub = 2.0**-20  # subnormal in fp16
    g = torch.tensor([0.0, 0.0, sub, -sub, 2.0**-14, 1.0, -3.0, INF, NAN, 60000.0], dtype=torch.float16)
    counts = stored_counts(exponent_histograms([g], FP16), FP16)[0].tolist()
    assert dict(zip(STORED_COUNTS, counts)) == {
        "numel": 10,
        "zero": 2,
        "subnormal": 2,
        "nonzero_finite": 6,
        "overflow": 2,
    }
    assert zero_fraction(g).item() == pytest.approx(0.2)
    assert subnormal_fraction(g, FP16).item() == pytest.approx(2 / 6)  # over nonzero finite values
    assert overflow_fraction(g, FP16).item() == pytest.approx(0.2)


def test_fp32_values_are_measured_as_stored_in_the_half_format():
    # 70000 overflows, 2**-26 flushes to zero, 2**-16 is a subnormal once rounded to fp16
    g = torch.tensor([70000.0, 2.0**-26, 2.0**-16, 1.0])
    counts = stored_counts(exponent_histograms([g], FP16), FP16)[0].tolist()
    assert dict(zip(STORED_COUNTS, counts)) == {
        "numel": 4,
        "zero": 1,
        "subnormal": 1,
        "nonzero_finite": 2,
        "overflow": 1,
    }
    assert overflow_fraction(torch.tensor([1.0, 2.0]), FP16, scale=40000.0).item() == 0.5  # 80000 -> inf
    assert overflow_fraction(torch.tensor([1.0, 2.0]), BF16, scale=40000.0).item() == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=16), min_size=1, max_size=40))
def test_exponent_histogram_matches_frexp(values):
    h = exponent_histograms([torch.tensor(values, dtype=torch.float16)], FP16)[0].tolist()
    labels = exponent_bins(FP16)
    expected = dict.fromkeys(labels, 0)
    for v in values:
        if not math.isfinite(v):
            expected["nonfinite"] += 1
        elif v == 0:
            expected["zero"] += 1
        else:
            expected[str(math.frexp(v)[1] - 1)] += 1
    assert dict(zip(labels, h)) == expected


def test_exponent_bins_bf16_edges():
    x = torch.tensor([2.0**-133, 2.0**-126, BF16.max, -INF], dtype=torch.bfloat16)
    h = exponent_histograms([x, None], BF16)
    labels = exponent_bins(BF16)
    assert h.shape == (2, len(labels))
    assert h[1].sum() == 0
    got = {labels[i]: c for i, c in enumerate(h[0].tolist()) if c}
    assert got == {"-133": 1, "-126": 1, "127": 1, "nonfinite": 1}


# ----------------------------------------------------------------------------------------------- update underflow
def test_update_underflow_seed_example_1():
    w, u = torch.tensor([0.5]), torch.tensor([-3e-7])
    assert update_underflow_fraction(w, u, FP16).item() == 1.0
    assert update_underflow_fraction(w, u, BF16).item() == 1.0
    assert update_underflow_fraction(w, u, FP32).item() == 0.0


def test_update_underflow_counts_by_cast_and_compare():
    # fp16 spacing at 1.0 is 2**-10: +2**-12 is lost, +2**-11 is a tie that rounds (to even) back to 1.0 -- an ulp
    # inequality "|u| < ulp/2" would call it kept -- and +2**-10 shows
    old = torch.tensor([1.0, 1.0, 1.0, 1.0, 2048.0])
    new = old + torch.tensor([2.0**-12, 2.0**-11, 2.0**-10, 0.0, 1.0])
    assert update_underflow_counts([old], [new], FP16).tolist() == [[4, 3]]  # 2048+1 is lost too (spacing 2)
    assert update_underflow_counts([old], [new], FP32).tolist() == [[4, 0]]
    assert math.isnan(update_underflow_fraction(old, torch.zeros(5), FP16).item())


# ---------------------------------------------------------------------------------------- value histograms, max
def test_value_histograms_ignore_nonfinite_values():
    stats = value_histograms(
        [[torch.tensor([1.0, 2.0, NAN, 3.0, INF])], [torch.tensor([NAN])], [torch.zeros(4)]], bins=4
    )
    lo, hi, num, total, squares, *counts = stats[0].tolist()
    assert (lo, hi, num, total, squares) == (1.0, 3.0, 3.0, 6.0, 14.0)
    assert counts == [1.0, 0.0, 1.0, 1.0]
    assert stats[1, 2].item() == 0  # nothing finite to draw
    assert stats[2, :3].tolist() == [0.0, 0.0, 4.0]
    assert stats[2, 5:].sum().item() == 4


def test_value_histograms_group_several_tensors_and_check_bins():
    a, b = torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 1.0]).half()
    lo, hi, num, *_ = value_histograms([[a, b]], bins=2)[0].tolist()
    assert (lo, hi, num) == (-1.0, 1.0, 4.0)
    with pytest.raises(ValueError, match="bins"):
        value_histograms([[a]], bins=0)


def test_max_abs_mixed_dtypes_and_nonfinite():
    out = max_abs([torch.tensor([1.0, -3.0]).half(), torch.tensor([2.0]), torch.tensor([NAN]), torch.tensor([-INF])])
    assert out.dtype == torch.float32
    assert out[:2].tolist() == [3.0, 2.0]
    assert math.isnan(out[2].item())
    assert out[3].item() == INF


def test_batched_functions_return_device_tensors():
    g = [torch.randn(5), torch.randn(3)]
    for result in (
        exponent_histograms(g, FP16),
        flush_counts(g, 2.0, FP16),
        update_underflow_counts(g, g, FP16),
        max_abs(g),
        value_histograms([g]),
    ):
        assert isinstance(result, torch.Tensor)


@pytest.mark.parametrize("fmt", [FP16, BF16], ids=lambda f: f.name)
def test_exponent_histogram_bit_pattern_table_matches_frexp_path(fmt):
    from lightning_mpt.core.numerics import _bincount, _exponent_index

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(20000, generator=g) * torch.logspace(-45, 38, 20000)).to(fmt.dtype)
    x[::97], x[::101], x[::7], x[1::7] = INF, NAN, 0.0, -0.0
    direct = _bincount(_exponent_index(x, fmt).long(), len(exponent_bins(fmt)))
    assert torch.equal(exponent_histograms([x], fmt)[0], direct)
    assert exponent_histograms([x.float()], FP32)[0].sum() == x.numel()  # the 32-bit path
