"""DDP with 2 CPU processes (gloo), under ``ddp`` and ``ddp_spawn``: ranks agree on the scale, the skip decision and
the masters at every step, and the gradients DDP all-reduces are half precision (half the bytes of "16-mixed").

The runs are subprocesses; the assertions read what each rank wrote, so gloo's occasional abort at process exit
("terminate called without an active exception") cannot fail a test whose workers finished their work.
"""

import json
import sys
from pathlib import Path

import pytest
from models import run_until_written
from tb_events import all_scalars

from lightning_mpt._compat import GRAD_DTYPE

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

WORKER = Path(__file__).with_name("ddp_worker.py")


def run_workers(tmp_path: Path, strategy: str, precision: str, *extra: str) -> list[list[dict]]:
    """Run the 2-process job; return what each rank wrote."""
    out = tmp_path / f"{strategy}-{precision}"
    out.mkdir()
    ranks = [out / "rank0.json", out / "rank1.json"]
    code = run_until_written(
        [sys.executable, str(WORKER), strategy, str(out), precision, *extra], ranks, out / "log.txt"
    )
    if not all(r.exists() for r in ranks):
        pytest.fail(f"workers did not finish (exit {code}):\n{(out / 'log.txt').read_text()[-3000:]}")
    return [json.loads(r.read_text()) for r in ranks]


# ``ddp`` runs the chunked step (MPTPrecision(chunked_step=64)) and ``ddp_spawn`` the whole one: the decision and its
# all-reduce are the same code in both, and one run each keeps the suite's time
@pytest.mark.parametrize(("strategy", "chunked"), [("ddp", ("--chunked",)), ("ddp_spawn", ())])
def test_ranks_agree_and_an_inf_on_one_rank_skips_the_step_on_both(tmp_path, strategy, chunked):
    rank0, rank1 = run_workers(tmp_path, strategy, "mpt-fp16", "--inject-step", "3", "--inject-rank", "1", *chunked)
    assert len(rank0) == len(rank1) == 6
    # bitwise across ranks: the all-reduce hands both ranks the same sum of 2 values (commutative), and the step is
    # elementwise; the ranks start from different weights on purpose (the worker), which DDP and the plugin sync
    for a, b in zip(rank0, rank1):
        assert (a["scale"], a["skipped"], a["weights_sha1"]) == (b["scale"], b["skipped"], b["weights_sha1"]), a["step"]
    skipped = [row["skipped"] for row in rank0]
    assert skipped[3]
    assert skipped.count(True) == 1 + skipped[:3].count(True)
    assert rank0[3]["weights_sha1"] == rank0[2]["weights_sha1"]  # the skipped step left the masters alone
    assert rank0[4]["scale"] == rank0[3]["scale"] / 2


@pytest.fixture(scope="module")
def auto_scaled(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    """One fp16 run of the model without norm layers with ``init_scale="auto"``, rank 1's first gradients 16 times
    rank 0's (the worker): two tests read it, so the suite starts two processes once for both."""
    return run_workers(tmp_path_factory.mktemp("auto"), "ddp", "mpt-fp16", "--model", "nonorm", "--auto-scale")


def test_allreduced_gradients_are_half_precision(tmp_path, auto_scaled):
    mpt0, mpt1 = auto_scaled
    amp0, _ = run_workers(tmp_path, "ddp", "lightning-16-mixed", "--model", "nonorm")
    assert mpt0[0]["param_dtypes"] == ["torch.float16"]
    assert amp0[0]["param_dtypes"] == ["torch.float32"]
    mpt_bytes = [row["bytes"] for row in mpt0]
    amp_bytes = [row["bytes"] for row in amp0]
    params = 16 * 32 + 32 + 32 * 4 + 4
    assert amp_bytes == [4 * params] * 6  # fp32 gradients under "16-mixed"
    assert mpt_bytes == [2 * params] * 6  # half under MPTPrecision: ratio 0.5
    assert mpt_bytes == [row["bytes"] for row in mpt1]


def test_the_fp32_reference_leaves_ddp_intact(tmp_path):
    """UnderflowMonitor re-runs the batch in fp32 with the masters; DDP must keep reducing afterwards. The masters are
    stored as 16-bit remainders and stepped in chunks, and the eligible Linear computes in fp8 (torchao, emulated): the
    ranks, which start from different weights, agree after the plugin's broadcast, the reference wakes every master at
    each step, and Float8Monitor logs each step's casts (one launch serves all of it: the suite's time)."""
    rank0, rank1 = run_workers(tmp_path, "ddp", "mpt-bf16", "--reference", "--chunked", "--remainders", "--fp8")
    assert rank0[0]["fp8_layers"] == rank1[0]["fp8_layers"] == ["net.0"]  # Linear(16, 32); Linear(32, 4) unaligned
    assert rank0[0]["param_dtypes"] == ["torch.bfloat16", "torch.float32"]  # half weights, fp32 LayerNorm
    scale = all_scalars(tmp_path / "ddp-mpt-bf16" / "tb" / "run")["mpt/fp8/scale/net.0/input"]
    assert len(scale) == 6
    assert len(rank0) == len(rank1) == 6
    assert [r["weights_sha1"] for r in rank0] == [r["weights_sha1"] for r in rank1]  # one all-reduced sum (see above)
    assert len({r["weights_sha1"] for r in rank0}) == 6  # and it trained
    assert all(r["bytes"] > 0 for r in rank0)


@pytest.mark.skipif(not GRAD_DTYPE, reason="accumulate_fp32 needs torch >= 2.13 (Tensor.grad_dtype)")
def test_fp32_accumulation_under_ddp_reduces_half_gradients_once_per_step(tmp_path):
    """The micro-batches under no_sync sum in fp32; the synchronising one hands DDP's reducer its half format."""
    rank0, rank1 = run_workers(
        tmp_path, "ddp", "mpt-bf16", "--model", "nonorm", "--accumulate", "3", "--accumulate-fp32"
    )
    assert len(rank0) == len(rank1) == 18  # 6 optimizer steps of 3 micro-batches
    assert [r["weights_sha1"] for r in rank0] == [r["weights_sha1"] for r in rank1]  # one all-reduced sum per step
    hashes = [r["weights_sha1"] for r in rank0]
    assert len(set(hashes)) == 7
    assert hashes[2::3] == list(dict.fromkeys(hashes[2::3]))
    params = 16 * 32 + 32 + 32 * 4 + 4
    assert [r["bytes"] for r in rank0] == [0, 0, 2 * params] * 6  # half-precision all-reduce, only at the step


def test_auto_scale_ranks_choose_one_scale_in_the_one_collective(auto_scaled):
    # rank 1's first gradients are 16 times rank 0's (the worker), so each rank alone would choose another scale
    rank0, rank1 = auto_scaled
    assert [r["scale"] for r in rank0] == [r["scale"] for r in rank1]
    assert rank0[0]["scale"] == 1.0  # measured at scale 1
    assert rank0[0]["loss_scale"] == rank1[0]["loss_scale"] > 1.0  # and one scale chosen
    assert not any(r["skipped"] for r in rank0 + rank1)
    # one all-reduce of the engine per step, the measuring step included (amax rides with the skip flags)
    assert [r["engine_all_reduces"] for r in rank0] == [1, 2, 3, 4, 5, 6]
