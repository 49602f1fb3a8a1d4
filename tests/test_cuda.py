"""CUDA tests (``make gpu-check``): real Trainers on a GPU. Every test is marked ``cuda`` and skipped without CUDA, so
the CPU suite (CI) only collects them.

* fp16 and bf16 training through a real Trainer: half weights on the GPU (norm layers fp32), fp32 masters and fp32
  optimizer state on the GPU, the half weights equal to the rounded masters, fp32 weights back after ``fit``;
* the fused unscale on CUDA tensors: master gradients exactly the scaled half gradients over the scale, an inf in one
  gradient detected, the step skipped and the scale backed off;
* autocast on half weights: matmuls in the half format, softmax, norms and losses in fp32;
* ``TensorCoreCheck``: the shapes that keep matmuls off Tensor Cores;
* the benchmark scripts' GPU path on a tiny model (the long GPT-2 run of ``make gpu-check`` comes after these);
* DDP over NCCL with 2 GPUs (skipped with fewer): ranks agree on scale, skips and masters; an inf on one rank skips
  the step on both; the all-reduced gradients are half precision.

Run: ``python -m pytest -q -m cuda tests/test_cuda.py``. This file is also the DDP worker (``python tests/test_cuda.py
ddp-worker OUT``), because Lightning's DDP re-runs the launching script in each process.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import InjectInf, NoNormMLP, TinyMLP, quiet_trainer, regression_data, run_until_written

from lightning_mpt import DynamicLossScaler, MPTPrecision

ROOT = Path(__file__).resolve().parents[1]
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_trainer(**kwargs: Any) -> L.Trainer:
    """The suite's quiet Trainer on one GPU."""
    return quiet_trainer(**{"accelerator": "gpu", **kwargs})


