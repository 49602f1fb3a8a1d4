"""A run of Lightning's ``"16-mixed"`` resumed under ``MPTPrecision("fp16")``: the checkpoint holds the state of a
``torch.amp.GradScaler`` (the scale the run had reached, the clean steps since it last changed) and none of the
plugin's. Both plugins take that scale over rather than start again from their ``init_scale``, which would skip the
first steps until the scale has backed off to where the run was.

Where the state is: the Trainer saves a precision plugin's ``state_dict()`` under the plugin's class name
(``checkpoint["MixedPrecision"]`` for ``"16-mixed"``; Lightning 1.x under ``"native_amp_scaling_state"``). Fabric saves
it only when the precision plugin (or its ``scaler``) is an entry of ``fabric.save``'s state; loading that entry into
the plugin (``fabric.load(path, {..., "scaler": fabric.strategy.precision})``) takes it over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mpt.core.scaler import DynamicLossScaler

__all__ = ["find_gradscaler_state", "is_gradscaler_state", "take_over"]

# the keys of torch.amp.GradScaler.state_dict() of an enabled scaler (torch >= 1.6)
_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def is_gradscaler_state(state: Any) -> bool:
    """Whether ``state`` is what ``torch.amp.GradScaler.state_dict()`` returns for an enabled scaler.

    Example:
        ```python
        import torch

        assert is_gradscaler_state(torch.amp.GradScaler("cpu").state_dict())
        assert not is_gradscaler_state(DynamicLossScaler().state_dict())
        ```
    """
    return isinstance(state, Mapping) and all(key in state for key in _KEYS)


def find_gradscaler_state(checkpoint: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The GradScaler state that a Trainer checkpoint of another precision plugin holds at its top level, or ``None``.

    Args:
        checkpoint: the loaded checkpoint (``on_load_checkpoint``'s argument).
    """
    return next((dict(value) for value in checkpoint.values() if is_gradscaler_state(value)), None)


def take_over(scaler: Optional[DynamicLossScaler], state: Mapping[str, Any]) -> None:
    """Give ``scaler`` the scale and the growth tracker of the GradScaler state ``state``, keeping its own
    configuration, and say so; without a dynamic scaler, say what is not taken over and why.

    Args:
        scaler: the plugin's scaler (``None``: no scaling, as with bf16).
        state: a :func:`is_gradscaler_state` dict.

    Example:
        ```python
        import torch

        amp = torch.amp.GradScaler("cpu", init_scale=128.0)
        scaler = DynamicLossScaler()
        take_over(scaler, amp.state_dict())
        assert scaler.scale == 128.0
        ```
    """
    saved = float(state["scale"])
    if scaler is None or scaler.is_static:
        rank_zero_warn(
            f"MPTPrecision: the checkpoint holds the state of a torch.amp.GradScaler (Lightning's '16-mixed'), at "
            f"scale {saved:g}; this plugin has {'no loss scaler' if scaler is None else 'a static scale'}, so it is "
            "not taken over. For the run's dynamic scale, use MPTPrecision('fp16') with the default scaler (or a "
            "DynamicLossScaler)."
        )
        return
    changed = scaler.restore_state(dict(state))
    rank_zero_info(
        f"MPTPrecision: took over the loss scale of the checkpoint's torch.amp.GradScaler (Lightning's '16-mixed'): "
        f"scale {scaler.scale:g}, {scaler.growth_tracker} clean steps since it last changed."
    )
    if changed:
        settings = "; ".join(f"{k} {old!r} in the checkpoint, {new!r} now" for k, (old, new) in changed.items())
        rank_zero_warn(
            f"MPTPrecision: the GradScaler in the checkpoint was configured otherwise ({settings}); this plugin's "
            "configuration is in force. To go on with the checkpoint's, pass "
            f"scaler=DynamicLossScaler({', '.join(f'{k}={old!r}' for k, (old, _) in changed.items())}, ...)."
        )
