"""The framework-free core on its own, in plain torch loops (no Lightning): ``StepPolicy`` (decide, sync, guard,
counters, state) and ``MixedPrecisionEngine`` (masters, scale, step or skip)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_mpt import DynamicLossScaler, NonFiniteGradientError
from lightning_mpt.core.engine import MixedPrecisionEngine
from lightning_mpt.core.policy import StepPolicy

# ---------------------------------------------------------------------------------------------------- StepPolicy


def test_sync_reads_the_flags_and_extra_values_in_one_go():
    policy = StepPolicy(DynamicLossScaler(init_scale=8.0), max_consecutive_skips=3)
    policy.scale_loss(torch.tensor(1.0))
    assert policy.sync(torch.tensor(0.0), extra=torch.tensor([1.0, 0.0])) == (False, True, [1.0, 0.0])
    policy.scale_loss(torch.tensor(math.nan))
    assert policy.sync(torch.tensor(2.0)) == (True, False, [])
    assert policy.sync(None) == (False, True, [])  # nothing to read: no sync at all
    assert policy.steps == 0
    assert not policy.history


def test_record_backs_off_and_counts_per_optimizer():
    policy = StepPolicy(DynamicLossScaler(init_scale=8.0, growth_interval=100), max_consecutive_skips=2)
    policy.scale_loss(torch.tensor(1.0))
    record = policy.record(True, optimizer=1)
    assert record.skipped
    assert record.scale == 8.0
    assert record.optimizer == 1
    assert policy.loss_scale == 4.0
    assert policy.skipped_steps == 1
    assert policy.consecutive == {1: 1}
    policy.check_guard(record)  # 1 of 2
    policy.record(False, optimizer=0)
    policy.stepped(0)  # another optimizer's clean step does not reset optimizer 1's count
    record = policy.record(True, optimizer=1)
    with pytest.raises(NonFiniteGradientError, match=r"2 optimizer steps in a row were skipped \(optimizer 1\)"):
        policy.check_guard(record)


def test_guard_at_the_minimum_scale_names_the_culprits_lazily():
    policy = StepPolicy(DynamicLossScaler(init_scale=2.0, min_scale=2.0), max_consecutive_skips=50)
    policy.scale_loss(torch.tensor(1.0))
    record = policy.record(True)
    record.blame(["a", "b", "c"], torch.tensor([False, True, False]))
    with pytest.raises(NonFiniteGradientError, match=r"minimum loss scale \(2\)") as err:
        policy.check_guard(record)
    assert "non-finite gradients: b\n" in str(err.value)
    assert record.nonfinite_params == ["b"]


def test_a_static_scale_has_no_floor_to_reach():
    policy = StepPolicy(DynamicLossScaler.static(4.0), max_consecutive_skips=3)
    for _ in range(2):
        policy.check_guard(policy.record(True))
    assert policy.loss_scale == 4.0


def test_state_round_trip_and_the_old_single_counter_format():
    policy = StepPolicy(DynamicLossScaler(init_scale=16.0), max_consecutive_skips=5)
    policy.scale_loss(torch.tensor(1.0))
    policy.record(True, optimizer=2)
    other = StepPolicy(DynamicLossScaler(), max_consecutive_skips=5)
    assert other.load_state_dict(policy.state_dict()) is None
    assert other.loss_scale == 8.0
    assert other.consecutive == {0: 0, 1: 0, 2: 1}
    assert other.steps == 1
    other.load_state_dict({
        "scaler": policy.scaler.state_dict(),
        "skipped_steps": 3,
        "consecutive_skips": 2,
        "steps": 7,
    })
    assert other.consecutive == {0: 2}
    assert other.skipped_steps == 3
    assert "without a loss scaler" in StepPolicy(DynamicLossScaler(), 5).load_state_dict({"scaler": None})


# ---------------------------------------------------------------------------------------------------- the engine


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))


def batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(n)]


def loop(engine: MixedPrecisionEngine, model: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype, inject=()):
    """A plain torch training loop on the engine; returns the fp32 master gradients each step was taken with."""
    stepped = []
    for i, (x, y) in enumerate(batches()):
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        engine.scale_loss(loss).backward()
        if i in inject:
            model[0].weight.grad.view(-1)[0] = math.inf
        pending = engine.decide(opt)
        if not pending.skipped:
            stepped.append([engine.masters.master_of(p).grad.clone() for p in model.parameters()])
        engine.finish(opt, pending)
        opt.zero_grad()
    return stepped


def test_bf16_loop_tracks_fp32():
    ref = mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in batches():
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    model = mlp()
    engine = MixedPrecisionEngine(torch.bfloat16)
    engine.convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loop(engine, model, opt, torch.bfloat16)
    engine.restore()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, r, rtol=0, atol=3e-2)


def test_fp16_static_scale_masters_equal_an_fp32_replay_and_skips_change_nothing():
    model = mlp()
    start = [p.detach().clone() for p in model.parameters()]
    engine = MixedPrecisionEngine(torch.float16, DynamicLossScaler.static(256.0))
    engine.convert(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    stepped = loop(engine, model, opt, torch.float16, inject={2})
    assert [r.skipped for r in engine.policy.history] == [False, False, True, False, False, False]
    assert len(stepped) == 5
    assert opt.state[model[0].weight]["step"].item() == 5
    replica = [nn.Parameter(t) for t in start]
    ref = torch.optim.Adam(replica, lr=1e-2)
    for grads in stepped:
        for p, g in zip(replica, grads):
            p.grad = g
        ref.step()
    for p, r in zip(model.parameters(), replica):
        assert torch.equal(engine.masters.master_of(p), r)


def test_step_in_closure_runs_lbfgs_on_the_masters():
    model = mlp()
    engine = MixedPrecisionEngine(torch.bfloat16)
    engine.convert(model)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = batches(1)[0]
    evaluations = []

    def closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        engine.scale_loss(loss).backward()
        evaluations.append(loss.item())
        return loss

    for _ in range(3):
        engine.step_in_closure(opt, closure, after=lambda: None)
    assert len(evaluations) > 3
    assert evaluations[-1] < 0.8 * evaluations[0]
    assert engine.policy.steps == 3
    assert all(m.dtype == torch.float32 for _, _, m in engine.masters.named_masters())
