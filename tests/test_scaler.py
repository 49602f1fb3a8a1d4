"""DynamicLossScaler: step-for-step equality with torch.amp.GradScaler (hysteresis 1), Megatron-LM (hysteresis h) and
DeepSpeed (consecutive hysteresis), the float32 scale, bounds, static scale, state dicts."""

import math
import random
import warnings

import pytest
import torch
from deepspeed_reference import DeepSpeedDynamicScaler
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from megatron_reference import MegatronDynamicScaler
from models import TinyMLP, quiet_trainer, regression_data

from lightning_mpt import DynamicLossScaler, MPTPrecision


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


class TorchScaler:
    """A real ``torch.amp.GradScaler`` driven through its public API, one optimizer step per ``update``."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval):
        self.param = torch.nn.Parameter(torch.zeros(1))
        self.opt = torch.optim.SGD([self.param], lr=0.0)
        self.scaler = torch.amp.GradScaler(
            "cpu",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )

    def update(self, overflow: bool) -> tuple[float, int]:
        """The scale and growth tracker after a step with or without an overflow."""
        self.scaler.scale(torch.ones(()))  # the scale tensor is created lazily on first use
        self.param.grad = torch.full((1,), math.inf if overflow else 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        return self.scaler.get_scale(), self.scaler.state_dict()["_growth_tracker"]


def gradscaler_trajectory(pattern, init_scale, growth_factor, backoff_factor, growth_interval):
    """``(scale, growth tracker)`` after each step of a real ``torch.amp.GradScaler``."""
    ref = TorchScaler(init_scale, growth_factor, backoff_factor, growth_interval)
    return [ref.update(overflow) for overflow in pattern]


def our_trajectory(scaler, pattern):
    out = []
    for overflow in pattern:
        scaler.update(overflow)
        out.append((scaler.scale, scaler.growth_tracker))
    return out


def runs_to_pattern(runs):
    """``[(overflows, clean steps), ...]`` -> flags: storms and calms, which plain random booleans rarely give."""
    return [flag for overflows, clean in runs for flag in [True] * overflows + [False] * clean]


runs = st.lists(st.tuples(st.integers(0, 8), st.integers(0, 20)), min_size=1, max_size=25)

# --------------------------------------------------------------------------------------- torch.amp.GradScaler (h=1)


@settings(max_examples=300, deadline=None)
@given(
    pattern=st.lists(st.booleans(), min_size=1, max_size=80),
    init_scale=st.floats(min_value=1.0, max_value=2.0**24),
    growth_factor=st.sampled_from([2.0, 4.0, 1.5, 3.0, 1.1, 1.0001]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.125, 0.7, 0.9, 0.3]),
    growth_interval=st.integers(min_value=1, max_value=6),
    consecutive_hysteresis=st.booleans(),  # no effect with hysteresis=1
)
def test_trajectory_equals_gradscaler(
    pattern, init_scale, growth_factor, backoff_factor, growth_interval, consecutive_hysteresis
):
    expected = gradscaler_trajectory(pattern, init_scale, growth_factor, backoff_factor, growth_interval)
    assume(all(scale > 0 for scale, _ in expected))  # GradScaler has no floor; ours is float32's smallest
    ours = DynamicLossScaler(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        consecutive_hysteresis=consecutive_hysteresis,
        min_scale=2.0**-149,
        max_scale=math.inf,  # GradScaler has no ceiling either: a growth to inf is dropped by both
    )
    assert our_trajectory(ours, pattern) == expected


@pytest.mark.parametrize(("growth_factor", "backoff_factor"), [(1.5, 0.7), (1.1, 0.9), (3.0, 0.3)])
def test_non_power_of_two_factors_give_gradscalers_float32_values_bit_for_bit(growth_factor, backoff_factor):
    """Long runs whose every change rounds: a double-precision scale drifts from torch's float32 one."""
    rng = random.Random(f"{growth_factor}/{backoff_factor}")
    ref = TorchScaler(2.0**16, growth_factor, backoff_factor, 1)
    ours = DynamicLossScaler(
        growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=1, min_scale=2.0**-126,
        max_scale=math.inf,
    )  # fmt: skip
    seen = set()
    for step in range(2000):
        # overflows more likely at higher scales, as in training: the walk stays far from float32's limits
        overflow = rng.random() < (0.8 if ours.scale > 2.0**20 else 0.2 if ours.scale < 2.0**4 else 0.45)
        expected = ref.update(overflow)
        ours.update(overflow)
        assert (ours.scale, ours.growth_tracker) == expected, step
        seen.add(ours.scale)
    assert len(seen) > 100


