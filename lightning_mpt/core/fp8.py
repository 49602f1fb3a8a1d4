"""fp8 compute for ``Linear`` layers with torchao's float8 training: the plugins' ``fp8=`` argument, checked once, and
the conversion that runs before the masters are taken.

torchao is optional (``pip install lightning-mpt[fp8]``) and imported only when fp8 is asked for. The conversion swaps
eligible ``nn.Linear`` layers for torchao's ``Float8Linear`` with its public ``convert_to_float8_training``; the swap
keeps each layer's ``weight`` and ``bias`` parameter objects and the module names, so the masters conversion that
follows makes ``Float8Linear.weight`` the bf16 half weight with an fp32 master under the original state-dict key.

Example:
    ```python
    from torch import nn
    from lightning_mpt.core.fp8 import check_fp8, convert_fp8

    setup = check_fp8("tensorwise", None, "bf16", emulate=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    model = convert_fp8(model, setup)
    assert [name for name, _ in float8_layers(model)] == ["0"]  # 10 output features: not a multiple of 16
    ```
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

#: torchao's recipe names (``Float8LinearConfig.from_recipe_name``)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: fp8 matmuls need dimensions divisible by this (torchao's filter skips the others)
ALIGNMENT = 16
INSTALL = "pip install 'lightning-mpt[fp8]'"

Filter = Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class Float8Setup:
    """The checked ``fp8=`` argument of a plugin: torchao's config, the recipe's name and the user's filter."""

    config: Any  # torchao.float8.Float8LinearConfig
    recipe: str  # a name of RECIPES, or "custom" for a config made by hand
    user_filter: Optional[Filter] = None

    def describe(self) -> dict[str, Any]:
        """What the run record says about fp8."""
        return {"recipe": self.recipe, "emulate": bool(self.config.emulate)}


def _torchao_float8() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise ImportError(
            f"MPTPrecision(fp8=...) converts Linear layers with torchao's float8 training, and torchao is not "
            f"installed: {INSTALL} (torchao >= 0.18)."
        ) from err
    return float8


def check_fp8(fp8: Any, fp8_filter: Any, precision: Any, emulate: Any = False) -> Optional[Float8Setup]:
    """Validate the plugins' ``fp8``, ``fp8_filter`` and ``fp8_emulate`` arguments; ``None`` when fp8 is off.

    Args:
        fp8: ``None``/``False`` (off), ``True`` (torchao's default, tensorwise), a recipe name of :data:`RECIPES`, or a
            ``torchao.float8.Float8LinearConfig``.
        fp8_filter: ``None`` or ``fn(module, fqn) -> bool``: which eligible layers to convert.
        precision: the plugin's precision (``"bf16"``; torchao's recipes compute in bf16).
        emulate: run the fp8 matmuls emulated (any device), as ``Float8LinearConfig(emulate=True)``.

    Example:
        ```python
        assert check_fp8(None, None, "fp16") is None
        assert check_fp8("rowwise", None, "bf16", emulate=True).config.emulate
        ```
    """
    if not isinstance(emulate, bool):
        raise TypeError(f"MPTPrecision(fp8_emulate={emulate!r}): expected a bool (True: emulate the fp8 matmuls).")
    if fp8 is None or fp8 is False:
        if fp8_filter is not None or emulate:
            raise ValueError(
                "MPTPrecision(fp8_filter=..., fp8_emulate=...) configure fp8 compute, which is off: pass fp8=True, a "
                f"recipe name ({', '.join(map(repr, RECIPES))}) or a torchao Float8LinearConfig."
            )
        return None
    if fp8_filter is not None and not callable(fp8_filter):
        raise TypeError(
            f"MPTPrecision(fp8_filter={fp8_filter!r}): expected None or a function (module, fqn) -> bool, e.g. "
            "fp8_filter=lambda module, fqn: 'lm_head' not in fqn."
        )
    if precision != "bf16":
        raise ValueError(
            f"MPTPrecision({precision!r}, fp8=...): fp8 compute is supported with 'bf16' only. torchao's float8 "
            "recipes take bf16 (or fp32) operands and scale each fp8 cast dynamically, so there is no loss scale to "
            "share with fp16's; fp16 around fp8 matmuls would add fp16's overflow without a gain. Use "
            "MPTPrecision('bf16', fp8=...)."
        )
    float8 = _torchao_float8()
    if fp8 is True:
        config, recipe = float8.Float8LinearConfig(), "tensorwise"
    elif isinstance(fp8, str):
        if fp8 not in RECIPES:
            raise ValueError(
                f"MPTPrecision(fp8={fp8!r}): unknown recipe; accepted: True (tensorwise), "
                f"{', '.join(map(repr, RECIPES))}, or a torchao.float8.Float8LinearConfig."
            )
        config, recipe = float8.Float8LinearConfig.from_recipe_name(fp8), fp8
    elif isinstance(fp8, float8.Float8LinearConfig):
        config, recipe = fp8, "custom"
    else:
        raise TypeError(
            f"MPTPrecision(fp8={fp8!r}): expected None or False (off), True (tensorwise), a recipe name "
            f"({', '.join(map(repr, RECIPES))}) or a torchao.float8.Float8LinearConfig."
        )
    if emulate and not config.emulate:
        config = dataclasses.replace(config, emulate=True)
    return Float8Setup(config, recipe, fp8_filter)


