"""Megatron-LM's dynamic loss scale rule, transcribed as the reference of the property tests in test_scaler.py.

Read from NVIDIA/Megatron-LM, ``megatron/core/optimizer/grad_scaler.py``, class ``DynamicGradScaler``
(``__init__`` and ``update``), at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553; the file last changed in
a025a69a4a69abbd6b87da02744947d6187d8d40. This is a transcription of the rule, not a copy of the code.

Megatron keeps the scale, ``min_scale`` and both factors in 1-element float32 CUDA tensors, so a back-off is a
float32 multiply followed by a float32 maximum, and a growth a float32 multiply with no upper bound. Here they are
float32 CPU tensors, which round the same way. The trackers are Python ints; the hysteresis tracker has no floor.
"""

from __future__ import annotations

import torch


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


class MegatronDynamicScaler:
    """The state of ``DynamicGradScaler`` (same argument order) and its ``update(found_inf)``."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
    ) -> None:
        # Megatron asserts these before it builds its tensors
        assert initial_scale > 0.0
        assert 0.0 < min_scale <= initial_scale
        assert growth_factor > 1.0
        assert 0.0 < backoff_factor < 1.0
        assert growth_interval > 0
        assert hysteresis > 0
        self.scale_tensor = _f32(initial_scale)
        self.min_scale = _f32(min_scale)
        self.growth_factor = _f32(growth_factor)
        self.backoff_factor = _f32(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    @property
    def scale(self) -> float:
        return self.scale_tensor.item()

    def update(self, found_inf: bool) -> None:
        if not found_inf:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:  # `==`, as Megatron: a run of clean steps completed
                self.scale_tensor = self.scale_tensor * self.growth_factor
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis  # the only place the hysteresis is restored
            return
        # an overflow: the clean run is over and one more unit of hysteresis is spent, with no floor at 0
        self.growth_tracker = 0
        self.hysteresis_tracker -= 1
        if self.hysteresis_tracker <= 0:
            self.scale_tensor = torch.maximum(self.scale_tensor * self.backoff_factor, self.min_scale)
