"""The hint of ``NonFiniteGradientError`` fits the cause of the stop, and what it advises helps: run again as advised,
the same training is not stopped. Clipping and a lower learning rate, which the hint used to offer for every stop, do
not prevent an overflow (clipping acts on the unscaled gradients after it; a skipped step applies no update)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import TinyMLP, quiet_trainer, regression_data
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import DynamicLossScaler, MPTPrecision, NonFiniteGradientError

STEPS = 8


class Loud(TinyMLP):
    """Its loss times 2^20: gradients above fp16's max (65504) even at a loss scale of 1."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * 2.0**20


def huge_inputs() -> DataLoader:
    """Inputs of 1e5: the fp16 forward pass overflows, the loss is inf."""
    x, y = regression_data(n=16 * STEPS).dataset.tensors
    return DataLoader(TensorDataset(x * 1e5, y), batch_size=16)


def fit(plugin: MPTPrecision, model: Any = TinyMLP, data: Any = None, **trainer: Any) -> str:
    """Train; the stop's hint, ``""`` when the run was not stopped."""
    torch.manual_seed(0)
    try:
        quiet_trainer(plugins=[plugin], max_steps=STEPS, **trainer).fit(model(), data or regression_data(n=16 * STEPS))
    except NonFiniteGradientError as error:
        (hint,) = [line for line in str(error).splitlines() if line.startswith("  hint: ")]
        return hint
    return ""


def test_a_static_scale_stop_advises_the_dynamic_scaler() -> None:
    hint = fit(MPTPrecision("fp16", scaler=2.0**22, max_consecutive_skips=3))
    assert "a static loss scale (4.1943e+06) never backs off: use the dynamic scaler (scaler=None)" in hint
    assert "clip" not in hint
    assert fit(MPTPrecision("fp16", scaler=2.0**22, max_consecutive_skips=3), gradient_clip_val=1.0) == hint
    assert fit(MPTPrecision("fp16", max_consecutive_skips=3)) == ""  # as advised


def test_a_stop_at_the_minimum_scale_advises_bf16() -> None:
    hint = fit(MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=4.0)), Loud)
    assert "the gradients overflow fp16 even at scale 1: use MPTPrecision('bf16'), whose range holds them." in hint
    assert fit(MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=4.0)), Loud, gradient_clip_val=1.0) == hint
    assert fit(MPTPrecision("bf16"), Loud) == ""  # as advised
    floor = fit(MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=64.0, min_scale=8.0)), Loud)
    assert "even at scale 8: lower min_scale (now 8) or use MPTPrecision('bf16')" in floor


def test_a_start_too_high_advises_init_scale_auto() -> None:
    hint = fit(MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale=2.0**24), max_consecutive_skips=3))
    assert "start lower (DynamicLossScaler(init_scale='auto')" in hint
    assert fit(MPTPrecision("fp16", scaler=DynamicLossScaler(init_scale="auto"), max_consecutive_skips=3)) == ""


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_non_finite_loss_advises_the_data_and_bf16(precision: str) -> None:
    hint = fit(MPTPrecision(precision, max_consecutive_skips=2), data=huge_inputs())
    if precision == "bf16":  # bf16's range holds the activations fp16 could not
        assert hint == ""
        return
    assert "the loss itself is inf/NaN: no loss scale changes that. Check the data and the loss" in hint
    assert "MPTPrecision('bf16')" in hint