# ------------------------------------------------------------------------------------------------ training
class Inspect(L.Callback):
    """Records dtypes, devices and values at each step of a run under MPTPrecision."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self.state_dtypes: set[torch.dtype] = set()

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        rounded = all(
            torch.equal(p, plugin.master_of(p).to(p.dtype)) for p in module.parameters()
        )  # the half weights are the rounded masters (norm layers are their own masters)
        self.rows.append({
            "weights": {n: (p.dtype, p.device.type) for n, p in module.named_parameters()},
            "masters": {(m.dtype, m.device.type) for m in plugin.main_params(trainer.optimizers[0])},
            "rounded": rounded,
        })

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.state_dtypes = {
            v.dtype
            for s in trainer.optimizers[0].state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.ndim > 0
        }


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_trains_on_cuda_with_half_weights_and_fp32_masters(fmt: str) -> None:
    torch.manual_seed(0)
    plugin, inspect = MPTPrecision(fmt), Inspect()
    model = TinyMLP(lr=3e-3)
    gpu_trainer(max_steps=40, plugins=[plugin], callbacks=[inspect]).fit(model, regression_data(n=40 * 16))
    half = HALF[fmt]
    for row in inspect.rows:
        assert row["weights"]["net.0.weight"] == row["weights"]["net.3.weight"] == (half, "cuda")
        assert row["weights"]["net.1.weight"] == (torch.float32, "cuda")  # LayerNorm stays fp32
        assert row["masters"] == {(torch.float32, "cuda")}
        assert row["rounded"]
    assert inspect.state_dtypes == {torch.float32}  # Adam's moments step the fp32 masters
    assert plugin.skipped_steps <= 3
    assert plugin.device == "cuda"
    assert sum(inspect.losses[-5:]) < 0.5 * sum(inspect.losses[:5])  # it learns
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.float32, "cuda")}  # fp32 after fit


class KeepsHalfGradients(L.Callback):
    """Keeps the half gradients after the first two backwards with copies, as a gradient logger may."""

    def __init__(self) -> None:
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_step < 2:
            # the half ones: fp32 (norm) parameters' gradients are unscaled in place, as torch's GradScaler does
            self.kept += [(p.grad, p.grad.clone()) for p in module.parameters() if p.grad.dtype != torch.float32]


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_half_gradients_a_callback_keeps_are_not_the_edit_checks_scratch(fmt: str) -> None:
    """The GPU's check for edited weights rounds the masters into a buffer of its own: a half gradient that user code
    holds after the backward keeps its values through the step (the gradients once served as that scratch)."""
    torch.manual_seed(0)
    keeps = KeepsHalfGradients()
    plugin = MPTPrecision(fmt, scaler=64.0) if fmt == "fp16" else MPTPrecision(fmt)
    gpu_trainer(max_steps=4, plugins=[plugin], callbacks=[keeps]).fit(TinyMLP(), regression_data(n=64))
    assert plugin.skipped_steps == 0
    assert len(keeps.kept) == 8  # 4 half parameters, 2 steps
    for kept, value in keeps.kept:
        assert torch.equal(kept, value)


# ------------------------------------------------------------------------------------------------ fused unscale
class ScaledGrads(L.Callback):
    """Keeps the scaled half gradients after backward and the master gradients the step sees."""

    def __init__(self) -> None:
        self.scaled: list[dict[str, torch.Tensor]] = []
        self.unscaled: list[dict[str, torch.Tensor]] = []
        self.module_grads: list[dict[str, torch.Tensor]] = []
        self.masters_before: list[dict[str, torch.Tensor]] = []

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.scaled.append({n: p.grad.clone() for n, p in module.named_parameters()})
        self.masters_before.append({
            n: trainer.precision_plugin.master_of(p).detach().clone() for n, p in module.named_parameters()
        })

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        plugin = trainer.precision_plugin
        self.unscaled.append({n: plugin.master_of(p).grad.clone() for n, p in module.named_parameters()})
        self.module_grads.append({n: p.grad.clone() for n, p in module.named_parameters()})


def test_fused_unscale_on_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[set[str]] = []
    fused = torch._amp_foreach_non_finite_check_and_unscale_

    def spy(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        calls.append({g.device.type for g in grads} | {found_inf.device.type, inv_scale.device.type})
        fused(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", spy)
    scale = 1024.0  # a power of two: unscaling is exact
    plugin = MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=scale, growth_interval=10**6))
    grads = ScaledGrads()
    torch.manual_seed(0)
    gpu_trainer(max_steps=4, plugins=[plugin], callbacks=[grads, InjectInf("net.0.weight", steps={2})]).fit(
        TinyMLP(), regression_data(n=64)
    )
    assert calls
    assert all(devices == {"cuda"} for devices in calls)
    # clean steps: fp32 master gradient == scaled half gradient / scale, bit for bit; the module sees it in half
    for step in (0, 1, 3):
        step_scale = scale if step < 2 else scale / 2
        for name, g in grads.scaled[step].items():
            assert torch.equal(grads.unscaled[step][name], g.float() / step_scale), (step, name)
            assert torch.equal(grads.module_grads[step][name], (g.float() / step_scale).to(g.dtype)), (step, name)
    # the inf injected at step 2: detected, the step skipped, masters untouched, the scale halved
    record = plugin.history[2]
    assert record.skipped
    assert plugin.skipped_steps == 1
    assert record.nonfinite_params == ["net.0.weight"]
    assert not plugin.history[3].skipped
    assert plugin.history[3].scale == scale / 2
    for name, m in grads.masters_before[2].items():
        assert torch.equal(m, grads.masters_before[3][name]), name


# ------------------------------------------------------------------------------------------------ autocast
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_autocast_on_half_weights(fmt: str) -> None:
    half = HALF[fmt]
    plugin = MPTPrecision(fmt)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)).cuda()
    plugin.convert_module(model)
    assert plugin.device == "cuda"
    assert model[0].weight.dtype == half
    assert model[1].weight.dtype == torch.float32
    x, y = torch.randn(4, 16, device="cuda"), torch.randint(0, 8, (4,), device="cuda")
    with plugin.forward_context():
        h = model[0](x)  # fp32 input, half weight: the matmul runs in the half format
        n = model[1](h)  # fp32 LayerNorm
        logits = model[2](n)
        probs = torch.softmax(logits, -1)
        loss = nn.functional.cross_entropy(logits, y)
    assert h.dtype == half
    assert logits.dtype == half
    assert n.dtype == torch.float32
    assert probs.dtype == torch.float32
    assert loss.dtype == torch.float32
    loss.backward()
    assert model[0].weight.grad.dtype == half
    assert model[1].weight.grad.dtype == torch.float32
    assert torch.isfinite(model[0].weight.grad).all()
    plugin.teardown()
    assert {p.dtype for p in model.parameters()} == {torch.float32}


# ------------------------------------------------------------------------------------------------ Tensor Cores
def test_tensor_core_check_on_cuda() -> None:
    from lightning_mpt.callbacks import TensorCoreCheck

    check = TensorCoreCheck()
    with pytest.warns(UserWarning, match="TensorCoreCheck"):
        gpu_trainer(max_steps=1, plugins=[MPTPrecision("bf16")], callbacks=[check]).fit(
            TinyMLP(d_in=30, hidden=32, d_out=10), regression_data(n=12, d_in=30, d_out=10, batch_size=12)
        )
    assert [str(f) for f in check.findings] == [
        "net.0 (Linear): in_features=30",
        "net.3 (Linear): out_features=10",
        "batch size (DataLoader): batch_size=12",
    ]
    aligned = TensorCoreCheck()
    gpu_trainer(max_steps=1, plugins=[MPTPrecision("fp16")], callbacks=[aligned]).fit(
        TinyMLP(d_in=16, hidden=32, d_out=8), regression_data(n=16, d_in=16, d_out=8, batch_size=16)
    )
    assert aligned.findings == []


# ------------------------------------------------------------------------------------------------ benchmarks, GPU path
def test_benchmark_gpu_path_on_a_tiny_model(tmp_path: Path) -> None:
    """What ``make gpu-check`` runs next, on the tiny transformer in seconds: every precision, the floor, peak memory
    and the CUDA profile."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import run_all

    out = run_all.main([
        "--accelerator",
        "gpu",
        "--size",
        "tiny",
        "--workloads",
        "transformer",
        "--rounds",
        "2",
        "--steps",
        "6",
        "--warmup",
        "3",
        "--profile-steps",
        "2",
        "--quiet",
        "--out",
        str(tmp_path / "gpu.md"),
    ])
    text = out["markdown"]
    assert torch.cuda.get_device_name() in text
    assert "peak MiB" in text
    assert "GPU: mpt-bf16 / bf16-mixed <= 0.9" in text
    runs = out["runs"]["transformer"]
    assert set(runs) == set(run_all.step_time.ALL_PRECISIONS)  # on a GPU the fp16 precisions run too
    assert all(r["peak_bytes"] and r["seconds"] > 0 for rs in runs.values() for r in rs)
    assert "self CUDA time" in out["profile"]
    assert "aten::" in out["profile"]
    assert out["floors"]["transformer"]["mpt-bf16"]["bandwidth"] > 2e11  # HBM: TB/s (a CPU: tens of GB/s)


