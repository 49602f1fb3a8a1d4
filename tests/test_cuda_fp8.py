"""CUDA tests of fp8 compute (``make gpu-check``): real fp8 matmuls where the GPU has fp8 Tensor Cores (compute
capability >= 8.9), the clear error below it. Every test is marked ``cuda`` and skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from models import quiet_trainer

from lightning_mpt import MPTPrecision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from fp8_transformer import TinyGPT, copy_task

pytest.importorskip("torchao.float8")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _fp8_capable(), reason="needs fp8 Tensor Cores (compute capability >= 8.9)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_fp8_trains_close_to_bf16(recipe: str) -> None:
    losses = {}
    for name, plugin in (("bf16", MPTPrecision("bf16")), ("fp8", MPTPrecision("bf16", fp8=recipe))):
        torch.manual_seed(0)
        model = TinyGPT(d_model=64)
        quiet_trainer(accelerator="gpu", plugins=[plugin], max_steps=24).fit(model, copy_task(n=48))
        losses[name] = model.losses
        assert plugin.device == "cuda"
    assert losses["fp8"][-1] < 0.8 * losses["fp8"][0]
    for a, b in zip(losses["fp8"], losses["bf16"]):
        assert abs(a - b) <= 0.05 * b


@pytest.mark.skipif(_fp8_capable(), reason="this GPU has fp8 Tensor Cores")
def test_a_gpu_without_fp8_tensor_cores_refuses_unless_emulated() -> None:
    with pytest.raises(RuntimeError, match="has no fp8 Tensor Cores"):
        quiet_trainer(accelerator="gpu", plugins=[MPTPrecision("bf16", fp8=True)], max_steps=1).fit(
            TinyGPT(), copy_task(n=16)
        )
