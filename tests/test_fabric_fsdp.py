"""``lightning_mpt.fabric.MPTPrecision(..., sharded=True)`` under FSDP2 (Fabric's ``ModelParallelStrategy``), with 2 CPU
processes (gloo).

One launch of tests/fabric_fsdp_worker.py runs every loop; the tests read what each rank wrote. The references are
independent of the plugin's FSDP2 path: Fabric's own "bf16-mixed" with the same sharding and policy, and the same
loop under DDP with the plugin's copy masters (the same initial weights and batches). With 2 processes both reduce a
half gradient the same way (each rank's halved, then summed), so the DDP comparison is bitwise.
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

from lightning_mpt import tags

pytestmark = [
    pytest.mark.ddp,
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "fully_shard"), reason="FSDP2 is public from torch 2.6"),
]

WORKER = Path(__file__).with_name("fabric_fsdp_worker.py")
STEPS, INJECT_STEP = 12, 5


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
    assert [r["loss"] for r in fsdp] == [r["loss"] for r in ddp]
    assert [r["masters"] for r in fsdp] == [r["masters"] for r in ddp]
    assert fsdp[-1]["loss"] < fsdp[0]["loss"]
    assert not any(r["skipped"] for r in fsdp)


@pytest.mark.parametrize("sharding", ["fsdp", "hsdp"])
def test_fp16_scales_skips_clipping_and_masters_equal_ddp(out, sharding):
    """``hsdp``: a 2-D mesh, replicated over both processes and sharded over one (HSDP's all-reduce path)."""
    fsdp, ddp = rows(out, f"fp16-{sharding}"), rows(out, "fp16-ddp")
    for key in ("scale", "skipped", "loss", "masters", "state"):
        assert [r[key] for r in fsdp] == [r[key] for r in ddp], key
    natural = [r["step"] for r in fsdp if r["skipped"] and r["step"] != INJECT_STEP]
    assert natural, "the scale starts too high: the first steps overflow and back off"
    assert [r["scale"] for r in fsdp[: len(natural) + 1]] == [2.0**20 / 2**i for i in range(len(natural) + 1)]
    for a, b in zip(fsdp, ddp):  # the clipping norm is the global one, over both shards: DDP's
        if a["skipped"]:
            assert a["norm"] == b["norm"] == 0.0  # a skipped step's gradients are dropped before clipping
        else:
            assert a["norm"] == pytest.approx(b["norm"], rel=1e-6)
            assert a["norm"] > 0.05  # so the clipping (max_norm 0.05) acted, and the masters still agree
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
    for key in ("scale", "skipped", "masters", "state"):
        assert [r[key] for r in ranks[0]] == [r[key] for r in ranks[1]], key
    assert seen(out, f"fp16-{sharding}", 0)["loss_scale"] == seen(out, f"fp16-{sharding}", 1)["loss_scale"]


def test_gradient_accumulation_and_clipping_by_value_equal_ddp(out):
    fsdp, ddp = rows(out, "accumulate-fsdp"), rows(out, "accumulate-ddp")
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
    for key in ("loss", "scale", "skipped", "masters", "state"):
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