def test_default_configuration_is_gradscalers():
    s = DynamicLossScaler()
    ref = torch.amp.GradScaler("cpu")
    assert s.scale == ref.get_scale() == 65536.0
    assert (s.growth_factor, s.backoff_factor, s.growth_interval) == (2.0, 0.5, 2000)
    assert s.get_scale() == s.scale
    assert (s.hysteresis, s.consecutive_hysteresis) == (1, False)


def test_update_accepts_tensor_flags():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=1)
    s.update(torch.tensor(1.0))
    assert s.scale == 4.0
    s.update(torch.tensor([0.0]))
    assert s.scale == 8.0


# ------------------------------------------------------------------------------------------------ float32 scale


def test_the_scale_is_a_float32_value_held_in_a_python_float():
    s = DynamicLossScaler(init_scale=0.1, growth_factor=1.1, growth_interval=1, min_scale=0.1, max_scale=10.0)
    assert type(s.scale) is float
    assert s.scale == f32(0.1) != 0.1
    assert (s.min_scale, s.max_scale) == (f32(0.1), f32(10.0))
    expected = f32(0.1)
    for _ in range(10):
        s.update(False)
        expected = f32(expected * 1.1)  # GradScaler's rule: the product in double, rounded to float32
        assert s.scale == expected
    assert DynamicLossScaler.static(0.1).scale == f32(0.1)


def test_growth_past_float32_range_is_dropped_as_gradscaler_does():
    big = 2.0**127
    expected = gradscaler_trajectory([False] * 3, big, 2.0, 0.5, 1)
    s = DynamicLossScaler(init_scale=big, growth_interval=1, max_scale=math.inf)
    assert our_trajectory(s, [False] * 3) == expected == [(big, 0)] * 3


@pytest.mark.parametrize("init_scale", [1e39, 2.0**128])
def test_init_scale_beyond_float32_is_refused(init_scale):
    with pytest.raises(ValueError, match="init_scale must be a finite number > 0 within float32's range"):
        DynamicLossScaler(init_scale=init_scale, max_scale=math.inf)


# ------------------------------------------------------------------------------------ Megatron-LM's rule (h >= 1)


@settings(max_examples=1000, deadline=None)
@given(
    runs=runs,
    hysteresis=st.integers(min_value=1, max_value=6),
    growth_interval=st.integers(min_value=1, max_value=8),
    growth_factor=st.one_of(st.sampled_from([2.0, 1.5, 4.0]), st.floats(min_value=1.001, max_value=4.0)),
    backoff_factor=st.one_of(st.sampled_from([0.5, 0.25, 0.7]), st.floats(min_value=0.05, max_value=0.99)),
    init_scale=st.floats(min_value=1.0, max_value=2.0**20),
    min_fraction=st.floats(min_value=2.0**-30, max_value=1.0),
)
def test_equals_megatron_step_for_step(
    runs, hysteresis, growth_interval, growth_factor, backoff_factor, init_scale, min_fraction
):
    min_scale = init_scale * min_fraction
    megatron = MegatronDynamicScaler(init_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis)
    ours = DynamicLossScaler(
        init_scale=init_scale,
        growth_factor=f32(growth_factor),  # Megatron holds its factors in float32 tensors; GradScaler in doubles
        backoff_factor=f32(backoff_factor),
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=math.inf,
    )
    assert ours.scale == megatron.scale
    for step, overflow in enumerate(runs_to_pattern(runs)):
        before = ours.scale
        megatron.update(overflow)
        ours.update(overflow)
        trackers = (ours.growth_tracker, ours.hysteresis_tracker)
        assert trackers == (megatron.growth_tracker, megatron.hysteresis_tracker), step
        if megatron.scale == math.inf:  # Megatron grows into inf; ours drops that growth, as GradScaler does
            assert ours.scale == before
            return
        assert ours.scale == megatron.scale, step
        assert ours.min_scale <= ours.scale


