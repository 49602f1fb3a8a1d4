"""The diagnostic callbacks under FSDP2 (``ModelParallelStrategy``) equal those under DDP, with 2 CPU processes (gloo).

One launch of tests/diagnostics_fsdp_worker.py trains the same model on the same batches with the same seed under DDP
and under FSDP2, ``MPTPrecision("fp16")`` with a scale that starts too high, the three monitors at every step. Under
FSDP2 the monitors measure each process's shards (uneven, one of them empty) and sum the counts across processes; the
tests read rank 0's event files of both runs and compare every scalar and histogram.

Tolerances: with 2 processes fp16 gradients are reduced the same way by both (each rank's gradient halved in fp16,
then summed), so the stored gradients and the masters are bitwise equal (checked first, from digests the workers
wrote). Fractions are ratios of integer counts and must then be equal; the sums and sums of squares of the value
histograms are float64 sums of the shards' partial sums, whose order may differ from a sum over the whole tensor:
they are compared to a relative 1e-9.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from models import run_until_written
from tb_events import layouts, read_events, records

from lightning_mpt import tags
from lightning_mpt.report import build_report

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

WORKER = Path(__file__).with_name("diagnostics_fsdp_worker.py")
STEPS = 12
PARAMS = ["model.0.weight", "model.0.bias", "model.3.weight", "model.3.bias"]  # the fp16 ones (LayerNorm stays fp32)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("diag-fsdp")
    done = [out / "done-rank0", out / "done-rank1"]
    code = run_until_written([sys.executable, str(WORKER), str(out)], done, out / "log.txt", timeout=300)
    if not all(f.exists() for f in done):
        pytest.fail(f"workers did not finish (exit {code}):\n{(out / 'log.txt').read_text()[-4000:]}")
    return out


def seen(out: Path, run: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / run / f"rank{rank}.json").read_text())


def events(out: Path, run: str) -> Any:
    return read_events(out / run / "version_0")


def test_the_runs_are_the_same_training(out):
    """The precondition of the comparison: the same steps skipped, and equal stored gradients and masters."""
    ddp, fsdp = seen(out, "ddp"), seen(out, "fsdp")
    assert [h[:3] for h in ddp["history"]] == [h[:3] for h in fsdp["history"]]
    assert [sorted(h[3]) for h in ddp["history"]] == [sorted(h[3]) for h in fsdp["history"]]
    skipped = [h[2] for h in fsdp["history"]]
    assert any(skipped)
    assert not all(skipped)
    clean = [i for i, s in enumerate(skipped) if not s]
    assert [ddp["grads"][i] for i in clean] == [fsdp["grads"][i] for i in clean]
    assert ddp["masters"] == fsdp["masters"]


def test_every_scalar_equals_ddp(out):
    ddp, fsdp = events(out, "ddp"), events(out, "fsdp")
    names = set(ddp.Tags()["scalars"])
    assert names == set(fsdp.Tags()["scalars"])
    for family in (tags.GRAD_ZERO, tags.GRAD_SUBNORMAL, tags.GRAD_OVERFLOW, tags.UPDATE_UNDERFLOW):
        assert {tags.parameter_of(family, t) for t in names} - {None} == set(PARAMS), family  # the original names
    assert {tags.LOSS_SCALE, tags.OVERFLOW, tags.STORED_HEADROOM, tags.GRAD_ZERO, tags.UPDATE_UNDERFLOW} <= names
    for tag in sorted(names):
        a, b = [(e.step, e.value) for e in ddp.Scalars(tag)], [(e.step, e.value) for e in fsdp.Scalars(tag)]
        assert [s for s, _ in a] == [s for s, _ in b], tag
        assert all(x == y or (math.isnan(x) and math.isnan(y)) for (_, x), (_, y) in zip(a, b)), (tag, a, b)
    fractions = [e.value for t in names if t.startswith(tags.GRAD_ZERO) for e in fsdp.Scalars(t)]
    assert fractions
    assert any(0 < v < 1 for v in fractions)
    overflow = [e.value for e in fsdp.Scalars(tags.GRAD_OVERFLOW)]
    assert overflow[0] > 0
    assert overflow[-1] == 0
    assert len(fsdp.Scalars(tags.UPDATE_UNDERFLOW)) == sum(not h[2] for h in seen(out, "fsdp")["history"])


def test_every_histogram_equals_ddp(out):
    ddp, fsdp = events(out, "ddp"), events(out, "fsdp")
    names = set(ddp.Tags()["histograms"])
    assert names == set(fsdp.Tags()["histograms"])
    assert {tags.parameter_of(tags.GRAD_EXPONENT, t) for t in names} - {None} == set(PARAMS)
    assert {tags.parameter_of(tags.GRAD_HIST, t) for t in names} - {None} == {*PARAMS, "model.1.weight", "model.1.bias"}
    for tag in sorted(names):
        a, b = ddp.Histograms(tag), fsdp.Histograms(tag)
        assert a, tag
        assert [e.step for e in a] == [e.step for e in b], tag  # the values of all-NaN steps are not drawn
        for x, y in zip(a, b):
            hx, hy = x.histogram_value, y.histogram_value
            assert (hx.min, hx.max, hx.num) == (hy.min, hy.max, hy.num), (tag, x.step)
            assert list(hx.bucket_limit) == list(hy.bucket_limit), (tag, x.step)
            assert list(hx.bucket) == list(hy.bucket), (tag, x.step)
            assert hy.sum == pytest.approx(hx.sum, rel=1e-9, abs=1e-300), (tag, x.step)
            assert hy.sum_squares == pytest.approx(hx.sum_squares, rel=1e-9), (tag, x.step)


def test_records_dashboard_and_report_are_the_same(out):
    ddp, fsdp = events(out, "ddp"), events(out, "fsdp")
    for tag in (tags.SKIP_RECORD, tags.SUMMARY_RECORD, tags.RUN_RECORD):
        a, b = records(ddp, tag), records(fsdp, tag)
        if tag == tags.SKIP_RECORD:  # the culprits are named in the optimizer's parameter order, which differs
            a = [(s, {**r, "params": sorted(r["params"])}) for s, r in a]
            b = [(s, {**r, "params": sorted(r["params"])}) for s, r in b]
        assert a == b, tag
    assert [str(x) for x in layouts(ddp)] == [str(x) for x in layouts(fsdp)]
    assert len(layouts(fsdp)) == 1
    report = build_report(out)
    by_run = {Path(r.run).parts[0]: r for r in report.runs}
    a, b = by_run["ddp"], by_run["fsdp"]
    assert a.steps == b.steps == STEPS
    assert a.skipped_steps == b.skipped_steps > 0
    assert (a.scale, a.subnormal, a.update_underflow, a.nonfinite_params) == (
        b.scale,
        b.subnormal,
        b.update_underflow,
        b.nonfinite_params,
    )
    assert a.worst_underflow == b.worst_underflow
    assert a.exponents == b.exponents


def test_one_host_read_and_one_collective_per_logging_step(out):
    for rank in (0, 1):  # every process measures its shards and takes part; only rank 0 writes
        fsdp = seen(out, "fsdp", rank)
        assert fsdp["syncs"] == STEPS  # one .tolist() per step for all statistics of all monitors
        assert fsdp["flush_collectives"] == STEPS  # one all_reduce of all counts per step
        # and per step one all_reduce of the value histograms' ranges; once per fit, each monitor's set-up agreement
        assert fsdp["collectives"] == 2 * STEPS + 3
    assert seen(out, "ddp", 0)["syncs"] == STEPS
    assert seen(out, "ddp", 1)["syncs"] == 0
    assert len(list(out.glob("fsdp/version_0/events.out.tfevents.*"))) == 1


def test_the_fp32_reference_is_off_under_fsdp2_with_one_warning(out):
    warned = [w for w in seen(out, "fsdp-reference", 0)["warnings"] if "fp32 reference" in w]
    assert len(warned) == 1
    assert "off under FSDP2" in warned[0]
    assert not [w for w in seen(out, "fsdp-reference", 1)["warnings"] if "fp32 reference" in w]  # rank 0 warns
    names = set(events(out, "fsdp-reference").Tags()["scalars"])
    assert tags.GRAD_UNDERFLOW not in names
    assert tags.SCALE_HEADROOM not in names
    assert {tags.GRAD_ZERO, tags.LOSS_SCALE} <= names  # the rest is measured


def test_a_statistic_failing_on_one_rank_goes_off_on_both_and_training_goes_on(out):
    """From step 3 on, two statistics raise on rank 1 only (strict off): rank 1 warns with the error, rank 0 learns it
    at the flush; both turn them off, so their collectives never disagree, and the others go on to the end."""
    rank0, rank1 = seen(out, "fsdp-fail", 0), seen(out, "fsdp-fail", 1)
    assert len(rank0["history"]) == len(rank1["history"]) == 6
    for stat in ("the stored-gradient fractions", "the gradient value histograms"):
        (own,) = [w for w in rank1["warnings"] if f": {stat} (" in w]
        assert "failed on rank 1 with AttributeError" in own
        assert "Traceback" in own
        (other,) = [w for w in rank0["warnings"] if f": {stat} (" in w]
        assert "failed on another process" in other
    ea = events(out, "fsdp-fail")
    assert [e.step for e in ea.Scalars(tags.GRAD_ZERO)] == [0, 1, 2]
    assert (
        max(e.step for t in ea.Tags()["histograms"] if t.startswith(tags.GRAD_HIST + "/") for e in ea.Histograms(t)) < 3
    )
    assert [e.step for e in ea.Histograms(tags.per_parameter(tags.GRAD_EXPONENT, "model.0.weight"))] == list(range(6))
    assert [e.step for e in ea.Scalars(tags.LOSS_SCALE)] == list(range(6))
    assert ea.Scalars(tags.UPDATE_UNDERFLOW)[-1].step == 5
