"""``TensorCoreCheck``: layer and batch sizes that keep fp16/bf16 matmuls off Tensor Cores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_mpt.callbacks._common import Monitor, check_every
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.statistics import half_format

# implicit-GEMM convolutions (public classes; the lazy variants subclass them)
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class TensorCoreFinding:
    """A layer (or the batch) with dimensions that are not multiples of ``multiple``."""

    name: str  # module name, or "batch size"
    kind: str  # module class name
    dims: dict[str, int]  # the offending dimensions

    def __str__(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.dims.items())
        return f"{self.name} ({self.kind}): {dims}"


def tensor_core_report(
    module: nn.Module, batch_size: Optional[int] = None, multiple: int = 8
) -> list[TensorCoreFinding]:
    """Linear, convolution and attention layers (and the batch size) whose matmul dimensions are not multiples of
    ``multiple``. fp16/bf16 GEMMs run on Tensor Cores at full speed when these dimensions are multiples of 8.

    Example:
        ```python
        from torch import nn
        from lightning_mpt.callbacks import tensor_core_report

        found = tensor_core_report(nn.Sequential(nn.Linear(16, 10), nn.Linear(10, 8)), batch_size=30)
        assert [str(f) for f in found] == [
            "0 (Linear): out_features=10", "1 (Linear): in_features=10", "batch size (DataLoader): batch_size=30"
        ]
        ```
    """
    multiple = check_every("tensor_core_report", "multiple", multiple)
    found: list[TensorCoreFinding] = []
    for name, m in module.named_modules():
        dims: dict[str, int] = {}
        if isinstance(m, nn.Linear):
            dims = {"in_features": m.in_features, "out_features": m.out_features}
        elif isinstance(m, _CONVOLUTIONS):
            # implicit GEMM: K = in_channels / groups (per group), N = out_channels / groups
            dims = {"in_channels/groups": m.in_channels // m.groups, "out_channels/groups": m.out_channels // m.groups}
        elif isinstance(m, nn.MultiheadAttention):
            dims = {"embed_dim": m.embed_dim, "head_dim": m.head_dim}
        bad = {k: v for k, v in dims.items() if v % multiple}
        if bad:
            found.append(TensorCoreFinding(name or "(root)", type(m).__name__, bad))
    if batch_size is not None and batch_size % multiple:
        found.append(TensorCoreFinding("batch size", "DataLoader", {"batch_size": batch_size}))
    return found


class TensorCoreCheck(Monitor):
    """At the start of training under fp16/bf16, warn about Linear/Conv/attention layers and a batch size whose
    dimensions are not multiples of ``multiple`` (8 for Tensor Cores), and write the list as the TensorBoard text
    ``mpt/tensor_cores``.

    Args:
        multiple: the multiple the dimensions should have.
        strict: re-raise internal errors instead of a warning (``None``: the environment variable
            ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).

    Example:
        ```python
        import lightning as L
        from lightning_mpt import MPTPrecision
        from lightning_mpt.callbacks import TensorCoreCheck

        trainer = L.Trainer(plugins=[MPTPrecision("bf16")], callbacks=[TensorCoreCheck()])
        ```
    """

    def __init__(self, multiple: int = 8, strict: Optional[bool] = None) -> None:
        super().__init__(strict)
        self.multiple = check_every("TensorCoreCheck", "multiple", multiple)
        self.findings: list[TensorCoreFinding] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.on:
            return
        with self.setup_stat.guarded():
            self._check(trainer, pl_module)

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fmt = half_format(trainer.precision_plugin)
        if fmt is None:
            return
        self.findings = tensor_core_report(pl_module, _batch_size(trainer), self.multiple)
        if not self.findings or not trainer.is_global_zero:
            return
        lines = "\n".join(f"  {f}" for f in self.findings)
        rank_zero_warn(
            f"TensorCoreCheck: under {fmt.name}, these dimensions are not multiples of {self.multiple}, which keeps"
            f" their matmuls off Tensor Cores (pad them, e.g. a vocabulary to a multiple of 64):\n{lines}"
        )
        rows = "\n".join(
            f"| `{f.name}` | {f.kind} | {', '.join(f'{k}={v}' for k, v in f.dims.items())} |" for f in self.findings
        )
        self.sink.text(
            tags.TENSOR_CORES,
            f"Dimensions not multiples of {self.multiple} under {fmt.name}:\n\n"
            f"| layer | type | dims |\n|---|---|---|\n{rows}",
            trainer.global_step,
        )


def _batch_size(trainer: pl.Trainer) -> Optional[int]:
    loader: Any = trainer.train_dataloader
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None
