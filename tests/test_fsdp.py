"""FSDP2 through Lightning's ``ModelParallelStrategy`` under ``MPTPrecision``, with 2 CPU processes (gloo).

The 2-process runs are subprocesses (tests/fsdp_worker.py, the memory example, the FSDP example); the assertions read
what each rank wrote, so gloo's occasional abort at process exit ("terminate called without an active exception")
cannot fail a test whose workers finished their work. Checks of how a model was sharded run in this process, on a
process group of one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import run_until_written
from torch import nn

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 is public from torch 2.6")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) is public from torch 2.6", allow_module_level=True)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from lightning_mpt import MPTPrecision  # noqa: E402
from lightning_mpt.core.masters import is_fully_sharded as is_sharded  # noqa: E402
from lightning_mpt.core.masters.sharded import ShardedMasters, check_sharding  # noqa: E402

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

HERE = Path(__file__).parent
ROOT = HERE.parent
WORKER = HERE / "fsdp_worker.py"


def launch(out: Path, cmd: list[str], files: list[Path], timeout: float = 300) -> None:
    out.mkdir(parents=True, exist_ok=True)
    code = run_until_written(cmd, files, out / "log.txt", timeout=timeout)
    missing = [str(f.relative_to(out)) for f in files if not f.exists()]
    if missing:
        pytest.fail(f"missing {missing} (exit {code}):\n{(out / 'log.txt').read_text()[-4000:]}")


def worker(out: Path, *scenarios: str) -> Path:
    launch(out, [sys.executable, str(WORKER), str(out), *scenarios], [out / "done-rank0", out / "done-rank1"])
    return out


@pytest.fixture(scope="module")
def training(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return worker(tmp_path_factory.mktemp("fsdp-train"), "compare", "inject", "guard", "clip", "memory")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return worker(tmp_path_factory.mktemp("fsdp-ckpt"), "checkpoint", "crossload", "init", "unsharded", "fp8")


def read(out: Path, run: str, rank: int) -> dict[str, Any]:
    return json.loads((out / run / f"rank{rank}.json").read_text())


def rows(out: Path, run: str, rank: int) -> list[dict[str, Any]]:
    return read(out, run, rank)["rows"]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------------------------------------------- training


def test_bf16_transformer_matches_lightning_bf16_mixed_and_ddp(training):
    for rank in (0, 1):
        mpt, lightning, ddp = (rows(training, f"seq-{r}", rank) for r in ("fsdp-mpt", "fsdp-lightning", "ddp-mpt"))
        assert len(mpt) == len(lightning) == len(ddp) == 12
        # the two strategies split the data the same way: same batches on each rank at every step
        assert [r["batch"] for r in mpt] == [r["batch"] for r in ddp] == [r["batch"] for r in lightning]
        assert not any(r["skipped"] for r in mpt)
        for a, b, c in zip(mpt, lightning, ddp):
            assert rel(a["loss"], b["loss"]) < 0.005  # within 0.5% of Lightning's "bf16-mixed"
            assert rel(a["loss"], c["loss"]) < 2**-8  # within bf16 rounding of DDP under MPTPrecision
        assert mpt[-1]["loss"] < 0.95 * mpt[0]["loss"]  # and it learns
    # the two ranks saw different batches (data parallel), and hold different shards
    assert rows(training, "seq-fsdp-mpt", 0)[0]["batch"] != rows(training, "seq-fsdp-mpt", 1)[0]["batch"]


def test_fp16_dynamic_scale_matches_ddp_and_lightning(training):
    for rank in (0, 1):
        mpt, ddp, lightning = (
            rows(training, f"mlp-{r}", rank) for r in ("fsdp-mpt16", "ddp-mpt16", "fsdp-lightning16")
        )
        assert [r["batch"] for r in mpt] == [r["batch"] for r in ddp]
        # the scale moved: it started too high (overflows, skipped steps), backed off, then grew
        scales = [r["scale"] for r in mpt]
        assert scales[0] == 2.0**20
        assert min(scales) < 2.0**20
        assert any(b > a for a, b in zip(scales, scales[1:]))
        assert any(r["skipped"] for r in mpt)
        assert not all(r["skipped"] for r in mpt)
        # the same steps skipped and the same scale as DDP and as Lightning's GradScaler on the same sharding: no
        # clipping by norm, so all three compute the same values in the same order (a sum of 2 half gradients, which is
        # commutative; elementwise unscaling and AdamW; the same forward kernels on the same half weights)
        assert [(r["scale"], r["skipped"]) for r in mpt] == [(r["scale"], r["skipped"]) for r in ddp]
        assert [r["loss_scale"] for r in mpt] == [r["scale"] for r in lightning]  # the scale after each step
        for a, b, c in zip(mpt, ddp, lightning):
            assert rel(a["loss"], b["loss"]) < 2**-10
            assert rel(a["loss"], c["loss"]) < 0.005


def test_gradient_accumulation_decides_once_per_optimizer_step(training):
    """2 micro-batches per step. FSDP2 reduce-scatters each micro-batch and accumulates the fp32 shards, where DDP
    accumulates the half gradients and all-reduces once: other arithmetic, so the two agree while their weights are
    equal (the first steps, all skipped), and afterwards each run's scale follows its own skips."""
    for rank in (0, 1):
        fsdp, ddp = rows(training, "mlp-fsdp-accum", rank), rows(training, "mlp-ddp-accum", rank)
        assert len(fsdp) == len(ddp) == 6  # 12 micro-batches, 6 optimizer steps
        assert [r["skipped"] for r in fsdp[:3]] == [True, True, True]  # 2^20 is too high: one skip per step ...
        assert [r["scale"] for r in fsdp[:4]] == [2.0**20, 2.0**19, 2.0**18, 2.0**17]  # ... and one back-off
        keys = ("step", "batch", "scale", "skipped", "skipped_steps", "loss")
        # the first 3 steps change no weight: step 4's loss is the initial weights' on the same batch, bitwise
        assert [[r[k] for k in keys] for r in fsdp[:4]] == [[r[k] for k in keys] for r in ddp[:4]]
        for a, b in zip(fsdp, fsdp[1:]):
            assert b["scale"] == (a["scale"] / 2 if a["skipped"] else a["scale"])  # growth_interval 4 not reached


