"""The Fabric plugin's memory options, ``chunked_step`` and ``master_remainders``, through a real ``lightning.Fabric``.

Bitwise comparisons are between runs in one process on one CPU that do the same arithmetic in the same order: AdamW
updates each parameter from its own tensors (so the chunks change no operation), the clipping norm stacks the same
per-tensor norms in the optimizer's order (see tests/test_chunked_step.py), and with remainders both runs round the
half weights alike (ties away from zero), so they see the same forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_mpt.fabric import MPTPrecision


def batches(n: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def train(
    steps: int = 5,
    clip: Optional[dict[str, float]] = None,
    load: Optional[Path] = None,
    skip: int = 0,
    **options: Any,
) -> tuple[nn.Module, MPTPrecision, list[Any]]:
    """Train on the first ``steps`` batches, the first ``skip`` of them left out (taken before a checkpoint)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
    mpt = MPTPrecision("bf16", **options)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mpt])
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    seen = []
    if load is not None:
        fabric.load(load, {"model": model, "optimizer": optimizer, "mpt": mpt})
    for x, y in batches(steps)[skip:]:
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        if clip is not None:
            mpt.clip_gradients(optimizer, **clip)
        optimizer.step()
        optimizer.zero_grad()
        seen.append([t.dtype for t in mpt.master_storage()])
    return model, mpt, [fabric, optimizer, seen]


def weights(model: nn.Module, mpt: MPTPrecision) -> list[Tensor]:
    return [mpt.master_of(p).detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip", [{"max_norm": 0.05}, {"clip_val": 0.01}], ids=["norm", "value"])
def test_a_chunked_step_equals_the_whole_step_with_clipping(clip):
    whole, whole_mpt, _ = train(clip=clip)
    chunked, chunked_mpt, _ = train(clip=clip, chunked_step=64)
    assert all(torch.equal(a, b) for a, b in zip(weights(whole, whole_mpt), weights(chunked, chunked_mpt)))


def test_masters_stored_in_16_bits_equal_whole_steps_and_resume_exactly(tmp_path):
    chunked, mpt, (_, _, seen) = train(steps=6, master_remainders=True, chunked_step=64)
    assert seen == [[torch.int16] * 4] * 6  # between steps every master sleeps (the LayerNorm is its own master)
    whole, whole_mpt, _ = train(steps=6, master_remainders=True)
    assert all(torch.equal(a, b) for a, b in zip(weights(whole, whole_mpt), weights(chunked, mpt)))

    # resume: 3 steps, a checkpoint, a new loop that loads it and takes batches 4 to 6: the straight run, bitwise
    first, first_mpt, (fabric, optimizer, _) = train(steps=3, master_remainders=True, chunked_step=64)
    fabric.save(tmp_path / "ckpt", {"model": first, "optimizer": optimizer, "mpt": first_mpt})
    state = torch.load(tmp_path / "ckpt", weights_only=True)["model"]
    assert all(v.dtype == torch.float32 for v in state.values())
    resumed, resumed_mpt, _ = train(steps=6, skip=3, load=tmp_path / "ckpt", master_remainders=True, chunked_step=64)
    assert all(torch.equal(a, b) for a, b in zip(weights(chunked, mpt), weights(resumed, resumed_mpt)))


def test_fabric_clip_gradients_refuses_a_chunked_step_and_says_what_to_use():
    torch.manual_seed(0)
    mpt = MPTPrecision("bf16", chunked_step=64)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mpt])
    model, optimizer = fabric.setup(nn.Linear(16, 4), torch.optim.SGD(nn.Linear(16, 4).parameters(), lr=0.1))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(2, 16)).float().sum())
    with pytest.raises(ValueError, match=r"precision.clip_gradients\(optimizer, max_norm"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)


def test_the_options_are_refused_where_they_cannot_work():
    with pytest.raises(ValueError, match="needs precision='bf16'"):
        MPTPrecision("fp16", master_remainders=True)
    with pytest.raises(ValueError, match="not supported under FSDP2"):
        MPTPrecision("bf16", sharded=True, chunked_step=True)
    with pytest.raises(ValueError, match="exactly one of max_norm and clip_val"):
        MPTPrecision("bf16").clip_gradients(None)