def test_overflow_storm_backs_off_on_every_overflow_once_the_hysteresis_is_spent():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=100, hysteresis=2)
    scales, trackers = [], []
    for _ in range(5):
        s.update(True)
        scales.append(s.scale)
        trackers.append(s.hysteresis_tracker)
    assert scales == [1024.0, 512.0, 256.0, 128.0, 64.0]
    assert trackers == [1, 0, -1, -2, -3]


def test_hysteresis_is_restored_only_when_the_scale_grows():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=3, hysteresis=3)
    for _ in range(3):
        s.update(True)
    assert s.scale == 512.0
    assert s.hysteresis_tracker == 0
    s.update(False)
    s.update(False)
    s.update(True)  # clean steps do not restore it, an overflow resets the clean-step count: back off again
    assert s.scale == 256.0
    assert (s.growth_tracker, s.hysteresis_tracker) == (0, -1)
    for _ in range(3):
        s.update(False)
    assert s.scale == 512.0
    assert s.hysteresis_tracker == 3
    s.update(True)
    assert s.scale == 512.0
    assert s.hysteresis_tracker == 2


def test_a_growth_capped_at_max_scale_still_restores_the_hysteresis():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=1, hysteresis=2, max_scale=8.0, min_scale=1.0)
    s.update(True)
    s.update(True)
    assert s.scale == 4.0
    assert s.hysteresis_tracker == 0
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    assert s.hysteresis_tracker == 2


# ------------------------------------------------------------------------------------- DeepSpeed's hysteresis


@settings(max_examples=300, deadline=None)
@given(
    runs=runs,
    hysteresis=st.integers(min_value=1, max_value=6),
    consecutive_hysteresis=st.booleans(),
    init_exp=st.integers(min_value=0, max_value=32),
    min_exp=st.integers(min_value=-20, max_value=0),
)
def test_equals_deepspeed_step_for_step_between_growths(runs, hysteresis, consecutive_hysteresis, init_exp, min_exp):
    """With no growth in the run, DeepSpeed's scales are ours step for step, for both hysteresis modes.

    DeepSpeed's hysteresis stays at 1 where ours (Megatron's) goes on falling: they agree up to that floor.
    """
    pattern = runs_to_pattern(runs)
    min_scale = 2.0 ** (init_exp + min_exp)
    deepspeed = DeepSpeedDynamicScaler(2.0**init_exp, len(pattern) + 1, min_scale, hysteresis, consecutive_hysteresis)
    ours = DynamicLossScaler(
        init_scale=2.0**init_exp,
        growth_interval=len(pattern) + 1,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        min_scale=min_scale,
        max_scale=math.inf,
    )
    for step, overflow in enumerate(pattern):
        deepspeed.update_scale(overflow)
        ours.update(overflow)
        assert (ours.scale, max(ours.hysteresis_tracker, 1)) == (deepspeed.scale, deepspeed.hysteresis_left), step


@settings(max_examples=300, deadline=None)
@given(
    runs=runs,
    hysteresis=st.integers(min_value=1, max_value=6),
    growth_interval=st.integers(min_value=1, max_value=8),
)
def test_consecutive_hysteresis_backs_off_when_deepspeed_does(runs, hysteresis, growth_interval):
    """With growths too: the hysteresis, so every back-off decision, is DeepSpeed's at every step.

    The scales differ only where the growths do: DeepSpeed's first growth after an overflow waits one clean step more.
    """
    deepspeed = DeepSpeedDynamicScaler(2.0**20, growth_interval, 2.0**-100, hysteresis, consecutive_hysteresis=True)
    ours = DynamicLossScaler(
        init_scale=2.0**20,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        consecutive_hysteresis=True,
        min_scale=2.0**-100,
        max_scale=math.inf,
    )
    for step, overflow in enumerate(runs_to_pattern(runs)):
        before = ours.scale
        deepspeed.update_scale(overflow)
        ours.update(overflow)
        assert max(ours.hysteresis_tracker, 1) == deepspeed.hysteresis_left, step
        if overflow:
            assert (ours.scale < before) == (ours.hysteresis_tracker <= 0), step