def test_masters_are_the_sharded_fp32_parameters_and_compute_is_half(training):
    for run, half in (("seq-fsdp-mpt", "torch.bfloat16"), ("mlp-fsdp-mpt16", "torch.float16")):
        for rank in (0, 1):
            seen = read(training, run, rank)
            assert seen["param_types"] == ["DTensor"]  # the module's parameters are FSDP's shards ...
            assert all(r["master_dtypes"] == ["torch.float32"] for r in seen["rows"])  # ... and the fp32 masters
            # FSDP's compute copy of a Linear is half; a norm layer sharded on its own computes in fp32 (keep_fp32)
            assert {seen["compute"][k] for k in seen["compute"] if "Linear" in k} == {half}
            assert {seen["compute"][k] for k in seen["compute"] if "LayerNorm" in k} == {"torch.float32"}
    ddp = read(training, "seq-ddp-mpt", 0)
    assert ddp["param_types"] == ["Parameter"]
    assert ddp["compute"]["Linear"] == "torch.bfloat16"
    # a norm layer left in its block's group is all-gathered in the half format with it
    halfnorms = read(training, "mlp-fsdp-mpt16-halfnorms", 0)["compute"]
    assert halfnorms["LayerNorm"] == "torch.float16"


def test_torch_own_policy_with_fp32_gradient_reduction(training):
    """``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)`` written by the user works like the plugin's
    policy (only the reduction's rounding differs)."""
    for rank in (0, 1):
        own, plugin = rows(training, "mlp-fsdp-mpt16-torchpolicy", rank), rows(training, "mlp-fsdp-mpt16", rank)
        assert [(r["scale"], r["skipped"]) for r in own] == [(r["scale"], r["skipped"]) for r in plugin]
        assert all(rel(a["loss"], b["loss"]) < 2**-9 for a, b in zip(own, plugin))


