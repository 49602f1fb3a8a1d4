"""DeepSpeed's dynamic loss scale rule, transcribed as the reference of the hysteresis tests in test_scaler.py.

Read from deepspeedai/DeepSpeed, ``deepspeed/runtime/fp16/loss_scaler.py``, class ``DynamicLossScaler``
(``__init__`` and ``update_scale``), at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641; the file last changed
in 32d51a1840abf9e3907109c3b5fd0c9a47cbcae3. This is a transcription of the rule, not a copy of the code.

What it shows, next to Megatron-LM's rule (megatron_reference.py):

* the hysteresis (``delayed_shift``) backs off on an overflow met with one unit left, and then stays at 1, where
  Megatron's tracker keeps falling below 0: the back-off decisions are the same;
* ``consecutive_hysteresis=True`` restores it on every clean step, before the growth test;
* the scale factor is 2 both ways, held in a Python float (double), floored at ``min_scale``, with no ceiling;
* growth is tested on ``stable = iteration - last_overflow_iteration - 1``: the first growth after an overflow
  (or the start) comes on the (window + 1)-th clean step, later ones every window clean steps.

Left out: the logging and ``raise_error_at_min_scale`` (an overflow at ``min_scale`` raises), which MPTPrecision's
guard covers.
"""

from __future__ import annotations


class DeepSpeedDynamicScaler:
    """The state of DeepSpeed's ``DynamicLossScaler`` that ``update_scale(overflow)`` reads and writes."""

    def __init__(
        self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int, consecutive_hysteresis: bool
    ) -> None:
        self.scale = init_scale
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.hysteresis_left = delayed_shift  # DeepSpeed's cur_hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis_left == 1 or self.delayed_shift == 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.delayed_shift
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.delayed_shift
                self.scale *= self.scale_factor
        self.iteration += 1