# ------------------------------------------------------------------------------------------------ DDP over NCCL
class Record(L.Callback):
    """Per step: loss scale, skip, SHA-1 of the masters, bytes all-reduced; written to OUT/rank<r>.json at the end."""

    def __init__(self, out: Path) -> None:
        self.out, self.rows, self.bytes = out, [], [0]

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def count_and_allreduce(state, bucket):  # no annotations: DDP rejects a hook whose ``bucket`` is not GradBucket
            buf = bucket.buffer()
            state[0] += buf.numel() * buf.element_size()
            return default_hooks.allreduce_hook(None, bucket)

        trainer.strategy.model.register_comm_hook(self.bytes, count_and_allreduce)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        flat = torch.cat([m.detach().float().flatten() for _, _, m in plugin.named_masters()]).cpu()
        self.rows.append({
            "scale": plugin.last_step.scale,
            "skipped": plugin.last_step_skipped,
            "masters_sha1": hashlib.sha1(flat.numpy().tobytes(), usedforsecurity=False).hexdigest(),
            "bytes": self.bytes[0],
            "dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        })
        self.bytes[0] = 0

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        path = self.out / f"rank{trainer.global_rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.rows))
        os.replace(path.with_suffix(".tmp"), path)


def ddp_worker(out: Path) -> None:
    torch.manual_seed(os.getpid())  # ranks start from different weights: the plugin must broadcast rank 0's masters
    trainer = gpu_trainer(
        strategy="ddp",
        devices=2,
        max_steps=6,
        plugins=[MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=1024.0))],
        callbacks=[Record(out), InjectInf("net.0.weight", steps={3}, rank=1)],
    )
    trainer.fit(NoNormMLP(), regression_data(n=2 * 6 * 16))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP needs 2 GPUs")
def test_ddp_nccl_ranks_agree_and_reduce_half_gradients(tmp_path: Path) -> None:
    ranks = [tmp_path / "rank0.json", tmp_path / "rank1.json"]
    code = run_until_written(
        [sys.executable, os.path.abspath(__file__), "ddp-worker", str(tmp_path)],
        ranks,
        tmp_path / "log.txt",
        timeout=300,
    )
    if not all(r.exists() for r in ranks):
        pytest.fail(f"workers did not finish (exit {code}):\n{(tmp_path / 'log.txt').read_text()[-3000:]}")
    rank0, rank1 = (json.loads(r.read_text()) for r in ranks)
    assert len(rank0) == len(rank1) == 6
    for a, b in zip(rank0, rank1):
        assert (a["scale"], a["skipped"], a["masters_sha1"]) == (b["scale"], b["skipped"], b["masters_sha1"])
    assert rank0[3]["skipped"]
    assert rank0[3]["masters_sha1"] == rank0[2]["masters_sha1"]
    assert rank0[4]["scale"] == rank0[3]["scale"] / 2
    params = 16 * 32 + 32 + 32 * 4 + 4
    assert rank0[0]["dtypes"] == ["torch.float16"]
    assert [r["bytes"] for r in rank0] == [2 * params] * 6  # half-precision gradients on the wire
    assert len({r["masters_sha1"] for r in rank0}) >= 5  # and it trained


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "ddp-worker":
    ddp_worker(Path(sys.argv[2]))