def test_consecutive_hysteresis_counts_only_overflows_in_a_row():
    plain = DynamicLossScaler(init_scale=1024.0, growth_interval=100, hysteresis=2)
    consecutive = DynamicLossScaler(init_scale=1024.0, growth_interval=100, hysteresis=2, consecutive_hysteresis=True)
    for s in (plain, consecutive):
        for overflow in [True, False, True, False, True, True]:
            s.update(overflow)
    assert plain.scale == 128.0  # the 2nd, 3rd and 4th overflows back off
    assert consecutive.scale == 512.0
    assert consecutive.hysteresis_tracker == 0


def test_deepspeed_reference_waits_one_more_clean_step_for_its_first_growth():
    """What the docs say of DeepSpeed's window, checked on the transcription."""
    deepspeed = DeepSpeedDynamicScaler(1.0, 3, 1.0, 2, consecutive_hysteresis=False)
    scales = []
    for overflow in [False] * 7 + [True, True] + [False] * 4:
        deepspeed.update_scale(overflow)
        scales.append(deepspeed.scale)
    assert scales == [1, 1, 1, 2, 2, 2, 4, 4, 2, 2, 2, 2, 4]


# --------------------------------------------------------------------------------------------------------- bounds


@settings(max_examples=200, deadline=None)
@given(
    runs=runs,
    hysteresis=st.integers(min_value=1, max_value=4),
    consecutive_hysteresis=st.booleans(),
    growth_factor=st.floats(min_value=1.001, max_value=8.0),
    backoff_factor=st.floats(min_value=0.01, max_value=0.99),
    low=st.floats(min_value=1e-3, max_value=1e3),
    span=st.floats(min_value=1.0, max_value=1e6),
    init_fraction=st.floats(min_value=0.0, max_value=1.0),
)
def test_the_scale_never_leaves_the_bounds(
    runs, hysteresis, consecutive_hysteresis, growth_factor, backoff_factor, low, span, init_fraction
):
    high = low * span
    s = DynamicLossScaler(
        init_scale=min(max(low + init_fraction * (high - low), low), high),
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=2,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        min_scale=low,
        max_scale=high,
    )
    for overflow in runs_to_pattern(runs):
        s.update(overflow)
        assert s.min_scale <= s.scale <= s.max_scale
        assert s.scale == f32(s.scale)


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
    assert s.is_static
    assert not DynamicLossScaler().is_static
    for flag in [True, False, False, True, True] + [False] * 5000:
        s.update(flag)
        assert s.scale == 1024.0


# ---------------------------------------------------------------------------------------------------- state dicts


def test_state_dict_round_trip_mid_interval():
    a = DynamicLossScaler(
        init_scale=256.0, growth_interval=5, hysteresis=2, min_scale=0.5, max_scale=2.0**20, consecutive_hysteresis=True
    )
    for flag in [False, False, True, False, True, False, False]:
        a.update(flag)
    state = a.state_dict()
    assert state["consecutive_hysteresis"] is True
    b = DynamicLossScaler()  # different config: the state dict carries it
    b.load_state_dict(state)
    assert b.state_dict() == state
    for flag in [False, False, False, True, True, True, False] * 3:
        a.update(flag)
        b.update(flag)
        assert (a.scale, a.growth_tracker, a.hysteresis_tracker) == (b.scale, b.growth_tracker, b.hysteresis_tracker)


def test_loads_a_state_dict_of_an_earlier_version():
    old = {
        "scale": 512.0, "growth_tracker": 3, "hysteresis_tracker": 1, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 10, "hysteresis": 2, "min_scale": 1.0, "max_scale": 2.0**24,
    }  # fmt: skip
    s = DynamicLossScaler(consecutive_hysteresis=True)
    s.load_state_dict(old)
    assert (s.scale, s.growth_tracker, s.hysteresis_tracker, s.hysteresis) == (512.0, 3, 1, 2)
    assert s.consecutive_hysteresis  # not in the old state: this scaler's setting stays