def test_an_overflow_on_one_rank_skips_the_step_on_both(training):
    """An inf written into rank 1's gradient shard only (rank 0's shard is finite): both ranks skip that step, back
    off the same scale, count it, and name the parameter."""
    rank0, rank1 = rows(training, "inject", 0), rows(training, "inject", 1)
    assert len(rank0) == len(rank1) == 8
    for a, b in zip(rank0, rank1):
        assert (a["scale"], a["skipped"], a["skipped_steps"], a["loss_scale"]) == (
            b["scale"],
            b["skipped"],
            b["skipped_steps"],
            b["loss_scale"],
        )
    assert [r["skipped"] for r in rank0] == [False, False, False, True, False, False, False, False]
    assert [r["last_step_skipped"] for r in rank0] == [r["skipped"] for r in rank0]
    assert [r["history"] for r in rank0] == list(range(1, 9))  # plugin.history: one record per optimizer step
    skipped = rank0[3]
    assert skipped["culprits"] == rank1[3]["culprits"] == ["model.0.weight"]  # the original parameter name
    assert rank0[4]["scale"] == skipped["scale"] / 2
    assert rank0[-1]["skipped_steps"] == 1
    for rank_rows in (rank0, rank1):  # the skipped step changed neither the masters nor the optimizer state
        assert rank_rows[3]["masters"] == rank_rows[2]["masters"]
        assert rank_rows[3]["state"] == rank_rows[2]["state"]
        assert rank_rows[4]["masters"] != rank_rows[3]["masters"]


def test_the_guard_stops_both_ranks_and_names_the_parameter(training):
    for rank in (0, 1):
        guard = json.loads((training / "guard-error" / f"rank{rank}.json").read_text())
        assert guard["steps"] == 4  # steps 0, 1 taken; 2, 3 skipped: stopped there
        assert "2 optimizer steps in a row were skipped" in guard["error"]
        assert "parameters with non-finite gradients: model.3.weight" in guard["error"]


def test_clipping_acts_on_the_unscaled_gradients_over_all_shards(training):
    fsdp, ddp = read(training, "clip-fsdp-norm", 0)["norms"], read(training, "clip-ddp-norm", 0)["norms"]
    assert fsdp == read(training, "clip-fsdp-norm", 1)["norms"]  # one global norm, the same on both ranks
    for (before, after, _), (ddp_before, ddp_after, _) in zip(fsdp, ddp):
        assert 0.5 < before < 10  # the true gradient norm, not one multiplied by the fp16 loss scale (2^16)
        assert rel(before, ddp_before) < 1e-3  # the total norm over all shards is DDP's norm of the whole gradient
        assert after == pytest.approx(0.05, rel=1e-4)
        assert ddp_after == pytest.approx(0.05, rel=1e-4)
    for rank in (0, 1):
        by_value = read(training, "clip-fsdp-value", rank)["norms"]
        assert all(max_abs == pytest.approx(0.002) and before > after for before, after, max_abs in by_value)


# ---------------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_resume_is_bitwise_identical_to_the_uninterrupted_run(checkpoints, kind):
    for rank in (0, 1):
        straight, resumed = rows(checkpoints, f"straight-{kind}", rank), rows(checkpoints, f"resumed-{kind}", rank)
        assert len(straight) == 12
        assert [r["step"] for r in resumed] == list(range(7, 13))
        assert [r["skipped"] for r in straight[:6]] == [False, True, False, False, False, True]  # saved after a skip
        assert len({r["scale"] for r in straight}) >= 3  # the scale moved across the save
        for a, b in zip(straight[6:], resumed):  # the same configuration: the same order
            assert (a["masters"], a["state"], a["scale"], a["skipped"], a["skipped_steps"], a["loss"]) == (
                b["masters"],
                b["state"],
                b["scale"],
                b["skipped"],
                b["skipped_steps"],
                b["loss"],
            )


