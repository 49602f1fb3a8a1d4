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
    return {
        "format": fmt.name if fmt is not None else None,
        "plugin": type(plugin).__name__,
        "precision": str(getattr(plugin, "precision", "")),
        "loss_scaling": scaling,
    }
