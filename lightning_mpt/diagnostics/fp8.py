"""What torchao's fp8 casts do to each converted layer's ``input``, ``weight`` and ``grad_output`` (docs/fp8.md).

For each role, the statistics are computed from the high-precision tensor torchao casts and the scale it computes for
it (``scale = fp8_max / max(amax, 1e-12)`` in float64, rounded to float32, floored to a power of 2 where the recipe
says so), so they are exactly what the cast does:

* **amax**: ``max |x|``; **scale**: the scale (rowwise: the smallest row scale, that of the row holding the amax);
* **saturated fraction**: of all values, those non-finite or with ``|x * scale|`` at or beyond the midpoint between
  the format's max and the next value it would have (464 for e4m3, 61440 for e5m2): the cast clamps them to ±max;
* **flush fraction**: of the nonzero finite values, those the cast turns into 0;
* **subnormal fraction**: of the nonzero finite values, those whose fp8 value is nonzero and below the min normal.

Forward hooks (and a tensor hook on each output, for ``grad_output``) exist on measuring steps only.

Example:
    ```python
    import torch
    from lightning_mpt.diagnostics.fp8 import cast_counts, tensorwise_scale

    x = torch.tensor([448.0, 1.0, 1e-6, 0.0])
    scale = tensorwise_scale(x, torch.float8_e4m3fn)  # 448 / 448 = 1
    saturated, flushed, subnormal, nonzero, numel = cast_counts(x, torch.float8_e4m3fn, scale).tolist()
    assert (saturated, flushed, subnormal, nonzero, numel) == (0, 1, 0, 3, 4)  # 1e-6 is below e4m3's 2**-10
    ```
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mpt import _compat
from lightning_mpt.core.fp8 import float8_layers, is_float8_tensor
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.cadence import due
from lightning_mpt.diagnostics.recorder import Layout, Parts, Recorder
from lightning_mpt.diagnostics.session import DiagnosticSession
from lightning_mpt.diagnostics.statistic import Statistic, ratio

ROLES = ("input", "weight", "grad_output")
EPS = 1e-12  # torchao's floor of the amax, so that an all-zero tensor has a finite scale
_VALUES = 7  # amax, scale, then the counts of cast_counts


def saturation_bound(dtype: torch.dtype) -> float:
    """The magnitude from which a value cannot round to a finite value of ``dtype``: its max plus half the spacing of
    the values at the max (what 65520 is to fp16)."""
    info = torch.finfo(dtype)
    spacing = info.eps * 2.0 ** math.floor(math.log2(info.max))  # eps: the spacing of the values in [1, 2)
    return float(info.max) + spacing / 2


def tensorwise_scale(x: Tensor, dtype: torch.dtype, dim: Optional[int] = None, power_of_2: bool = False) -> Tensor:
    """torchao's dynamic scale of ``x`` for ``dtype``: of the whole tensor, or per slice along ``dim`` (rowwise)."""
    amax = x.detach().abs().max() if dim is None else x.detach().abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def cast_counts(x: Tensor, dtype: torch.dtype, scale: Tensor) -> Tensor:
    """``[saturated, flushed, subnormal, nonzero finite, numel]`` of casting ``x * scale`` to ``dtype`` as torchao does
    (in fp32, clamped to ±max), as a float64 tensor on ``x``'s device (no host sync)."""
    x = x.detach()
    info = torch.finfo(dtype)
    scaled = x.float() * scale
    saturated = ~torch.isfinite(scaled) | (scaled.abs() >= saturation_bound(dtype))
    cast = scaled.clamp(-info.max, info.max).to(dtype).float()
    nonzero = (x != 0) & torch.isfinite(x)
    flushed = nonzero & (cast == 0)
    subnormal = nonzero & (cast != 0) & (cast.abs() < info.smallest_normal)
    numel = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    counts = [m.sum(dtype=torch.float64) for m in (saturated, flushed, subnormal, nonzero)]
    return torch.stack([*counts, numel])