def test_checkpoints_hold_fp32_masters_and_the_plugin_state(checkpoints):
    full = json.loads((checkpoints / "full-file" / "rank0.json").read_text())
    assert {dtype for dtype, _ in full["state_dict"].values()} == {"torch.float32"}
    assert full["state_dict"]["model.0.weight"][1] == [32, 16]  # full (gathered) tensors, original names
    assert full["plugin"]["skipped_steps"] == 2
    assert full["plugin"]["steps"] == 6
    assert full["scaler"]["hysteresis_tracker"] == 1  # the skip right before the save is pending in the hysteresis
    sharded = json.loads((checkpoints / "sharded-files" / "rank0.json").read_text())
    # Lightning's distributed checkpoint: one file of shards per rank, the rest (the plugin's state) in meta.pt
    assert sharded["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert "MPTPrecision" in sharded["meta"]
    assert "state_dict" not in sharded["meta"]
    assert sharded["plugin_steps"] == 6


def test_a_full_checkpoint_loads_into_a_ddp_model_and_back(checkpoints):
    """Lightning's test_load_full_state_checkpoint_into_regular_model and
    test_load_standard_checkpoint_into_distributed_model (GPU-only there), under MPTPrecision on CPU."""
    into_ddp = json.loads((checkpoints / "cross-full-into-ddp-result" / "rank0.json").read_text())
    assert into_ddp == {"keys_equal": True, "equal": True, "dtypes": ["torch.float32"]}
    back = json.loads((checkpoints / "cross-ddp-into-fsdp-result" / "rank0.json").read_text())
    assert back == {"equal": True, "keys_equal": True}


def test_a_model_created_on_the_meta_device_is_sharded_and_trains(checkpoints):
    """Lightning's test_module_init_context and test_strategy_state_dict (GPU-only there), under MPTPrecision."""
    for rank in (0, 1):
        result = json.loads((checkpoints / "meta-init-result" / f"rank{rank}.json").read_text())
        assert result == {"was_meta": True, "keys_equal": True, "types": ["DTensor torch.float32"]}
        trained = rows(checkpoints, "meta-init", rank)
        assert len(trained) == 3
        assert len({r["masters"] for r in trained}) == 3


def test_a_configure_model_that_shards_nothing_is_refused(checkpoints):
    error = json.loads((checkpoints / "unsharded-error" / "rank0.json").read_text())["error"]
    assert error == json.loads((checkpoints / "unsharded-error" / "rank1.json").read_text())["error"]
    assert "configure_model did not shard anything" in error
    assert "fully_shard(self.model, mesh=mesh, mp_policy=policy)" in error  # says how
    assert "supports one device, the DDP family and ModelParallelStrategy with FSDP2" in error


# ---------------------------------------------------------------------------------------------------- examples


def test_memory_breakdown_fsdp_per_rank(tmp_path):
    """Item 4 and 5: bytes per parameter per rank at the optimizer step, and bytes through the collectives."""
    out = tmp_path / "memory.json"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "memory_breakdown.py"),
        "--strategy",
        "fsdp",
        "--fast",
        "--logdir",
        str(tmp_path / "runs"),
        "--json",
        str(out),
    ]
    launch(tmp_path, cmd, [out, Path(f"{out}.rank1")])
    log = (tmp_path / "log.txt").read_text()
    assert "| mpt-fp16 | 2.00 | 2.00 | 4.00 | 8.00 | 0.00 |" in log  # the table, on rank 0
    for path in (out, Path(f"{out}.rank1")):
        results = json.loads(path.read_text())
        fp32 = results["32-true"]
        for name in ("mpt-fp16", "mpt-bf16", "bf16-mixed", "32-true"):
            r = results[name]
            n = r["params"]
            # fp32 masters (the shards), fp32 gradient shards and AdamW's two moments, each divided by the world size
            assert r["weights"] == pytest.approx(4 * n / 2, abs=64)
            assert r["masters"] == 0
            assert r["grads"] == pytest.approx(4 * n / 2, abs=64)
            assert r["master_grads"] == 0
            assert r["optimizer_state"] == pytest.approx(8 * n / 2, abs=64 * 8)
            assert r["gathered_at_step"] == 0  # the half compute copy is gone at the optimizer step
        for name in ("mpt-fp16", "mpt-bf16"):
            r = results[name]
            assert 0 < r["gathered_peak"] <= 2 * r["params"]  # it existed, in the half format, during the forward
            # half the bytes of an fp32 FSDP2 run through the all-gathers and the reduce-scatters
            assert r["all_gather"] * 2 == fp32["all_gather"]
            assert r["reduce_scatter"] * 2 == fp32["reduce_scatter"]
            assert r["reduce_scatter"] == 2 * r["params"]  # every rank sends its whole half gradient
            assert r["all_reduce"] <= 64  # the step decision: a couple of flags


