"""``lightning_mpt.fabric.MPTPrecision(..., sharded=True)`` under FSDP2 (Fabric's ``ModelParallelStrategy``), with 2 CPU
processes (gloo).

One launch of tests/fabric_fsdp_worker.py runs every loop; the tests read what each rank wrote. The references are
independent of the plugin's FSDP2 path: Fabric's own "bf16-mixed" with the same sharding and policy, and the same
loop under DDP with the plugin's copy masters (the same initial weights and batches).

Where the comparison with DDP is bitwise, and why: both runs compute the forward with the same kernels on the same
half weights (FSDP2 all-gathers whole tensors) in the same process and thread count; with 2 processes both reduce a
half gradient as a sum of 2 values (each rank's halved), which is commutative; unscaling, clipping by value, the
scale update and AdamW are elementwise. The one value computed in another order is the clipping norm: DDP sums the
squares of whole gradients, FSDP2 those of each shard and then the ranks' partial sums. Where it changes the norm's
last bits, the masters part; from there on the fp16 test bounds the difference instead (see ``shadow_bounds``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.fsdp
from models import run_workers
from tb_events import read_events, records

from lightning_mpt.diagnostics import tags

pytestmark = [
    pytest.mark.ddp,
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "fully_shard"), reason="FSDP2 is public from torch 2.6"),
]

WORKER = Path(__file__).with_name("fabric_fsdp_worker.py")
STEPS, INJECT_STEP = 12, 5
U = 2.0**-24  # fp32's unit roundoff: one rounding errs by at most U, relative
LR, BETAS = 3e-3, (0.9, 0.999)  # the worker's AdamW (weight decay 0.01 only shrinks a difference)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_workers(WORKER, tmp_path_factory.mktemp("fabric-fsdp"))


def seen(out: Path, run: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / run / f"rank{rank}.json").read_text())


def rows(out: Path, run: str, rank: int = 0) -> list[dict[str, Any]]:
    return seen(out, run, rank)["rows"]


def test_bf16_equals_fabrics_bf16_mixed_with_the_same_sharding_and_ddp(out):
    fsdp, mixed, ddp = rows(out, "bf16-fsdp"), rows(out, "bf16-mixed"), rows(out, "bf16-ddp")
    assert len(fsdp) == STEPS
    assert [r["batch"] for r in fsdp] == [r["batch"] for r in mixed] == [r["batch"] for r in ddp]  # the same data
    assert fsdp[0]["dtypes"] == ["torch.float32"]  # the parameters are FSDP2's fp32 shards: no second copy
    assert ddp[0]["dtypes"] == ["torch.bfloat16", "torch.float32"]  # DDP: half weights (and fp32 LayerNorms)
    for a, b in zip(fsdp, mixed):
        assert a["loss"] == pytest.approx(b["loss"], rel=5e-3)  # the bound; measured: equal
    # no clipping by norm: every value is computed in the same order as under DDP (the module docstring)
    assert [r["loss"] for r in fsdp] == [r["loss"] for r in ddp]
    assert [r["masters"] for r in fsdp] == [r["masters"] for r in ddp]
    assert fsdp[-1]["loss"] < fsdp[0]["loss"]
    assert not any(r["skipped"] for r in fsdp)


def norm_rtol(numel: int) -> float:
    """How far apart two fp32 computations of one 2-norm of ``numel`` values can be when they sum in different orders.

    A sum of n nonnegative terms errs by at most (n - 1) U relative in any order (Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed., sec. 4.2). Squaring, the levels of the sum (per tensor, per shard, over the ranks)
    and the square roots add a few U, and the roots halve the rest: each norm is within (n/2 + 8) U of the exact one.
    """
    return (numel + 16) * U


def adam_gain(t: int) -> float:
    """Bound on the change of AdamW's normalized update ``m_hat / sqrt(v_hat)`` at its step ``t`` per unit of relative
    change of every gradient it was fed.

    With every gradient ``g_j`` off by a relative ``e`` at most, ``m`` moves by at most ``e * sum(a_j |g_j|)`` and
    ``sqrt(v)`` by a relative ``e``, where ``a_j = (1 - b1) b1^(t-j)`` and ``b_j = (1 - b2) b2^(t-j)`` weigh the
    moments; by Cauchy-Schwarz ``sum(a_j |g_j|) <= sqrt(sum(a_j^2 / b_j)) * sqrt(v)``. With the bias corrections the
    update moves by at most ``2 e sqrt(sum(a_j^2 / b_j)) sqrt(1 - b2^t) / (1 - b1^t)`` (1 per ``e`` at t = 1).
    """
    b1, b2 = BETAS
    weights = sum((1 - b1) ** 2 / (1 - b2) * (b1**2 / b2) ** i for i in range(t))
    return 2 * math.sqrt(weights) * math.sqrt(1 - b2**t) / (1 - b1**t)


def shadow_bounds(run: list[dict[str, Any]]) -> list[float]:
    """Per step, the largest absolute difference the clipping norm's order allows between a run's masters and its
    shadow (DDP's clipping and AdamW fed the run's own gradients: tests/fabric_fsdp_worker.py ``Shadow``).

    While the two norms are equal, so is everything else (elementwise operations on equal inputs): 0. From the first
    step where they differ, every gradient the shadow is fed is off by a relative ``e``: the norms' relative difference,
    plus the roundings of the clipping coefficient and of the moments, which now round different inputs (4 U a step).
    Each AdamW step then moves the two by at most ``LR * e * adam_gain(t)`` apart, and the two roundings of a master
    (weight decay, update) by at most one ulp each, ``2^-23`` of the largest master.
    """
    ulp = 2.0**-23 * max(r["max_abs_master"] for r in run)
    bounds, total, e, t = [], 0.0, 0.0, 0
    for r in run:
        if not r["skipped"]:
            t += 1
            if e or r["norm"] != r["shadow_norm"]:
                e = max(e, abs(r["norm"] - r["shadow_norm"]) / r["shadow_norm"] + 4 * STEPS * U)
                total += LR * e * adam_gain(t) / (1 - e) + 2 * ulp
        bounds.append(total)
    return bounds


@pytest.mark.parametrize("sharding", ["fsdp", "hsdp"])
def test_fp16_scales_skips_clipping_and_masters_equal_ddp(out, sharding):
    """``hsdp``: a 2-D mesh, replicated over both processes and sharded over one (HSDP's all-reduce path)."""
    fsdp, ddp = rows(out, f"fp16-{sharding}"), rows(out, "fp16-ddp")
    numel = seen(out, "fp16-ddp")["numel"]
    # up to the first step whose clipping norms differ, every value is computed from equal inputs in the same order
    # (the module docstring): bitwise equal; at that step the loss and the decision still are
    same = next((i for i, (a, b) in enumerate(zip(fsdp, ddp)) if a["norm"] != b["norm"]), STEPS)
    for key in ("masters", "state"):
        assert [r[key] for r in fsdp[:same]] == [r[key] for r in ddp[:same]], key
    assert [r["loss"] for r in fsdp[: same + 1]] == [r["loss"] for r in ddp[: same + 1]]
    # afterwards the masters are a few ulps apart (bounded below against the shadow), so the half weights are equal
    # or one half-precision ulp apart: the losses stay within 2^-10, and a skip decision, which compares the scaled
    # gradients with fp16's largest value, would flip only for a gradient within those last bits of it
    for a, b in zip(fsdp[same:], ddp[same:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=2**-10)
    for key in ("scale", "skipped"):
        assert [r[key] for r in fsdp] == [r[key] for r in ddp], key
    natural = [r["step"] for r in fsdp if r["skipped"] and r["step"] != INJECT_STEP]
    assert natural, "the scale starts too high: the first steps overflow and back off"
    assert [r["scale"] for r in fsdp[: len(natural) + 1]] == [2.0**20 / 2**i for i in range(len(natural) + 1)]
    for run in (fsdp, ddp):  # the clipping norm is the global one, over both shards: DDP's
        for r in run:
            if r["skipped"]:
                assert r["norm"] == r["shadow_norm"] == 0.0  # a skipped step's gradients are dropped before clipping
            else:
                assert r["norm"] > 0.05  # so the clipping (max_norm 0.05) acted
                assert r["norm"] == pytest.approx(r["shadow_norm"], rel=norm_rtol(numel), abs=0)
    # the shadow is DDP's arithmetic: under DDP it is the masters (same process, kernels, inputs and order); with a
    # shard group of one process (HSDP here) each shard is a whole tensor and the reduction over the group of one
    # squares and takes the root of one value, exact in fp32: DDP's norm too
    for run in (ddp, fsdp) if sharding == "hsdp" else (ddp,):
        assert [r["norm"] for r in run] == [r["shadow_norm"] for r in run]
        assert [r["shadow_difference"] for r in run] == [0.0] * STEPS
    for r, bound in zip(fsdp, shadow_bounds(fsdp)):
        assert r["shadow_difference"] <= bound, (r["step"], r["shadow_difference"], bound)
    assert seen(out, f"fp16-{sharding}")["skipped_steps"] == sum(r["skipped"] for r in fsdp)


@pytest.mark.parametrize("sharding", ["fsdp", "hsdp"])
def test_an_inf_on_one_rank_skips_the_step_on_both_and_names_the_parameter_on_both(out, sharding):
    ranks = [rows(out, f"fp16-{sharding}", r) for r in (0, 1)]
    step = [r[INJECT_STEP] for r in ranks]
    assert step[0]["skipped"]
    assert step[1]["skipped"]
    assert step[0]["culprits"] == step[1]["culprits"] == ["model.3.weight"]  # original names; the flags all-reduced
    assert step[0]["masters"] == ranks[0][INJECT_STEP - 1]["masters"]  # nothing moved
    assert step[0]["state"] == ranks[0][INJECT_STEP - 1]["state"]
    assert ranks[0][INJECT_STEP + 1]["scale"] == step[0]["scale"] / 2  # backed off
    # one run: both ranks clip with the one all-reduced norm (a sum of 2 values) and digest the same gathered masters
    for key in ("scale", "skipped", "masters", "state"):
        assert [r[key] for r in ranks[0]] == [r[key] for r in ranks[1]], key
    assert seen(out, f"fp16-{sharding}", 0)["loss_scale"] == seen(out, f"fp16-{sharding}", 1)["loss_scale"]


def test_gradient_accumulation_and_clipping_by_value_equal_ddp(out):
    fsdp, ddp = rows(out, "accumulate-fsdp"), rows(out, "accumulate-ddp")
    # bitwise: each rank adds its micro-batches' half gradients in the same sequence under both, then the 2 ranks'
    # sums are summed; clipping by value is elementwise (the module docstring for the rest)
    for key in ("scale", "skipped", "loss", "masters", "state"):
        assert [r[key] for r in fsdp] == [r[key] for r in ddp], key
    assert [r["skipped"] for r in fsdp] == [False, False, True, False, False, True]  # grown (interval 2), overflowed
    for prev, row in zip(fsdp, fsdp[1:]):
        assert (row["masters"] == prev["masters"]) is row["skipped"]  # a clean step moves, a skipped one does not


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_save_then_load_into_a_fresh_fabric_resumes_bitwise(out, kind):
    straight, resumed = rows(out, "resume-straight"), seen(out, f"resume-{kind}")
    assert resumed["saved"]["dir"] is (kind == "sharded")  # a distributed checkpoint is a folder
    assert resumed["saved"]["skipped"] > 0  # the scaler state matters: it had backed off
    assert resumed["loaded"]["scale"] == resumed["saved"]["scale"]
    assert resumed["loaded"]["skipped"] == resumed["saved"]["skipped"]
    assert resumed["loaded"]["replaced"] is (kind == "sharded")  # Lightning's sharded path: see the worker
    for key in ("loss", "scale", "skipped", "masters", "state"):  # the same configuration: the same order
        assert [r[key] for r in resumed["rows"]] == [r[key] for r in straight], key


@pytest.mark.parametrize("sharding", ["fsdp", "hsdp"])
def test_the_logger_writes_the_same_dashboard_as_under_ddp(out, sharding):
    fsdp, ddp = read_events(out / f"logger-{sharding}" / "version_0"), read_events(out / "logger-ddp" / "version_0")
    names = set(ddp.Tags()["scalars"])
    assert names == set(fsdp.Tags()["scalars"])
    assert {tags.LOSS_SCALE, tags.OVERFLOW, tags.GRAD_ZERO, tags.UPDATE_UNDERFLOW} <= names
    assert {tags.GRAD_UNDERFLOW, tags.SCALE_HEADROOM} <= names  # the fp32 reference, from the whole fp32 weights
    assert [e.step for e in fsdp.Scalars(tags.SCALE_HEADROOM)] == [0, 2, 4, 6]
    assert tags.per_parameter(tags.GRAD_UNDERFLOW, "model.0.weight") in names
    assert tags.per_parameter(tags.GRAD_ZERO, "model.0.weight") in names  # the original parameter names
    # no clipping: the masters are bitwise DDP's (the module docstring), and every scalar is a ratio of counts, a
    # maximum or the scale, every histogram field compared a count or an extreme: none depends on a sum's order
    for tag in sorted(names):
        a, b = [(e.step, e.value) for e in ddp.Scalars(tag)], [(e.step, e.value) for e in fsdp.Scalars(tag)]
        assert [s for s, _ in a] == [s for s, _ in b], tag
        assert all(x == y or (math.isnan(x) and math.isnan(y)) for (_, x), (_, y) in zip(a, b)), (tag, a, b)
    hists = set(ddp.Tags()["histograms"])
    assert hists == set(fsdp.Tags()["histograms"])
    for tag in sorted(hists):
        for x, y in zip(ddp.Histograms(tag), fsdp.Histograms(tag)):
            hx, hy = x.histogram_value, y.histogram_value
            assert (x.step, hx.min, hx.max, hx.num) == (y.step, hy.min, hy.max, hy.num), tag
            assert list(hx.bucket) == list(hy.bucket), (tag, x.step)
    a = [(s, {**r, "params": sorted(r["params"])}) for s, r in records(ddp, tags.SKIP_RECORD)]
    b = [(s, {**r, "params": sorted(r["params"])}) for s, r in records(fsdp, tags.SKIP_RECORD)]
    assert a == b
    assert a  # the scale starts too high: there are skips to record
    assert seen(out, f"logger-{sharding}", 0)["syncs"] == seen(out, f"logger-{sharding}", 1)["syncs"] == 8  # 1 a step


def test_a_model_created_on_the_meta_device_is_materialized_in_fp32_and_trains(out):
    meta = seen(out, "meta")
    assert meta["meta"]  # fabric.init_module(empty_init=True) made it on the meta device
    rows_ = meta["rows"]
    assert rows_[0]["dtypes"] == ["torch.float32"]  # materialized after sharding as fp32 shards: the masters
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in rows_)
    assert len({r["masters"] for r in rows_}) == 4  # every step moved the weights


def test_fp8_layers_are_converted_before_sharding_and_train_as_under_ddp(out):
    pytest.importorskip("torchao.float8")
    fsdp, ddp = seen(out, "fp8-fsdp"), seen(out, "fp8-ddp")
    layers = ["transformer.encoder.layers.0.linear1", "transformer.encoder.layers.0.linear2"]
    layers += ["transformer.decoder.layers.0.linear1", "transformer.decoder.layers.0.linear2", "out"]
    # the plugin converted them (sharded=True: before the parallelize_fn), and FSDP2 gathered them in fp8
    for run in (fsdp, ddp):  # named in Fabric's wrappers (and DDP's): the module's own names after the last one
        assert sorted(name.split("module.")[-1] for name in run["gathered"]) == sorted(layers)
    assert set(fsdp["gathered"].values()) == {"Float8TrainingTensor"}
    assert set(ddp["gathered"].values()) == {"Parameter"}  # DDP: the bf16 weight, cast to fp8 in the matmul
    assert fsdp["rows"][0]["dtypes"] == ["torch.float32"]
    # fp8 casts of the fp32 shards (FSDP2) and of the bf16 weights (DDP) differ by fp8's rounding at most
    for a, b in zip(fsdp["rows"], ddp["rows"]):
        assert a["batch"] == b["batch"]
        assert a["loss"] == pytest.approx(b["loss"], rel=0.01)
    assert fsdp["rows"][-1]["loss"] < fsdp["rows"][0]["loss"]


def test_a_parallelize_fn_that_shards_nothing_gets_the_fabric_instructions(out):
    error = seen(out, "unsharded")["error"]
    assert "no FSDP2 module: the parallelize_fn of ModelParallelStrategy did not shard anything" in error
    assert "mp_policy=policy" in error
    assert "def parallelize(model, device_mesh)" in error
    assert seen(out, "unsharded", 1)["error"] == error


def test_a_mesh_that_spans_one_process_is_refused_with_the_fix(out):
    """Fabric's ``ModelParallelStrategy()`` defaults on one node: data parallel 1 x tensor parallel 2. fully_shard over
    the data-parallel mesh then reduces nothing across processes: each would silently train its own model."""
    error = seen(out, "one-process-mesh")["error"]
    assert "device mesh spans 1 of the 2 processes" in error
    assert "data_parallel_size=2, tensor_parallel_size=1" in error
    assert seen(out, "one-process-mesh", 1)["error"] == error
