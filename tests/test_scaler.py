"""DynamicLossScaler: GradScaler's trajectory (property test), hysteresis, bounds, static scale, state round trip."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mpt import DynamicLossScaler


def gradscaler_trajectory(pattern, init_scale, growth_factor, backoff_factor, growth_interval):
    """Scales after each step of a real ``torch.amp.GradScaler`` driven through its public API."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    out = []
    for overflow in pattern:
        scaler.scale(torch.ones(()))  # the scale tensor is created lazily on first use
        param.grad = torch.full((1,), math.inf if overflow else 1.0)
        scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
    return out


@settings(max_examples=60, deadline=None)
@given(
    pattern=st.lists(st.booleans(), min_size=1, max_size=60),
    init_exp=st.integers(min_value=0, max_value=24),
    growth_factor=st.sampled_from([2.0, 4.0, 8.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.125]),
    growth_interval=st.integers(min_value=1, max_value=6),
)
def test_trajectory_equals_gradscaler(pattern, init_exp, growth_factor, backoff_factor, growth_interval):
    init = 2.0**init_exp
    expected = gradscaler_trajectory(pattern, init, growth_factor, backoff_factor, growth_interval)
    ours = DynamicLossScaler(
        init_scale=init,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=2.0**-126,  # GradScaler has no bounds
        max_scale=math.inf,
    )
    got = []
    for overflow in pattern:
        ours.update(overflow)
        got.append(ours.scale)
    assert got == expected


def test_default_configuration_is_gradscalers():
    s = DynamicLossScaler()
    ref = torch.amp.GradScaler("cpu")
    assert s.scale == ref.get_scale() == 65536.0
    assert (s.growth_factor, s.backoff_factor, s.growth_interval) == (2.0, 0.5, 2000)
    assert s.get_scale() == s.scale


def test_update_accepts_tensor_flags():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=1)
    s.update(torch.tensor(1.0))
    assert s.scale == 4.0
    s.update(torch.tensor([0.0]))
    assert s.scale == 8.0


def test_hysteresis_backs_off_on_the_hth_overflow_since_the_last_change():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=3, hysteresis=3)
    for _ in range(2):
        s.update(True)
    assert s.scale == 1024.0 and s.hysteresis_tracker == 1
    s.update(True)  # third overflow since the start: back off
    assert s.scale == 512.0 and s.hysteresis_tracker == 3
    s.update(True)  # first overflow since that change: tolerated
    assert s.scale == 512.0
    s.update(False)
    s.update(True)  # overflow also resets the clean-step count
    assert s.scale == 512.0 and s.growth_tracker == 0
    s.update(True)  # third overflow since the last change
    assert s.scale == 256.0
    for _ in range(3):
        s.update(False)
    assert s.scale == 512.0 and s.hysteresis_tracker == 3  # growth is a change too


def test_bounds_are_never_left():
    s = DynamicLossScaler(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=16.0)
    for _ in range(5):
        s.update(False)
    assert s.scale == 16.0
    for _ in range(6):
        s.update(True)
    assert s.scale == 2.0
    s.update(False)
    assert s.scale == 4.0


def test_static_scale_never_changes():
    s = DynamicLossScaler.static(1024.0)
    assert s.is_static and not DynamicLossScaler().is_static
    for flag in [True, False, False, True, True] + [False] * 5000:
        s.update(flag)
        assert s.scale == 1024.0


def test_state_dict_round_trip_mid_interval():
    a = DynamicLossScaler(init_scale=256.0, growth_interval=5, hysteresis=2, min_scale=0.5, max_scale=2.0**20)
    for flag in [False, False, True, False, True, False, False]:
        a.update(flag)
    state = a.state_dict()
    b = DynamicLossScaler()  # different config: the state dict carries it
    b.load_state_dict(state)
    assert b.state_dict() == state
    for flag in [False, False, False, True, True, True, False] * 3:
        a.update(flag)
        b.update(flag)
        assert (a.scale, a.growth_tracker, a.hysteresis_tracker) == (b.scale, b.growth_tracker, b.hysteresis_tracker)


def test_loads_a_gradscaler_state_dict():
    ref = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    ref.scale(torch.ones(()))
    s = DynamicLossScaler()
    s.load_state_dict(ref.state_dict())
    assert s.scale == 512.0 and s.growth_interval == 7


def test_load_state_dict_names_missing_keys():
    with pytest.raises(KeyError, match="missing keys"):
        DynamicLossScaler().load_state_dict({"growth_factor": 2.0})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 0.0}, "init_scale must be a finite number > 0"),
        ({"init_scale": -1.0}, "init_scale must be a finite number > 0"),
        ({"init_scale": math.inf}, "init_scale must be a finite number > 0"),
        ({"growth_factor": 1.0}, "growth_factor must be a finite number > 1"),
        ({"growth_factor": 0.5}, "growth_factor must be a finite number > 1"),
        ({"backoff_factor": 0.0}, r"backoff_factor must be in the open interval \(0, 1\)"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in the open interval \(0, 1\)"),
        ({"backoff_factor": 1.5}, r"backoff_factor must be in the open interval \(0, 1\)"),
        ({"growth_interval": 0}, "growth_interval must be an int >= 1"),
        ({"growth_interval": 2.5}, "growth_interval must be an int >= 1"),
        ({"hysteresis": 0}, "hysteresis must be an int >= 1"),
        ({"min_scale": 0.0}, "min_scale must be a finite number > 0"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, r"min_scale \(8.0\) must not exceed max_scale \(4.0\)"),
        ({"init_scale": 2.0**30}, r"init_scale .* must lie in \[min_scale, max_scale\]"),
    ],
)
def test_bad_arguments_say_what_is_accepted(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)
