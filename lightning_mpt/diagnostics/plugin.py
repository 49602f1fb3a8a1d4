"""What a precision plugin exposes to the diagnostics, read by duck typing (no Lightning import).

``MPTPrecision`` (Trainer or Fabric) has ``half_dtype``, ``master_of``, ``loss_scale``, ``backward_scale`` and a step
``history``; Lightning's autocast precisions have ``precision`` (``"16-mixed"``, ``"bf16-mixed"``) and, for fp16, a
``torch.amp.GradScaler`` as ``scaler``.

Example:
    ```python
    from lightning_mpt.diagnostics.plugin import backward_scale, describe_precision, half_format
    from lightning_mpt.fabric import MPTPrecision

    plugin = MPTPrecision("fp16")
    assert half_format(plugin).name == "fp16" and backward_scale(plugin) == 2.0**16
    assert describe_precision(plugin)["loss_scaling"] == "dynamic"
    ```
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from lightning_mpt.core.numerics import BF16, FP16, FloatFormat, format_of


def has_masters(plugin: Any) -> bool:
    """Whether ``plugin`` keeps half-precision weights with fp32 masters the way ``MPTPrecision`` does (it has
    ``half_dtype`` and ``master_of``)."""
    return hasattr(plugin, "half_dtype") and callable(getattr(plugin, "master_of", None))


def half_format(plugin: Any) -> Optional[FloatFormat]:
    """The half-precision format the plugin computes in: fp16 or bf16, ``None`` for full precision."""
    if has_masters(plugin):
        return format_of(plugin.half_dtype)
    precision = str(getattr(plugin, "precision", ""))
    if precision.startswith("16"):
        return FP16
    if precision.startswith("bf16"):
        return BF16
    return None


def grad_scaler(plugin: Any) -> Optional[torch.amp.GradScaler]:
    """The enabled :class:`torch.amp.GradScaler` of Lightning's ``MixedPrecision`` plugin, if any."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None


def backward_scale(plugin: Any) -> float:
    """The loss scale the pending gradients were computed with (read before the scaler updates); 1.0 without one."""
    if has_masters(plugin) and hasattr(plugin, "backward_scale"):
        return float(plugin.backward_scale)
    scaler = grad_scaler(plugin)
    return scaler.get_scale() if scaler is not None else 1.0


def current_scale(plugin: Any) -> float:
    """The loss scale the next backward uses: the scale in force now; 1.0 without one."""
    if has_masters(plugin):
        return float(plugin.loss_scale)
    scaler = grad_scaler(plugin)
    return scaler.get_scale() if scaler is not None else 1.0


def steps_taken(plugin: Any) -> int:
    """The optimizer steps ``MPTPrecision`` has taken, skipped ones included (also before a resume)."""
    last = plugin.last_step
    return last.step + 1 if last is not None else int(plugin.state_dict().get("steps", 0))


def describe_precision(plugin: Any) -> dict[str, Any]:
    """The fields of the ``mpt/data/run`` record that describe the precision plugin."""
    fmt = half_format(plugin)
    scaler = getattr(plugin, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler):
        scaling = "grad_scaler" if scaler.is_enabled() else "none"
    elif scaler is None:
        scaling = "none"
    else:
        scaling = "static" if getattr(scaler, "is_static", False) else "dynamic"
    masters = getattr(plugin, "master_weights", None)
    fp8 = getattr(plugin, "fp8_setup", None)
    return {
        "format": fmt.name if fmt is not None else None,
        "plugin": type(plugin).__name__,
        "precision": str(getattr(plugin, "precision", "")),
        "loss_scaling": scaling,
        "scaler": describe_scaler(scaler),
        "master_weights": masters if isinstance(masters, bool) else None,
        "master_remainders": getattr(plugin, "master_remainders", None),
        "chunked_step": getattr(plugin, "chunked_step", None),
        "fp8": fp8.describe() if fp8 is not None else None,
    }


def describe_scaler(scaler: Any) -> Optional[dict[str, Any]]:
    """The configuration of a loss scaler at the start of a run, for the ``mpt/data/run`` record: the scale in force,
    ``growth_interval``, ``growth_factor``, ``backoff_factor`` and, for ``DynamicLossScaler``, ``hysteresis``,
    ``min_scale`` and ``max_scale`` (``None`` when unbounded: records are strict JSON). ``None`` without a scaler.

    The report's advice reads it: whether the scale could grow within the run (``growth_interval``), and which scale
    the run started at.

    Args:
        scaler: a ``DynamicLossScaler``, a ``torch.amp.GradScaler`` or ``None``.

    Example:
        ```python
        from lightning_mpt import DynamicLossScaler

        described = describe_scaler(DynamicLossScaler(init_scale=1024.0, growth_interval=100))
        assert described["scale"] == 1024.0 and described["growth_interval"] == 100
        assert describe_scaler(None) is None
        ```
    """
    if isinstance(scaler, torch.amp.GradScaler):
        if not scaler.is_enabled():
            return None
        return {
            "scale": float(scaler.get_scale()),
            "growth_interval": int(scaler.get_growth_interval()),
            "growth_factor": float(scaler.get_growth_factor()),
            "backoff_factor": float(scaler.get_backoff_factor()),
        }
    if scaler is None or not hasattr(scaler, "growth_interval"):
        return None
    fields = ("growth_interval", "growth_factor", "backoff_factor", "hysteresis", "min_scale", "max_scale")
    described: dict[str, Any] = {"scale": float(scaler.get_scale())}
    for name in fields:
        value = getattr(scaler, name, None)
        described[name] = value if isinstance(value, (int, float)) and math.isfinite(value) else None
    return described