# benchmarks/memory_fsdp.py --fast, run by the training launch ("memory"): per-rank bytes per parameter
MEMORY_REFUSED = "mpt-bf16 master_weights=False"


def shard_slack() -> tuple[int, int]:
    """(elements of one dim-0 row summed over the benchmark model's parameter tensors, how many tensors): FSDP2 cuts
    each parameter by rows, so on 2 ranks a rank's share of a parameter is within one row of numel/2."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory

    params = list(memory.LM(memory.FAST, "AdamW", steps=2).parameters())  # tied weights once, as FSDP2 sees them
    return sum(p[0].numel() if p.ndim > 1 else 1 for p in params), len(params)


def assert_masters_and_state_sharded(masters: int, state: int, n: int, world: int) -> None:
    """One rank's fp32 masters (4 bytes per parameter) and AdamW state (two fp32 moments, 8, and a 4-byte step per
    tensor): 12/N bytes per parameter, within a row per parameter of FSDP2's cut."""
    rows, tensors = shard_slack()
    assert masters == pytest.approx(4 * n / world, abs=4 * rows)
    assert state - 4 * tensors == pytest.approx(8 * n / world, abs=8 * rows)
    assert (masters + state) / n == pytest.approx(12 / world, abs=0.05)


def test_memory_fsdp_masters_and_adamw_state_are_12_over_n_per_rank(training):
    measured = json.loads((training / "memory.json").read_text())
    ranks = [r["mpt-bf16"] for r in measured["ranks"]]
    assert len(ranks) == measured["devices"] == 2
    n = ranks[0]["params"]
    for r in ranks:
        at = r["at_step"]
        assert at["masters"] == 0  # the fp32 shards are the masters: no second fp32 copy
        assert_masters_and_state_sharded(at["sharded_weights"] + at["masters"], at["optimizer_state"], n, 2)
        assert at["sharded_grads"] == pytest.approx(4 * n / 2, abs=4 * shard_slack()[0])
        assert at["unsharded_weights"] == at["unsharded_grads"] == 0  # the half compute copy is freed by the step
    # the shards partition the model: over the ranks, one fp32 value, gradient and pair of moments per parameter
    assert sum(r["at_step"]["sharded_weights"] for r in ranks) == 4 * n
    assert sum(r["at_step"]["sharded_grads"] for r in ranks) == 4 * n
    assert sum(r["at_step"]["optimizer_state"] for r in ranks) == 8 * n + 4 * shard_slack()[1] * 2