def role_values(x: Tensor, cast_config: Any, power_of_2: bool, scale: Optional[Tensor] = None) -> Tensor:
    """``[amax, scale, *cast_counts]`` of the tensor ``x`` of a role with torchao's ``CastConfig`` (rowwise: each row
    of the last dimension has its scale, as torchao's cast for the output and grad_input matmuls).

    ``scale``: the scale torchao used, when ``x`` is one process's shard of the tensor it scaled (FSDP2's fp8
    all-gather scales each shard with the whole weight's scale)."""
    rowwise = cast_config.scaling_granularity.name == "AXISWISE"
    x = x.detach().reshape(-1, x.shape[-1]) if x.dim() > 1 else x.detach()
    dtype = cast_config.target_dtype
    if scale is None:
        scale = tensorwise_scale(x, dtype, dim=-1 if rowwise else None, power_of_2=power_of_2)
    amax = x.abs().amax().double() if x.numel() else torch.zeros((), dtype=torch.float64, device=x.device)
    return torch.cat([torch.stack([amax, scale.min().double()]), cast_counts(x, dtype, scale)])


class Float8Statistics:
    """The cast statistics of every ``Float8Linear`` of a module, measured every ``every_n_steps``.

    Call :meth:`arm` before a step's forward and :meth:`after_backward` after its backward: the hooks exist between the
    two on measuring steps only, and record the first forward and backward of each layer (the first micro-batch under
    gradient accumulation). Values are read with the recorder's one host sync.

    Args:
        every_n_steps: optimizer steps between measurements.
        per_layer: also write each layer's and role's values (``mpt/fp8/<statistic>/<layer>/<role>``).
        owner: who measures, for messages.
        strict: raise rather than warn when it fails (``None``: ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).
    """

    def __init__(
        self, every_n_steps: int = 1, per_layer: bool = True, owner: str = "diagnostics", strict: Optional[bool] = None
    ) -> None:
        self.every_n_steps = every_n_steps
        self.per_layer = per_layer
        self.stat = Statistic(owner, f"the fp8 cast statistics ({tags.FP8}/...)", strict)
        self.layers: list[tuple[str, nn.Module]] = []
        self._shards: list[Any] = []
        self._handles: list[RemovableHandle] = []
        self._values: dict[tuple[int, int], Tensor] = {}
        self._step: Optional[int] = None

    def set_up(self, session: DiagnosticSession, module: nn.Module) -> None:
        """Find the converted layers; warn once when there are none."""
        self.layers = float8_layers(module)
        # FSDP2's sharded weights, registered between forwards: an fp8 all-gather casts their local shards
        self._shards = [layer.weight if hasattr(layer.weight, "to_local") else None for _, layer in self.layers]
        if not self.layers:
            session.warn_once(
                f"{self.stat.owner}: the model has no fp8 (torchao Float8Linear) layers; no {tags.FP8}/ statistics. "
                "Use MPTPrecision('bf16', fp8=...) with Linear layers whose dimensions are multiples of 16."
            )

    def arm(self, recorder: Recorder, step: int) -> None:
        """On a measuring step, hook the converted layers for this step's forward and backward."""
        if self._handles or not self.layers or not due(step, self.every_n_steps) or not recorder.measures(self.stat):
            return
        self._values, self._step = {}, step
        with self.stat.guarded():
            for index, (_, layer) in enumerate(self.layers):
                self._handles.append(layer.register_forward_hook(self._forward_hook(index)))

    def _forward_hook(self, index: int) -> Any:
        def hook(layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if (index, 0) in self._values or not self.stat.enabled or not args or not isinstance(args[0], Tensor):
                return
            with self.stat.guarded(), torch.no_grad():
                config: Any = layer.config
                weight: Any = layer.weight
                x = args[0]
                if torch.is_autocast_enabled() and x.is_cuda:  # what Float8Linear.forward does first
                    x = x.to(torch.get_autocast_dtype("cuda"))
                self._measure(index, 0, x, config.cast_config_input, config)
                scale, shard = None, self._shards[index]
                if is_float8_tensor(weight) and shard is not None:  # all-gathered in fp8 from each rank's shard
                    weight, scale = shard.to_local(), _compat.float8_scale(weight)
                self._measure(index, 1, weight, config.cast_config_weight, config, scale)
                if isinstance(output, Tensor) and output.requires_grad:
                    output.register_hook(self._grad_hook(index, config, self._step))

        return hook

    def _grad_hook(self, index: int, config: Any, step: Optional[int]) -> Any:
        def hook(grad: Tensor) -> None:
            if step == self._step and (index, 2) not in self._values and self.stat.enabled:
                with self.stat.guarded(), torch.no_grad():
                    self._measure(index, 2, grad, config.cast_config_grad_output, config)

        return hook

    def _measure(
        self, index: int, role: int, x: Tensor, cast_config: Any, config: Any, scale: Optional[Tensor] = None
    ) -> None:
        if cast_config.scaling_type.name != "DISABLED":
            self._values[(index, role)] = role_values(x, cast_config, config.round_scales_to_power_of_2, scale)

    def after_backward(self, recorder: Recorder) -> None:
        """Remove the hooks and queue what they measured, at the step they were armed at, for the recorder's next
        flush."""
        if not self._handles:
            return
        self.disarm()
        values, step = self._values, self._step
        self._values, self._step = {}, None
        if not values or step is None:
            return
        slots = [(i, r) for i in range(len(self.layers)) for r in range(len(ROLES))]

        def compute() -> Parts:
            device = next(iter(values.values())).device
            zeros = torch.zeros(_VALUES, dtype=torch.float64, device=device)
            stacked = torch.stack([values.get(slot, zeros).to(device) for slot in slots])
            return [(stacked[:, :1], "max"), (stacked[:, 1:2], "first"), (stacked[:, 2:], "sum")]

        def layout() -> Layout:
            n = len(slots)
            return [(n, "max"), (n, "first"), (n * (_VALUES - 2), "sum")]

        recorder.submit(self.stat, compute, lambda v: self._write(recorder, v, slots, step), layout)

    def _write(self, recorder: Recorder, flat: list[float], slots: list[tuple[int, int]], step: int) -> None:
        n = len(slots)
        amaxes, scales, counts = flat[:n], flat[n : 2 * n], flat[2 * n :]
        out: dict[str, Optional[float]] = {}
        total = [0.0] * 5
        for k, (index, role) in enumerate(slots):
            c = counts[k * 5 : (k + 1) * 5]
            if c[4] == 0:  # not measured: the layer did not run, or its role is not cast
                continue
            total = [a + b for a, b in zip(total, c)]
            if self.per_layer:
                name = f"{self.layers[index][0]}/{ROLES[role]}"
                out[tags.per_parameter(tags.FP8_AMAX, name)] = amaxes[k]
                out[tags.per_parameter(tags.FP8_SCALE, name)] = scales[k]
                out[tags.per_parameter(tags.FP8_SATURATED, name)] = ratio(c[0], c[4])
                out[tags.per_parameter(tags.FP8_FLUSH, name)] = ratio(c[1], c[3])
                out[tags.per_parameter(tags.FP8_SUBNORMAL, name)] = ratio(c[2], c[3])
        out[tags.FP8_SATURATED] = ratio(total[0], total[4])
        out[tags.FP8_FLUSH] = ratio(total[1], total[3])
        out[tags.FP8_SUBNORMAL] = ratio(total[2], total[3])
        recorder.sink.scalars(out, step)

    def disarm(self) -> None:
        """Remove the forward hooks (tensor hooks already on outputs check the step they were made for)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def release(self) -> None:
        """Drop the hooks and what they measured (the run is over, or the step failed)."""
        self.disarm()
        self._values, self._step = {}, None
