"""Each example runs in its fast mode through a real Trainer and shows what its docstring promises."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tb_events import all_scalars

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bert_finetune  # noqa: E402
import memory_breakdown  # noqa: E402
import quickstart  # noqa: E402
import resnet_synthetic  # noqa: E402
import run_all  # noqa: E402
import vit_static_vs_dynamic  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> None:
    """Tiny models gain nothing from intra-op threads, and on a busy machine spinning OpenMP threads make fp16 CPU
    kernels ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_quickstart(tmp_path: Path) -> None:
    out = quickstart.main(["--steps", "60", "--logdir", str(tmp_path)])
    assert out["steps"] == 60 and out["skipped_steps"] == 0
    assert out["val_acc"] > 0.5  # 8 classes: chance is 0.125


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
    assert out["steps"] == 100 and out["skipped_steps"] == 0
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
    assert dynamic["scale_changes"][0] == (0, 2.0**16) and dynamic["final_loss_scale"] < 1024
    assert dynamic["skipped_steps"] <= 10 and dynamic["last_skipped"] < 10
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
        assert r["masters"] == 4 * (n - norm)  # one fp32 master per half parameter
        assert r["grads"] == r["weights"] and r["master_grads"] == r["masters"]
        assert 8 * n <= r["optimizer_state"] <= 8 * n + 64 * 8  # AdamW's two fp32 moments (+ step counters)
        assert r["weight_copies"] == 0  # the weights are half already: autocast casts nothing


def test_memory_lightning_precisions(memory: dict[str, dict[str, int]]) -> None:
    n = memory["32-true"]["params"]
    for name, weight_bytes in (("32-true", 4), ("16-mixed", 4), ("bf16-mixed", 4), ("16-true", 2), ("bf16-true", 2)):
        r = memory[name]
        assert r["weights"] == r["grads"] == weight_bytes * n and r["masters"] == r["master_grads"] == 0
        assert 2 * weight_bytes * n <= r["optimizer_state"] <= 2 * weight_bytes * n + 64 * 8
    assert memory["32-true"]["weight_copies"] == 0
    # autocast saves half copies of the fp32 weights in every step's graph
    assert memory["16-mixed"]["weight_copies"] > 0.25 * memory["16-true"]["weights"]
    # every 16-bit precision saves far fewer activation bytes than fp32
    for name in ("16-mixed", "bf16-mixed", "16-true", "bf16-true", "mpt-fp16", "mpt-bf16"):
        assert memory[name]["activations"] < 0.8 * memory["32-true"]["activations"]
    assert memory["mpt-fp16"]["activations"] <= memory["16-mixed"]["activations"]


def test_benchmark_table(tmp_path: Path) -> None:
    out = run_all.main(["--workloads", "deep_mlp", "--precisions", "32-true", "mpt-fp16", "--steps", "6"])
    rows = [line for line in out["markdown"].splitlines() if line.startswith("| deep_mlp")]
    assert len(rows) == 2 and "| mpt-fp16 |" in rows[1]
    assert "cores" in out["machine"] and "torch" in out["machine"]
    mpt = out["results"]["deep_mlp"]["mpt-fp16"]
    assert mpt["weights"] == 2 * mpt["params"] and mpt["masters"] == 4 * mpt["params"]  # no norm layers
    assert mpt["seconds_per_step"] > 0
    # --update pastes the table between the markers, and only there
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{run_all.MARKERS[0]}\nold\n{run_all.MARKERS[1]}\noutro\n")
    run_all.paste(page, out["markdown"])
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text and rows[1] in text