def check_fp8_device(setup: Optional[Float8Setup], device: torch.device) -> None:
    """Raise a clear error when ``device`` cannot run ``setup``'s fp8 matmuls and emulation was not asked for: no
    silent emulation."""
    if setup is None or setup.config.emulate:
        return
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return
        what = f"this CUDA GPU (compute capability {major}.{minor}) has no fp8 Tensor Cores"
    else:
        what = f"the {device.type} device has no fp8 Tensor Cores"
    raise RuntimeError(
        f"MPTPrecision(fp8=...): {what}; torchao's fp8 matmuls need a CUDA GPU of compute capability 8.9 or newer "
        "(Ada, Hopper, Blackwell). To run the same numerics emulated (slow: for tests and debugging on a CPU), ask for "
        "it: MPTPrecision('bf16', fp8=..., fp8_emulate=True) or fp8=Float8LinearConfig(emulate=True)."
    )


def eligible(module: nn.Module) -> bool:
    """Whether torchao can run ``module`` in fp8: a plain ``nn.Linear`` (not yet converted, not attention's output
    projection, whose weight ``MultiheadAttention`` uses directly) with both dimensions divisible by 16."""
    if not isinstance(module, nn.Linear) or isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return False
    if is_float8(module):
        return False
    out_features, in_features = module.weight.shape
    return out_features % ALIGNMENT == 0 and in_features % ALIGNMENT == 0


def convert_fp8(module: nn.Module, setup: Optional[Float8Setup], fsdp: bool = False) -> nn.Module:
    """Swap the eligible ``Linear`` layers of ``module`` that ``setup``'s filter accepts for torchao's
    ``Float8Linear``, in place (a root ``Linear`` is returned replaced). Nothing happens when ``setup`` is ``None``.

    Args:
        module: the model, not yet sharded.
        setup: the checked ``fp8=`` argument.
        fsdp: FSDP2's ``fully_shard`` shards ``module`` next: with a recipe's tensorwise weights, torchao all-gathers
            the weights in fp8 (``enable_fsdp_float8_all_gather``), half the bytes of bf16. A config made by hand is
            used as it is.
    """
    if setup is None:
        return module
    float8 = _torchao_float8()
    config = setup.config
    if fsdp and setup.recipe != "custom" and config.cast_config_weight.scaling_granularity.name == "TENSORWISE":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    gathered = (
        []
        if fsdp
        else [n for n, m in float8_layers(module) if getattr(m.config, "enable_fsdp_float8_all_gather", False)]
    )
    if not fsdp and (config.enable_fsdp_float8_all_gather or gathered):
        which = "the layers " + ", ".join(gathered[:5]) if gathered else "the Float8LinearConfig"
        raise ValueError(
            f"MPTPrecision(fp8=...): {which}"
            " (enable_fsdp_float8_all_gather=True) wrap their weights for FSDP2's fp8 all-gather, but the model is not "
            "sharded with FSDP2. On one device and under DDP convert without it: convert_fp8(module) (fsdp=False), or "
            "let the plugin convert the model."
        )
    converted: nn.Module = float8.convert_to_float8_training(module, module_filter_fn=accepts(setup), config=config)
    return converted


def accepts(setup: Float8Setup) -> Filter:
    """The filter of the layers ``setup`` converts: eligible, and accepted by the user's filter."""
    user = setup.user_filter

    def accept(layer: nn.Module, fqn: str) -> bool:
        return eligible(layer) and (user is None or bool(user(layer, fqn)))

    return accept


def check_converted(module: nn.Module, setup: Optional[Float8Setup], fix: str) -> None:
    """Raise a clear error when ``module``, sharded by FSDP2 already, still has ``Linear`` layers that ``setup`` would
    convert: they must become ``Float8Linear`` before ``fully_shard`` (``fix`` says how)."""
    if setup is None:
        return
    accept = accepts(setup)
    left = [name or "(root)" for name, layer in module.named_modules() if accept(layer, name)]
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise ValueError(
            f"MPTPrecision(fp8=...) under FSDP2: the Linear layers {shown} were sharded by fully_shard before they "
            "became torchao's Float8Linear, and a sharded layer cannot be swapped. Convert them before sharding: "
            f"{fix}"
        )


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (never imports torchao: without it loaded there is none)."""
    loaded = sys.modules.get("torchao.float8.float8_linear")
    return loaded is not None and isinstance(module, loaded.Float8Linear)


def is_float8_tensor(x: Any) -> bool:
    """Whether ``x`` is torchao's fp8 training tensor (what FSDP2's fp8 all-gather makes of a weight), without importing
    torchao."""
    loaded = sys.modules.get("torchao.float8.float8_training_tensor")
    return loaded is not None and isinstance(x, loaded.Float8TrainingTensor)


def float8_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every ``Float8Linear`` in ``module``, in ``named_modules`` order."""
    return [(name or "(root)", m) for name, m in module.named_modules() if is_float8(m)]