def test_loads_a_gradscaler_state_dict_and_keeps_its_own_bounds_and_hysteresis():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    ref = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    for _ in range(2):  # two clean steps: the growth tracker is carried over
        ref.scale(torch.ones(()))
        param.grad = torch.ones(1)
        ref.step(opt)
        ref.update()
    s = DynamicLossScaler(hysteresis=3, min_scale=2.0, max_scale=2.0**20)
    s.update(True)
    s.load_state_dict(ref.state_dict())
    assert (s.scale, s.growth_tracker, s.growth_interval) == (512.0, 2, 7)
    assert (s.hysteresis, s.hysteresis_tracker, s.min_scale, s.max_scale) == (3, 3, 2.0, 2.0**20)


def test_restore_state_keeps_the_configuration_and_the_overflows_since_the_last_growth():
    saved = DynamicLossScaler(init_scale=512.0, growth_interval=10, hysteresis=3)
    for flag in [False, True, True, False]:  # 2 overflows since the last growth, none backed off
        saved.update(flag)
    state = saved.state_dict()
    for hysteresis, tracker in [(3, 1), (5, 3), (2, 0), (1, -1)]:
        s = DynamicLossScaler(growth_interval=4, hysteresis=hysteresis)
        changed = s.restore_state(state)
        assert changed == {"growth_interval": (10, 4), **({"hysteresis": (3, hysteresis)} if hysteresis != 3 else {})}
        assert (s.scale, s.growth_tracker, s.growth_interval) == (512.0, 1, 4)
        assert (s.hysteresis, s.hysteresis_tracker) == (hysteresis, tracker)
    same = DynamicLossScaler(growth_interval=10, hysteresis=3)
    assert same.restore_state(state) == {}
    assert same.state_dict() == state


def fit_and_save(tmp_path, scaler: DynamicLossScaler) -> tuple[str, float]:
    """3 steps of a real fit with ``scaler`` (the first overflow at 2^20), then a checkpoint; its path and scale."""
    trainer = quiet_trainer(plugins=[MPTPrecision("fp16", scaler=scaler)], max_steps=3)
    trainer.fit(TinyMLP(), regression_data())
    path = str(tmp_path / "three.ckpt")
    trainer.save_checkpoint(path)
    return path, trainer.precision_plugin.loss_scale


