"""Dynamic loss scaling: a small state machine on Python floats (no Lightning, no device syncs of its own).

The trajectory rule, with ``hysteresis=1``, is the one of :class:`torch.amp.GradScaler`:

* a step whose gradients are non-finite multiplies the scale by ``backoff_factor`` and resets the count of
  consecutive clean steps;
* after ``growth_interval`` consecutive clean steps the scale is multiplied by ``growth_factor``.

With ``hysteresis=h > 1`` it is the rule of Megatron-LM's ``DynamicGradScaler`` (``megatron/core/optimizer/
grad_scaler.py``), step for step: a hysteresis tracker starts at h and every overflow decrements it; the scale
backs off on an overflow that leaves it ``<= 0``, so after h overflows every further overflow backs off until the
scale grows; a growth restores it to h. ``consecutive_hysteresis=True`` (DeepSpeed's option) also restores it
on every clean step, so that only consecutive overflows count. Every overflowing step is skipped by the caller.

The scale is a float32 value, as torch and Megatron-LM hold it: each change is computed in double precision and
rounded to float32, as ``torch._amp_update_scale_`` does. It never leaves ``[min_scale, max_scale]``, also after
:meth:`DynamicLossScaler.load_state_dict`. A scaler with ``min_scale == max_scale`` is a static scale.

``init_scale="auto"`` measures the first scale instead of guessing it. The first step's backward runs at the
*measuring scale*, 1.0 (brought into ``[min_scale, max_scale]``), where gradients of common models cannot overflow
fp16; the engine reads the largest unscaled gradient magnitude ``amax`` in the step's one host sync (all-reduced
across processes) and :meth:`DynamicLossScaler.choose` sets the largest power of two that keeps ``amax`` below the
format's largest finite value, divided by :data:`AUTO_MARGIN`. That first step is taken, not skipped, with the
gradients of scale 1.0 (small ones may flush in fp16 for that one step: docs/scaler.md measures it). From then on the
scaler is the one ``DynamicLossScaler(init_scale=<chosen>)`` would be after one clean step. A measuring step whose
gradients are non-finite backs the measuring scale off and measures again at the next step; so does one with no
nonzero gradient.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Union

from torch import Tensor

from lightning_mpt.core._scaler_checks import (
    CONFIG_KEYS,
    STATE_KEYS,
    check,
    checked_config,
    checked_state,
    f32,
    is_int,
    is_real,
)

#: ``init_scale="auto"`` keeps this factor below the largest safe scale it measured: later batches' gradients, and
#: activation gradients inside the backward, may exceed the first batch's largest parameter gradient
AUTO_MARGIN = 8.0


class DynamicLossScaler:
    """Loss scale that grows after a run of clean steps and backs off on overflow.

    Args:
        init_scale: the scale of the first step (``2**16`` as :class:`torch.amp.GradScaler`), rounded to float32;
            or ``"auto"``: measure it at the first step (see the module's docstring; fp16 only).
        growth_factor: factor applied after ``growth_interval`` clean steps; must be ``> 1``.
        backoff_factor: factor applied on an overflow that exhausts the hysteresis; must be in ``(0, 1)``.
        growth_interval: number of consecutive clean steps before the scale grows; ``>= 1``.
        hysteresis: overflows since the scale last grew before it backs off (Megatron-LM's ``hysteresis``);
            once they are spent, every overflow backs off until the next growth. ``>= 1``.
        consecutive_hysteresis: also restore the hysteresis on every clean step, so that only consecutive
            overflows count (DeepSpeed's ``consecutive_hysteresis``).
        min_scale: floor of the scale; ``> 0``. Rounded to float32, as the scale.
        max_scale: ceiling of the scale; ``>= min_scale`` (``math.inf`` for none). Rounded to float32.

    Example:
        ```python
        scaler = DynamicLossScaler(init_scale=1024, growth_interval=100, hysteresis=2)
        scaler.update(found_inf=True)   # first overflow: tolerated by hysteresis
        scaler.update(found_inf=True)   # second: backs off
        scaler.update(found_inf=True)   # the hysteresis is spent until the scale grows: backs off again
        assert scaler.get_scale() == 256.0 and scaler.hysteresis_tracker == -1
        ```
    """

    def __init__(
        self,
        init_scale: Union[float, Literal["auto"]] = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        *,
        consecutive_hysteresis: bool = False,
    ) -> None:
        config = checked_config(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
        )
        self._measuring = init_scale == "auto"
        if self._measuring:
            check(
                config["min_scale"] < config["max_scale"],
                f"init_scale='auto' needs room to choose: min_scale ({min_scale!r}) < max_scale ({max_scale!r})",
            )
            init_scale = min(max(1.0, config["min_scale"]), config["max_scale"])  # the measuring scale
        check(
            is_real(init_scale),
            f"init_scale must be a finite number > 0 or 'auto', got {init_scale!r}",
        )
        scale = f32(float(init_scale))
        check(
            math.isfinite(scale) and scale > 0,
            f"init_scale must be a finite number > 0 within float32's range, got {init_scale!r}",
        )
        check(
            config["min_scale"] <= scale <= config["max_scale"],
            f"init_scale ({init_scale!r}) must lie in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]",
        )
        self.growth_factor: float = config["growth_factor"]
        self.backoff_factor: float = config["backoff_factor"]
        self.growth_interval: int = config["growth_interval"]
        self.hysteresis: int = config["hysteresis"]
        self.consecutive_hysteresis: bool = config["consecutive_hysteresis"]
        self.min_scale: float = config["min_scale"]
        self.max_scale: float = config["max_scale"]
        self._scale = scale
        self._growth_tracker = 0
        self._hysteresis_tracker: int = self.hysteresis

    @classmethod
    def static(cls, scale: float) -> DynamicLossScaler:
        """A scaler that never changes: ``min_scale == max_scale == scale``.

        Example:
            ```python
            assert DynamicLossScaler.static(1024.0).is_static
            ```
        """
        return cls(init_scale=scale, min_scale=scale, max_scale=scale)

    @property
    def scale(self) -> float:
        """The scale in force now (a float32 value)."""
        return self._scale

    def get_scale(self) -> float:
        """The scale in force now (the name of :meth:`torch.amp.GradScaler.get_scale`)."""
        return self._scale

    @property
    def is_static(self) -> bool:
        """Whether the scale can never change (``min_scale == max_scale``)."""
        return self.min_scale == self.max_scale

    @property
    def measuring(self) -> bool:
        """Whether the scale is still to be measured (``init_scale="auto"`` before its first finite, nonzero
        gradients)."""
        return self._measuring

    def choose(self, amax: float, max_finite: float) -> float:
        """End the measurement: the largest power of two ``s`` with ``amax * s <= max_finite``, divided by
        :data:`AUTO_MARGIN` and brought into ``[min_scale, max_scale]``, becomes the scale. Returns it.

        Args:
            amax: the largest magnitude of the unscaled gradients (finite, > 0).
            max_finite: the half format's largest finite value (65504 for fp16).

        Example:
            ```python
            scaler = DynamicLossScaler(init_scale="auto")
            assert scaler.measuring and scaler.scale == 1.0
            assert scaler.choose(amax=0.01, max_finite=65504.0) == 2.0**22 / AUTO_MARGIN
            scaler.update(found_inf=False)  # the measuring step was clean: a fixed scaler's first step
            assert not scaler.measuring and scaler.growth_tracker == 1
            ```
        """
        check(
            is_real(amax) and math.isfinite(amax) and amax > 0,
            f"DynamicLossScaler.choose: amax must be a finite number > 0, got {amax!r}",
        )
        safe = 2.0 ** math.floor(math.log2(max_finite / amax)) / AUTO_MARGIN
        self._scale = min(max(f32(safe), self.min_scale), self.max_scale)
        self._measuring = False
        return self._scale

    @property
    def growth_tracker(self) -> int:
        """Consecutive clean steps since the last overflow or growth."""
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """``hysteresis`` minus the overflows since the last growth; the next overflow backs off if it is ``<= 1``.

        It goes below 0 in a run of overflows, as Megatron-LM's; with ``consecutive_hysteresis`` a clean step
        restores it to ``hysteresis``.
        """
        return self._hysteresis_tracker

    def update(self, found_inf: Union[bool, Tensor]) -> None:
        """Advance the state machine by one optimizer step.

        Args:
            found_inf: whether the step's gradients held a non-finite value (a bool or a 0-dim/1-element tensor;
                a tensor costs one host sync, so callers that already synced should pass a bool).
        """
        if isinstance(found_inf, Tensor):
            found_inf = bool(found_inf.item())
        if self._measuring:  # nothing measured: back the measuring scale off on an overflow, count nothing
            if found_inf:
                self._scale = max(f32(self._scale * self.backoff_factor), self.min_scale)
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(f32(self._scale * self.backoff_factor), self.min_scale)
            return
        if self.consecutive_hysteresis:
            self._hysteresis_tracker = self.hysteresis
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            grown = min(f32(self._scale * self.growth_factor), self.max_scale)
            if grown != math.inf:  # as GradScaler: a growth past float32's range is dropped
                self._scale = grown

    def state_dict(self) -> dict[str, Any]:
        """The scale, the trackers and the configuration.

        Example:
            ```python
            other = DynamicLossScaler()
            other.load_state_dict(DynamicLossScaler(init_scale=8.0).state_dict())
            assert other.scale == 8.0
            ```
        """
        state = {k: getattr(self, "_" + k) for k in STATE_KEYS}
        state.update({k: getattr(self, k) for k in CONFIG_KEYS})
        if self._measuring:  # a run saved before its scale was measured measures on resume
            state["measuring"] = True
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, or the state of a :class:`torch.amp.GradScaler`.

        The configuration keys present replace this scaler's; absent ones (``consecutive_hysteresis`` in state dicts
        of earlier versions; ``hysteresis``, ``min_scale`` and ``max_scale`` of a GradScaler, which has none) keep
        this scaler's values. A GradScaler state starts the hysteresis afresh. A scale outside ``[min_scale,
        max_scale]`` is brought to the nearer bound with a warning; a non-finite or non-positive scale, a missing key
        or an invalid value raises, and then nothing is changed.

        Args:
            state_dict: a dict from :meth:`state_dict` or :meth:`torch.amp.GradScaler.state_dict`.

        Raises:
            KeyError: a required key is missing.
            ValueError: a value is invalid.

        Example:
            ```python
            import warnings

            import torch

            scaler = DynamicLossScaler(max_scale=2.0**20)
            scaler.load_state_dict(torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=500).state_dict())
            assert scaler.scale == 1024.0 and scaler.growth_interval == 500 and scaler.max_scale == 2.0**20

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                scaler.load_state_dict(torch.amp.GradScaler("cpu", init_scale=2.0**30).state_dict())
            assert scaler.scale == 2.0**20 and "above max_scale" in str(caught[0].message)
            ```
        """
        state = checked_state(
            state_dict, {k: getattr(self, k) for k in CONFIG_KEYS}, f"{type(self).__name__}.load_state_dict"
        )
        for k in CONFIG_KEYS:
            setattr(self, k, state[k])
        self._scale = state["scale"]
        self._growth_tracker = state["growth_tracker"]
        self._hysteresis_tracker = state["hysteresis_tracker"]
        self._measuring = state["measuring"]

    def restore_state(self, state_dict: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Restore the scale and the trackers of ``state_dict`` and keep this scaler's configuration (a resumed run
        whose scaler was configured anew); returns the settings whose saved value differs, ``{name: (saved, kept)}``.

        The hysteresis tracker keeps its meaning, ``hysteresis`` minus the overflows since the last growth, with this
        scaler's ``hysteresis``. With the same configuration this is :meth:`load_state_dict`; otherwise its rules
        apply with this scaler's configuration (a scale outside its bounds is brought inside with a warning).

        Args:
            state_dict: a dict from :meth:`state_dict` or :meth:`torch.amp.GradScaler.state_dict`.

        Raises:
            KeyError: a required key is missing.
            ValueError: a value is invalid.

        Example:
            ```python
            saved = DynamicLossScaler(init_scale=1024.0, hysteresis=2)
            saved.update(found_inf=True)  # one overflow, tolerated by the hysteresis
            scaler = DynamicLossScaler(growth_interval=7, hysteresis=3)
            changed = scaler.restore_state(saved.state_dict())
            assert changed == {"growth_interval": (2000, 7), "hysteresis": (2, 3)}
            assert scaler.scale == 1024.0 and scaler.growth_interval == 7 and scaler.hysteresis_tracker == 2
            ```
        """
        name = f"{type(self).__name__}.restore_state"
        kept = {k: getattr(self, k) for k in CONFIG_KEYS}
        try:
            saved = checked_config(**{**kept, **{k: state_dict[k] for k in CONFIG_KEYS if k in state_dict}})
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name}: {error}") from None
        changed = {k: (saved[k], kept[k]) for k in CONFIG_KEYS if k in state_dict and saved[k] != kept[k]}
        state = {**state_dict, **kept}
        tracker = state_dict.get("hysteresis_tracker")
        if "_growth_tracker" not in state_dict and is_int(tracker) and tracker <= saved["hysteresis"]:
            state["hysteresis_tracker"] = self.hysteresis - (saved["hysteresis"] - tracker)
        self.load_state_dict(state)
        return changed

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={getattr(self, k)!r}" for k in CONFIG_KEYS)
        return f"{type(self).__name__}(scale={self._scale!r}, {cfg})"