def test_memory_fsdp_check_fails_on_replicated_masters():
    """The same check on a real run whose masters are whole on the process (one device, as on every DDP rank)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory

    torch.set_num_threads(1)
    mode = next(m for m in memory.MODES if m.name == "mpt-bf16 4-byte masters, whole step")
    whole = memory.measure(mode, memory.FAST, steps=2, accelerator="cpu", compile_steps=False)
    with pytest.raises(AssertionError):
        assert_masters_and_state_sharded(whole["masters"], whole["optimizer_state"], whole["params"], 2)
    assert_masters_and_state_sharded(whole["masters"], whole["optimizer_state"], whole["params"], 1)


def test_memory_fsdp_peak_holds_a_half_copy_as_lightning_bf16_mixed(training):
    measured = json.loads((training / "memory.json").read_text())
    for r in measured["ranks"]:
        mpt, ref = r["mpt-bf16"], r["bf16-mixed"]
        assert mpt["at_step"] == ref["at_step"]  # the same bytes of each kind as Lightning's "bf16-mixed" ...
        assert mpt["peak"] == ref["peak"]  # ... at the step and at the peak
        peak = mpt["peak"]
        # at the peak a block and the root are all-gathered in bf16: at most 2 bytes per parameter of the model
        assert 0 < peak["unsharded_weights"] <= 2 * mpt["params"]
        assert sum(peak.values()) >= sum(mpt["at_step"].values())
        assert mpt["step_peak"] >= mpt["step_start"] > 0  # the optimizer step's allocator peak
    log = (training / "log.txt").read_text()
    assert "| mpt-bf16 | 0 | 2.00 | 0.00 | 0.00 | 2.00 | 0.00 | 4.00 | 8.00 |" in log  # the printed table
    assert "master_weights=False" in measured["refused"][MEMORY_REFUSED]
    assert all(MEMORY_REFUSED not in r for r in measured["ranks"])
    assert f"| {MEMORY_REFUSED} | all | refused: " in log


def test_fsdp_transformer_example(tmp_path):
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "fsdp_transformer.py"),
        "--fast",
        "--logdir",
        str(tmp_path / "runs"),
        "--summary",
        str(out),
    ]
    launch(tmp_path, cmd, [out])
    summary = json.loads(out.read_text())
    assert summary["steps"] == 30
    assert summary["last_loss"] < 0.8 * summary["first_loss"]
    assert summary["masters"] == "DTensor torch.float32"
    assert summary["strategy"] == "ModelParallelStrategy"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(summary["logdir"], size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train_loss", "mpt/loss_scale", "mpt/skipped_steps", "mpt/overflow"} <= set(tags)
    assert acc.Scalars("mpt/loss_scale")[0].value == summary["first_loss_scale"]


# ---------------------------------------------------------------------------------------------------- fp8 (torchao)


def test_fp8_layers_train_under_fsdp2_with_fp8_all_gather_as_under_ddp(checkpoints):
    pytest.importorskip("torchao.float8")
    from tb_events import all_scalars

    for rank in (0, 1):
        fsdp, ddp = rows(checkpoints, "fp8-fsdp", rank), rows(checkpoints, "fp8-ddp", rank)
        assert len(fsdp) == len(ddp) == 8
        assert [r["batch"] for r in fsdp] == [r["batch"] for r in ddp]
        # FSDP2 casts each fp32 shard to fp8 for its all-gather, DDP the bf16 weight: the casts differ where the
        # master and its bf16 rounding scale to different fp8 values, so the losses agree to fp8's precision
        for a, b in zip(fsdp, ddp):
            assert rel(a["loss"], b["loss"]) < 0.01
        assert fsdp[-1]["loss"] < 0.95 * fsdp[0]["loss"]
        seen = read(checkpoints, "fp8-fsdp", rank)
        # the layers FSDP2 gathers for the forward are torchao's fp8 tensors: the all-gather moved fp8 bytes
        assert seen["weight_types"]["Float8Linear"] == "Float8TrainingTensor"
        assert seen["weight_types"]["Linear"] == "Parameter"  # the head, all-gathered in bf16
        assert seen["weight_types"]["FSDPLayerNorm"] == "Parameter"
        assert fsdp[0]["master_dtypes"] == ["torch.float32"]  # FSDP2's fp32 shards are the masters
    scalars = all_scalars(checkpoints / "tb-fp8" / "run")
    layers = {k.split("/")[3] for k in scalars if k.startswith("mpt/fp8/amax/")}
    # every eligible Linear but the head, which fp8_filter keeps in bf16 by the name Float8Monitor logs ("model.out")
    assert layers == {f"model.transformer.{part}.layers.0.linear{i}" for part in ("encoder", "decoder") for i in (1, 2)}
    # the weight's statistics come from the fp32 shards, reduced over both ranks: the largest |master| of the whole
    # weight is what torchao's all-reduced amax made the scale of (448 / amax, in float32)
    for layer in layers:
        amax = scalars[f"mpt/fp8/amax/{layer}/weight"]
        scale = scalars[f"mpt/fp8/scale/{layer}/weight"]
        assert len(amax) == 8
        for a, sc in zip(amax, scale):
            assert sc == pytest.approx(float(torch.tensor(448.0 / a, dtype=torch.float32)), rel=1e-6)
    assert max(scalars["mpt/fp8/saturated_fraction"]) == 0.0


def test_fp8_under_fsdp2_resumes_bitwise(checkpoints):
    pytest.importorskip("torchao.float8")
    for rank in (0, 1):
        straight, resumed = rows(checkpoints, "fp8-fsdp", rank), rows(checkpoints, "fp8-fsdp-resumed", rank)
        assert len(resumed) == 4
        keys = ("step", "loss", "masters", "state")
        assert [[r[k] for k in keys] for r in straight[4:]] == [[r[k] for k in keys] for r in resumed]


def test_fp8_layers_sharded_before_conversion_are_refused_with_the_fix(one_process):
    pytest.importorskip("torchao.float8")
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    plugin = MPTPrecision("bf16", fp8=True, fp8_emulate=True)
    fully_shard(model, mp_policy=plugin.mp_policy)
    fix = r"the Linear layers 0, 2 were sharded by fully_shard before .*trainer.precision_plugin.convert_fp8\(self, "
    with pytest.raises(ValueError, match=fix):
        plugin.convert_module(model)


@pytest.mark.parametrize(("recipe", "gathered"), [("tensorwise", True), ("rowwise", False)])
def test_fp8_converted_before_fully_shard(one_process, recipe, gathered):
    """Tensorwise weights all-gather in fp8 (torchao's ``enable_fsdp_float8_all_gather``); rowwise ones cannot."""
    pytest.importorskip("torchao.float8")
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    plugin = MPTPrecision("bf16", fp8=recipe, fp8_emulate=True)
    model = plugin.convert_fp8(model, fsdp=True)
    assert [type(m).__name__ for m in model] == ["Float8Linear", "LayerNorm", "Float8Linear"]
    assert model[0].config.enable_fsdp_float8_all_gather is gathered
    fully_shard(model, mp_policy=plugin.mp_policy)
    plugin.convert_module(model)  # checked, accepted
    assert plugin.master_of(model[0].weight) is model[0].weight
    kinds = []
    model[0].register_forward_pre_hook(lambda m, args: kinds.append(type(m.weight).__name__))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 16)).float().sum().backward()
    assert kinds == ["Float8TrainingTensor" if gathered else "Parameter"]
    assert model[0].weight.grad.dtype == torch.float32
    plugin.teardown()


