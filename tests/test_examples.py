"""Each example runs in its fast mode through a real Trainer and shows what its docstring promises."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tb_events import all_scalars

from lightning_mpt._compat import GRAD_DTYPE

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bert_finetune  # noqa: E402
import grad_accumulation  # noqa: E402
import memory_breakdown  # noqa: E402
import precision_story  # noqa: E402
import quickstart  # noqa: E402
import resnet_synthetic  # noqa: E402
import run_all  # noqa: E402
import step_time  # noqa: E402
import vit_static_vs_dynamic  # noqa: E402

from lightning_mpt import MPTPrecision  # noqa: E402

pytestmark = pytest.mark.slow


def test_quickstart(tmp_path: Path) -> None:
    out = quickstart.main(["--fast", "--logdir", str(tmp_path)])
    assert out["steps"] == 60
    assert out["skipped_steps"] == 0
    assert out["val_acc"] > 0.5  # 8 classes: chance is 0.125


def test_precision_story_overflows_recovers_underflows_and_advises(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = precision_story.main(["--fast", "--logdir", str(tmp_path), "--no-plots"])
    dynamic, unscaled = out["runs"]["dynamic"], out["runs"]["unscaled"]
    # the scale starts above what the gradients allow and backs off, then overflows again later (a real overflow:
    # nothing is injected), skips that step and grows again
    assert dynamic["skipped"][0] == 0
    assert len([s for s in dynamic["skipped"] if s < 5]) >= 3
    later = [s for s in dynamic["skipped"] if s > 10]
    assert later
    scales = dynamic["scales"]
    assert scales[later[0] + 1] == scales[later[0]] / 2
    assert max(scales[later[0] + 1 :]) > scales[later[0] + 1]  # recovered: it grew after the back-off
    assert unscaled["skipped"] == []
    assert unscaled["loss"] < 0.7 * math.log(8)  # it learns (the logged loss is unweighted; chance: ln 8)
    printed = capsys.readouterr().out
    advice = printed[printed.index("advice (what to change, and why):") :]
    assert "[skips_at_start]" in advice.split("unscaled")[0]
    assert "Gradients flush to zero below the scale's reach: at scale 1" in advice.split("unscaled")[1]
    # the demo run again in the same folder reports the same (it used to read the first run's events too)
    precision_story.main(["--fast", "--logdir", str(tmp_path), "--no-plots"])
    assert capsys.readouterr().out == printed


def test_resnet_learns_with_fp32_batchnorm(tmp_path: Path) -> None:
    out = resnet_synthetic.main(["--fast", "--logdir", str(tmp_path)])
    assert out["steps"] == 30
    assert out["last_loss"] < 0.7 * out["first_loss"]
    assert out["val_acc"] > 0.25 + 0.25  # --fast trains 4 classes: chance is 0.25
    logged = all_scalars(out["logdir"])
    assert {"train_loss", "train_acc", "val_acc", "mpt/loss_scale", "mpt/skipped_steps"} <= logged.keys()
    assert {"mpt/grad_zero_fraction", "mpt/grad_underflow_fraction", "mpt/update_underflow_fraction"} <= logged.keys()
    assert logged["mpt/loss_scale"][0] == 2.0**16


def test_bert_finetune_beats_chance(tmp_path: Path) -> None:
    out = bert_finetune.main(["--fast", "--logdir", str(tmp_path)])
    assert out["steps"] == 100
    assert out["skipped_steps"] == 0
    assert out["last_loss"] < 0.9 * out["first_loss"]
    assert out["val_acc"] > 0.65  # two balanced classes: chance is 0.5
    logged = all_scalars(out["logdir"])
    assert {"train_acc", "val_acc", "mpt/loss_scale"} <= logged.keys()
    lr = logged["lr-AdamW/pg1"]  # the schedule drives the optimizer that steps the masters
    assert lr[-1] < 0.2 * lr[0]


def test_vit_static_scale_stalls_where_dynamic_trains(tmp_path: Path) -> None:
    runs = vit_static_vs_dynamic.main(["--fast", "--logdir", str(tmp_path)])
    static, dynamic = runs["static_1024"], runs["dynamic"]
    steps = static["steps"]
    # the static scale overflows on (nearly) every step and never moves
    assert static["skipped_steps"] >= 0.9 * steps
    assert static["scale_changes"] == [(0, 1024.0)]
    # the dynamic scaler backs off from 2^16 within its first steps, below 1024, then every step is applied
    assert dynamic["scale_changes"][0] == (0, 2.0**16)
    assert dynamic["final_loss_scale"] < 1024
    assert dynamic["skipped_steps"] <= 10
    assert dynamic["last_skipped"] < 10
    assert dynamic["last_loss"] < 0.5 * dynamic["first_loss"]
    assert dynamic["last_loss"] < 0.5 * static["last_loss"]
    # the TensorBoard logs tell the same story, one run next to the other
    assert Path(static["logdir"]).parent == Path(dynamic["logdir"]).parent
    static_log, dynamic_log = all_scalars(static["logdir"]), all_scalars(dynamic["logdir"])
    assert sum(static_log["mpt/overflow"]) == static["skipped_steps"]
    assert static_log["mpt/skipped_steps"][-1] == static["skipped_steps"]
    assert dynamic_log["mpt/loss_scale"][:3] == [2.0**16, 2.0**15, 2.0**14]
    # the inf comes from the parameters shared by every example: their gradient is a sum over the batch
    assert {name for name, _ in static["overflowing_params"]} & {"cls_token", "positions"}


@pytest.fixture(scope="module")
def memory(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, int]]:
    return memory_breakdown.main(["--fast", "--logdir", str(tmp_path_factory.mktemp("runs"))])


def test_memory_mpt_keeps_half_weights_and_fp32_masters(memory: dict[str, dict[str, int]]) -> None:
    for name in ("mpt-fp16", "mpt-bf16"):
        r = memory[name]
        n, norm = r["params"], r["norm_params"]
        assert 0 < norm < n
        assert r["weights"] == 2 * (n - norm) + 4 * norm  # norm layers stay fp32
        assert 8 * n <= r["optimizer_state"] <= 8 * n + 64 * 8  # AdamW's two fp32 moments (+ step counters)
        assert r["weight_copies"] == 0  # the weights are half already: autocast casts nothing
    fp16, bf16 = memory["mpt-fp16"], memory["mpt-bf16"]
    half = fp16["params"] - fp16["norm_params"]
    # fp16 (the whole step): one fp32 master and one fp32 gradient per half parameter
    assert fp16["masters"] == fp16["master_grads"] == 4 * half
    if GRAD_DTYPE:  # the half gradients are freed at the step: the half parameters carry their fp32 ones
        assert fp16["grads"] == 4 * fp16["norm_params"]
        assert (
            sum(fp16[k] for k in ("weights", "masters", "grads", "master_grads", "optimizer_state"))
            <= 18 * fp16["params"] + 512
        )
    # bf16 (the default: remainders, a chunked step): a 16-bit remainder per master, the half gradients kept until
    # their chunk's step, no fp32 gradient held at the hook
    assert bf16["masters"] == 2 * half
    assert bf16["master_grads"] == 0
    assert bf16["grads"] == bf16["weights"]


def test_memory_lightning_precisions(memory: dict[str, dict[str, int]]) -> None:
    n = memory["32-true"]["params"]
    for name, weight_bytes in (("32-true", 4), ("16-mixed", 4), ("bf16-mixed", 4), ("16-true", 2), ("bf16-true", 2)):
        r = memory[name]
        assert r["weights"] == r["grads"] == weight_bytes * n
        assert r["masters"] == r["master_grads"] == 0
        assert 2 * weight_bytes * n <= r["optimizer_state"] <= 2 * weight_bytes * n + 64 * 8
    assert memory["32-true"]["weight_copies"] == 0
    # autocast saves half copies of the fp32 weights in every step's graph
    assert memory["16-mixed"]["weight_copies"] > 0.25 * memory["16-true"]["weights"]
    # every 16-bit precision saves far fewer activation bytes than fp32
    for name in ("16-mixed", "bf16-mixed", "16-true", "bf16-true", "mpt-fp16", "mpt-bf16"):
        assert memory[name]["activations"] < 0.8 * memory["32-true"]["activations"]
    assert memory["mpt-fp16"]["activations"] <= memory["16-mixed"]["activations"]


def test_benchmark_tables(tmp_path: Path) -> None:
    """``make bench``'s whole path (interleaved rounds, ratios with their spread, the bandwidth floor, the targets,
    the memory table) on the tiny transformer with every precision, as a GPU run would have them: it runs and prints
    its tables. Timings are not checked."""
    out = run_all.main([
        "--size",
        "tiny",
        "--workloads",
        "transformer",
        "--precisions",
        "all",
        "--rounds",
        "2",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--no-profile",
        "--bandwidth-mib",
        "4",
        "--quiet",
        "--out",
        str(tmp_path / "bench.md"),
    ])
    text = out["markdown"]
    assert (tmp_path / "bench.md").read_text().startswith(text)
    assert "cores" in text
    assert "torch" in text
    assert "--precisions all" in text
    spread = r"-?\d+\.\d+ \[-?\d+\.\d+–-?\d+\.\d+\]"  # median [min–max]
    for name in run_all.step_time.ALL_PRECISIONS:
        assert re.search(rf"^\| {name} \| {spread} \| \d+ \|$", text, re.M), name
    for ratio in ("mpt-bf16 / bf16-mixed", "mpt-bf16 / bf16-true", "mpt-fp16 / 16-mixed", "mpt-fp16 / 16-true"):
        assert re.search(rf"^\| {ratio} \| {spread} \|$", text, re.M), ratio
    floor = rf"\| [\d.]+ MB \| [\d.]+ ms \| {spread} \| [\d.]+ ms \|"  # bytes, floor, overhead / floor, cache floor
    assert re.search(rf"^\| mpt-bf16 - bf16-true \| {spread} {floor}", text, re.M)
    assert re.search(rf"^\| mpt-bf16 - mpt-bf16-nomaster \(the master weights\) \| {spread} \| [\d.]+ MB", text, re.M)
    assert re.search(r"^\| transformer: mpt-bf16 / bf16-true <= 1.0 \| .* \| (met|NOT met)", text, re.M)
    assert "2x the bandwidth floor" in text
    # the floor's byte model: 30 B per half parameter and 8 B per fp32 one (bf16, whose masters wake and sleep), 26
    # and 8 with fp16's scaler
    params = out["params"]["transformer"]
    floors = out["floors"]["transformer"]
    mpt = out["results"]["transformer"]["mpt-bf16"]
    half, fp32 = params - mpt["norm_params"], mpt["norm_params"]
    assert floors["mpt-bf16"]["bytes"] == 30 * half + 8 * fp32
    assert floors["mpt-fp16"]["bytes"] == 26 * half + 8 * fp32
    # the memory table: half weights with 16-bit remainders (norm layers stay fp32), and every precision has a row
    assert mpt["masters"] == 2 * half
    assert mpt["weights"] == 2 * half + 4 * fp32
    assert len([line for line in text.splitlines() if line.startswith("| transformer |")]) == 11
    # the other memory modes: 4-byte masters, stepped in chunks or whole
    assert out["results"]["transformer"]["mpt-bf16-chunked"]["masters"] == 4 * half
    assert out["results"]["transformer"]["mpt-bf16-copies"]["masters"] == 4 * half
    nomaster = out["results"]["transformer"]["mpt-bf16-nomaster"]  # MPTPrecision("bf16", master_weights=False)
    assert nomaster["masters"] == 0
    assert nomaster["weights"] == mpt["weights"]
    assert all(len(runs) == 2 for runs in out["runs"]["transformer"].values())


def test_step_time_profile() -> None:
    """``step_time.py --profile`` prints the top ops and the step's phases, the plugin's methods among them."""
    out = step_time.main([
        "--size",
        "tiny",
        "--workloads",
        "transformer",
        "--precisions",
        "bf16-true",
        "mpt-bf16",
        "--rounds",
        "1",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--no-floor",
        "--profile",
        "--profile-steps",
        "1",
        "--quiet",
    ])
    profile = out["profile"]
    assert "| op | bf16-true | mpt-bf16 |" in profile
    assert re.search(r"^\| `aten::\w+` \| ", profile, re.M)
    for phase in ("model.forward", "model.backward", "optimizer update", "RemainderMasters.prepare", ".wake"):
        assert re.search(rf"^\| \w*{re.escape(phase)} \| ", profile, re.M), phase


def test_byte_model_and_targets() -> None:
    """The floor's byte model counts a tied weight once and norm layers as fp32; a target is judged on the median and
    says when the spread straddles it."""
    from common import GPT, GPT_SIZES

    model = GPT(GPT_SIZES["tiny"])
    half, fp32 = step_time.param_split(model, MPTPrecision().keep_fp32)
    n = sum(p.numel() for p in model.parameters())
    assert len(half) + len(fp32) == len(list(model.parameters()))  # the LM head shares the embedding: once
    norm = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters())
    assert sum(math.prod(s) for s in fp32) == norm
    assert sum(math.prod(s) for s in half) == n - norm
    bm = step_time.ByteModel(half_params=1000, fp32_params=10, scaling=False)
    assert bm.total == 20 * 1000 + 8 * 10
    assert len(bm.components()) == 3
    assert step_time.ByteModel(1000, 10, scaling=True).total == 26 * 1000 + 8 * 10
    t = step_time.Target("transformer", "x <= 1.0", step_time.Spread([0.97, 0.99, 1.04]), 1.0)
    assert t.met
    assert t.verdict() == "met (the spread straddles the limit)"
    assert step_time.Target("m", "x <= 0.9", step_time.Spread([0.95, 0.93]), 0.9).verdict() == "NOT met"


def test_paste_between_markers(tmp_path: Path) -> None:
    """--update pastes each table between its markers, and only there."""
    page = tmp_path / "page.md"
    page.write_text(
        f"intro\n{run_all.MARKERS[0]}\nold\n{run_all.MARKERS[1]}\nmiddle\n"
        f"{run_all.PROFILE_MARKERS[0]}\nold profile\n{run_all.PROFILE_MARKERS[1]}\noutro\n"
    )
    run_all.paste(page, "| new table |")
    run_all.paste(page, "| new profile |", run_all.PROFILE_MARKERS)
    text = page.read_text()
    assert text.startswith("intro\n")
    assert text.endswith("outro\n")
    assert "old" not in text
    assert "| new table |\n" in text
    assert "| new profile |\n" in text
    assert "\nmiddle\n" in text
    with pytest.raises(ValueError, match="expected one"):
        run_all.paste(tmp_path / "page.md", "x", ("<!-- none -->", "<!-- none:end -->"))


@pytest.mark.skipif(not GRAD_DTYPE, reason="accumulate_fp32 needs torch >= 2.13 (Tensor.grad_dtype)")
def test_grad_accumulation_fp32_sum_is_closer_to_fp64() -> None:
    results = grad_accumulation.main(["--fast"])
    for (precision, n), r in results.items():
        assert 0 < r["fp32"] < r["half"], (precision, n, r)  # the fp32 sum loses less than the half-precision one


def test_fp8_transformer_names_the_outlier_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchao.float8")
    import fp8_transformer

    from lightning_mpt.report import build_report

    out = fp8_transformer.main(["--fast", "--logdir", str(tmp_path)])
    assert out["losses"][-1] < out["losses"][0]
    report = build_report(tmp_path)
    assert (report.runs[0].fp8[0].layer, report.runs[0].fp8[0].role) == ("blocks.0.fc1", "input")
    assert any(a.rule == "fp8_keep_bf16" for a in report.runs[0].advice)


def test_engine_overhead_runs_and_prints_its_ratio_and_parts() -> None:
    """``benchmarks/engine_overhead.py``'s paths (the engine's phases, GradScaler's, the per-round ratio, ``--parts``,
    ``--floor``, ``--convert``) on small models: it runs and prints every line. Timings are not checked."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "engine_overhead.py"), "--rounds", "2", "--steps", "6"]
    result = subprocess.run(
        [*cmd, "--warmup", "2", "--depth", "4", "--parts", "--floor"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"total / GradScaler +\d+\.\d+x \[\d+\.\d+-\d+\.\d+\]", out), out
    for floor in ("tensor work alone", "least a step does"):  # timed, and as ratios to GradScaler's part
        assert re.search(floor + r" +\d+\.\d+ +\[\d+\.\d+-\d+\.\d+\]", out), out
        assert re.search(floor + r" / GradScaler +\d+\.\d+x \[[^\n]*\n +with zero_grad +\d+\.\d+x", out), out
    for part in ("collect", "copy to fp32", "edit check", "unscale", "swap", "write back", "release"):
        assert part in out, out
    result = subprocess.run([*cmd, "--convert", "40"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"40 tensors \d+\.\d+ s, 160 tensors \d+\.\d+ s: \d+\.\dx", result.stdout), result.stdout


def test_store_parts_wraps_the_remainder_store_and_prints_each_function() -> None:
    """``benchmarks/store_parts.py`` on the tiny transformer: every function it wraps still exists and is called in a
    bf16 step (a rename would leave a row out, or fail at the wrapping). Timings are not checked."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "store_parts.py"), "--size", "tiny", "--steps", "4"]
    result = subprocess.run([*cmd, "--warmup", "2"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("RemainderStore.sleep", "RemainderStore.check_chunk", "RemainderStore.wake", "_ties", "join"):
        assert re.search(rf"\| {re.escape(name)} +\| \d+\.\d+ \| \d+\.\d \| \d+\.\d \|", result.stdout), result.stdout
