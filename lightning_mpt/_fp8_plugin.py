"""The fp8 part of both plugins (``fp8=``, torchao's ``Float8Linear``), defined once: the conversion, its check under
FSDP2, and the device check.

Example:
    ```python
    from lightning_mpt import MPTPrecision

    assert MPTPrecision("bf16").fp8_config is None  # no fp8 unless asked for
    ```
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.nn import Module

from lightning_mpt.core.fp8 import Float8Setup, check_converted, check_fp8_device, convert_fp8


class Float8Plugin:
    """Mixin of the plugins' fp8 attributes and conversion; ``_fp8`` is the checked ``fp8=`` argument."""

    _fp8: Optional[Float8Setup] = None
    #: how user code reaches the plugin, for messages
    _access: str = "the precision plugin"

    @property
    def fp8_config(self) -> Any:
        """torchao's ``Float8LinearConfig`` the plugin converts ``Linear`` layers with, ``None`` without fp8."""
        return None if self._fp8 is None else self._fp8.config

    @property
    def fp8_setup(self) -> Optional[Float8Setup]:
        """How the ``Linear`` layers compute in fp8 (``None``: they do not)."""
        return self._fp8

    def convert_fp8(self, module: Module, fsdp: bool = False) -> Module:
        """Swap ``module``'s eligible ``Linear`` layers for torchao's ``Float8Linear`` now, as the plugin's ``fp8=``
        says (nothing without ``fp8=``). The plugin does it itself, except under FSDP2 with the Trainer: there the
        layers must be converted before ``fully_shard``, in ``configure_model``.

        Args:
            module: the model, not yet sharded; converted in place (a root ``Linear`` is returned replaced). With the
                Trainer pass the LightningModule: ``fp8_filter`` then sees the names the plugin checks and logs.
            fsdp: ``fully_shard`` shards it next: the recipes' tensorwise weights then all-gather in fp8.

        Example:
            ```python
            def configure_model(self):
                self.trainer.precision_plugin.convert_fp8(self, fsdp=True)  # fp8_filter sees the logged names
                for block in self.model.blocks:
                    fully_shard(block, mesh=self.device_mesh, mp_policy=self.trainer.precision_plugin.mp_policy)
                fully_shard(self.model, mesh=self.device_mesh, mp_policy=self.trainer.precision_plugin.mp_policy)
            ```
        """
        return convert_fp8(module, self._fp8, fsdp)

    def _convert_fp8(self, module: Module, sharded: bool = False) -> Module:
        """Swap eligible ``Linear`` layers for ``Float8Linear`` before the masters are taken (their weights become
        half weights with fp32 masters like any other); a module FSDP2 sharded already is only checked."""
        if sharded:
            fix = f"call `{self._access}.convert_fp8(self, fsdp=True)` in configure_model, before fully_shard."
            check_converted(module, self._fp8, fix)
            return module
        return convert_fp8(module, self._fp8)

    def _check_fp8_device(self, device: torch.device) -> None:
        check_fp8_device(self._fp8, device)