def test_fp8_converted_for_fsdp2_is_refused_without_it():
    pytest.importorskip("torchao.float8")
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="Float8LinearConfig .enable_fsdp_float8_all_gather=True.* not sharded"):
        MPTPrecision("bf16", fp8=config).convert_module(nn.Sequential(nn.Linear(16, 32)))
    # converted for FSDP2 in configure_model, then trained on one device: the plugin says how to convert instead
    plugin = MPTPrecision("bf16", fp8=True, fp8_emulate=True)
    model = plugin.convert_fp8(nn.Sequential(nn.Linear(16, 32)), fsdp=True)
    with pytest.raises(ValueError, match=r"the layers 0 .enable_fsdp_float8_all_gather=True. .* convert_fp8\(module\)"):
        plugin.convert_module(model)


# ---------------------------------------------------------------------------------------------------- in one process


@pytest.fixture
def one_process():
    """A process group of one (in memory), for checks that need ``fully_shard`` but no second process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        (lambda m: None, "no FSDP2 module: configure_model did not shard anything"),
        (lambda m: fully_shard(m.block, mp_policy=BF16), r"head.weight, head.bias are not sharded by fully_shard"),
        (lambda m: fully_shard(m), r"all-gathers block.0.weight, block.0.bias, head.weight, head.bias in fp32"),
        (lambda m: fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16)), "contradicts the plugin"),
        (lambda m: fully_shard(m, mp_policy=dataclasses.replace(BF16, reduce_dtype=torch.float16)), "contradicts"),
        (lambda m: fully_shard(m.bfloat16(), mp_policy=BF16), r"are not fp32. FSDP2 shards the parameters as they are"),
    ],
    ids=["nothing", "root-not-sharded", "fp32-policy", "other-half-format", "fp16-reduction", "half-parameters"],
)
def test_sharding_the_plugin_cannot_use_is_refused_with_the_fix(one_process, shard, message):
    model = Net()
    shard(model)
    with pytest.raises(ValueError, match=message):
        check_sharding(model, torch.bfloat16)
    if is_sharded(model):  # the plugin checks a sharded model when it converts it
        with pytest.raises(ValueError, match=message):
            MPTPrecision("bf16").convert_module(model)


def test_accepted_shardings(one_process):
    plugin = MPTPrecision("bf16")
    # the plugin's policy, a norm layer sharded on its own in fp32 first (keep_fp32), fp32 gradient reduction
    model = Net()
    fully_shard(model.block[1])
    fully_shard(model, mp_policy=dataclasses.replace(plugin.mp_policy, reduce_dtype=torch.float32))
    assert check_sharding(model, torch.bfloat16) == []
    plugin.convert_module(model)
    assert [(n, p.dtype) for n, p, m in plugin.named_masters() if p is m] == [
        (n, torch.float32) for n, _ in model.named_parameters()
    ]
    assert plugin.master_of(model.head.weight) is model.head.weight  # no second fp32 copy
    plugin.teardown()
    # a norm layer inside a half group: accepted, and reported
    model = Net()
    fully_shard(model, mp_policy=plugin.mp_policy)
    assert check_sharding(model, torch.bfloat16) == ["block.1"]
    with pytest.raises(ValueError, match="master_weights=False"):
        MPTPrecision("bf16", master_weights=False).convert_module(model)


def test_a_norm_layer_in_a_half_group_is_reported_once_per_process(one_process, caplog, monkeypatch):
    """An example or a sweep that fits the same model twice (two precisions) is told once, not at every fit."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    # a strategy set up earlier in this process (another test's) may have left its rank on rank_zero_only
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    import lightning_utilities.core.rank_zero as rank_zero_module

    # rank_zero_info logs to the logger that the last Lightning package imported put on lightning_utilities (Fabric's
    # or the Trainer's): at INFO, whatever level a benchmark test left on its parents; caplog's handler catches it
    logger = rank_zero_module.log
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        for fmt in ("bf16", "fp16"):
            model = nn.Sequential(collections.OrderedDict(reported_once=Net()))  # names no other test's note has
            plugin = MPTPrecision(fmt)
            fully_shard(model, mp_policy=plugin.mp_policy)
            plugin.convert_module(model)
            plugin.teardown()
    finally:
        logger.setLevel(level)
    said = [
        r.getMessage()
        for r in caplog.records
        if "all-gathers the parameters of reported_once.block.1 " in r.getMessage()
    ]
    assert len(said) == 1, caplog.text