def resume(path: str, scaler: DynamicLossScaler) -> tuple[MPTPrecision, list[str]]:
    plugin = MPTPrecision("fp16", scaler=scaler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(plugins=[plugin], max_steps=4).fit(TinyMLP(), regression_data(), ckpt_path=path)
    return plugin, [str(w.message) for w in caught if "loss scaler" in str(w.message)]


def test_a_resumed_run_keeps_its_new_scaler_configuration_and_says_what_changed(tmp_path):
    """A scaler configured anew on resume is in force, with the checkpoint's scale; the warning names each changed
    setting with both values and says which is in force."""
    path, scale = fit_and_save(tmp_path, DynamicLossScaler(init_scale=2.0**20))
    plugin, said = resume(path, DynamicLossScaler(growth_interval=7, hysteresis=3))
    assert (plugin.scaler.growth_interval, plugin.scaler.hysteresis) == (7, 3)
    assert plugin.history[0].scale == scale  # the first resumed step ran at the saved scale
    (message,) = said
    assert "growth_interval 2000 in the checkpoint, 7 now; hysteresis 1 in the checkpoint, 3 now" in message
    assert "The new configuration is in force" in message
    assert "scaler=DynamicLossScaler(growth_interval=2000, hysteresis=1, ...)" in message


def test_a_resumed_run_with_the_same_scaler_configuration_says_nothing(tmp_path):
    path, scale = fit_and_save(tmp_path, DynamicLossScaler(init_scale=2.0**20, growth_interval=7))
    plugin, said = resume(path, DynamicLossScaler(init_scale=4.0, growth_interval=7))  # init_scale is not config
    assert said == []
    assert plugin.history[0].scale == scale


@pytest.mark.parametrize(
    ("scale", "side", "used"), [(2.0**30, "above max_scale", 2.0**20), (0.25, "below min_scale", 2.0)]
)
@pytest.mark.parametrize("source", ["ours", "gradscaler"])
def test_a_loaded_scale_outside_the_bounds_is_brought_inside_with_a_warning(scale, side, used, source):
    if source == "ours":
        state = DynamicLossScaler(init_scale=scale, min_scale=0.125, max_scale=2.0**40).state_dict()
        state.update(min_scale=2.0, max_scale=2.0**20)  # a hand-edited checkpoint: its scale is out of its bounds
    else:
        state = torch.amp.GradScaler("cpu", init_scale=scale).state_dict()
    s = DynamicLossScaler(min_scale=2.0, max_scale=2.0**20)
    with pytest.warns(UserWarning, match=rf"loaded scale {scale!r} is {side} \({used!r}\); using {used!r}") as caught:
        s.load_state_dict(state)
    assert caught[0].filename == __file__  # points at the caller
    assert s.scale == used
    assert (s.min_scale, s.max_scale) == (2.0, 2.0**20)


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, 0.0, -1.0, 1e39, 1e-50])
def test_load_state_dict_rejects_a_non_finite_or_non_positive_scale(scale):
    s = DynamicLossScaler(init_scale=8.0)
    state = s.state_dict()
    with pytest.raises(ValueError, match=r"scale must be a finite number > 0 within float32's range, got"):
        s.load_state_dict({**state, "scale": scale})
    assert s.state_dict() == state  # nothing changed


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        ({}, KeyError, r"the state dict is empty .* accepted: a dict from DynamicLossScaler.state_dict\(\)"),
        ({"growth_factor": 2.0}, KeyError, r"missing keys \['scale', 'growth_tracker'\].* accepted:"),
        ({"_growth_tracker": 0, "scale": 8.0}, KeyError, r"missing keys \['growth_factor', .*torch.amp.GradScaler"),
        ({"scale": "big", "growth_tracker": 0}, ValueError, "scale must be a number, got 'big'"),
        ({"scale": 8.0, "growth_tracker": -1}, ValueError, "growth_tracker must be an int >= 0, got -1"),
        ({"scale": 8.0, "growth_tracker": 0, "hysteresis_tracker": 5}, ValueError, r"<= hysteresis \(1\), got 5"),
        ({"scale": 8.0, "growth_tracker": 0, "backoff_factor": 2.0}, ValueError, r"backoff_factor must be in"),
        ({"scale": 8.0, "growth_tracker": 0, "min_scale": 4.0, "max_scale": 2.0}, ValueError, "must not exceed"),
    ],
)
def test_load_state_dict_says_what_was_wrong_and_what_is_accepted(state, error, message):
    s = DynamicLossScaler(init_scale=16.0)
    before = s.state_dict()
    with pytest.raises(error, match=message):
        s.load_state_dict(state)
    assert s.state_dict() == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 0.0}, "init_scale must be a finite number > 0"),
        ({"init_scale": -1.0}, "init_scale must be a finite number > 0"),
        ({"init_scale": math.inf}, "init_scale must be a finite number > 0"),
        ({"init_scale": "1"}, "init_scale must be a finite number > 0"),
        ({"growth_factor": 1.0}, "growth_factor must be a finite number > 1"),
        ({"growth_factor": 0.5}, "growth_factor must be a finite number > 1"),
        ({"backoff_factor": 0.0}, r"backoff_factor must be in the open interval \(0, 1\)"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in the open interval \(0, 1\)"),
        ({"backoff_factor": 1.5}, r"backoff_factor must be in the open interval \(0, 1\)"),
        ({"growth_interval": 0}, "growth_interval must be an int >= 1"),
        ({"growth_interval": 2.5}, "growth_interval must be an int >= 1"),
        ({"hysteresis": 0}, "hysteresis must be an int >= 1"),
        ({"consecutive_hysteresis": 1}, "consecutive_hysteresis must be a bool"),
        ({"min_scale": 0.0}, "min_scale must be a finite number > 0"),
        (
            {"min_scale": 1e-50, "init_scale": 1.0},
            r"min_scale must be a finite number > 0 that float32 does not round to 0",
        ),
        (
            {"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0},
            r"min_scale \(8.0\) must not exceed max_scale \(4.0\)",
        ),
        ({"init_scale": 2.0**30}, r"init_scale .* must lie in \[min_scale, max_scale\]"),
    ],
)
def test_bad_arguments_say_what_is_accepted(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)


def test_repr_names_the_configuration():
    text = repr(DynamicLossScaler(hysteresis=2, consecutive_hysteresis=True))
    assert "scale=65536.0" in text
    assert "hysteresis=2" in text
    assert "consecutive_hysteresis=True" in text