def test_sharded_masters_skip_a_non_finite_step_and_name_the_parameter(one_process):
    from lightning_mpt.core.engine import MixedPrecisionEngine
    from lightning_mpt.core.scaler import DynamicLossScaler

    model = Net()
    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16)
    fully_shard(model.block, mp_policy=fp16)
    fully_shard(model, mp_policy=fp16)
    engine = MixedPrecisionEngine(ShardedMasters(torch.float16), DynamicLossScaler(init_scale=8.0))
    engine.convert(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(3, 4)).float().sum()
    engine.scale_loss(loss).backward()
    assert model.head.weight.grad.dtype == torch.float32  # FSDP keeps the fp32 gradient shard: the master gradient
    scaled = model.head.weight.grad.full_tensor().clone()
    model.block[0].bias.grad.to_local()[1] = float("nan")
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    pending = engine.decide(optimizer)
    assert torch.equal(model.head.weight.grad.full_tensor(), scaled / 8)  # unscaled in place
    engine.step(optimizer, pending)
    record = engine.log.history[-1]
    assert record.skipped
    assert record.nonfinite_params == ["block.0.bias"]
    assert all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters()))
    assert optimizer.state == {}
    assert engine.loss_scale == 4.0


def test_fsdp1_is_refused_naming_what_is_supported():
    import lightning as L
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_mpt.precision import check_strategy

    with pytest.raises(ValueError, match=r"FSDPStrategy strategy. Supported: .* FSDP2: ModelParallelStrategy"):
        check_strategy(FSDPStrategy())
    with pytest.raises(ValueError, match="DeepSpeed and FSDP1 .'fsdp'. bring their own mixed precision"):
        check_strategy(FSDPStrategy())
    # Lightning itself refuses a non-FSDPPrecision plugin with FSDP1 when the Trainer is built (on a GPU machine)
    if torch.cuda.is_available():
        with pytest.raises(TypeError, match="FSDPPrecision"):
            L.Trainer(strategy="fsdp", accelerator="cuda", devices=1, plugins=[MPTPrecision("bf16")])
