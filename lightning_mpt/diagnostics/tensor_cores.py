"""Layer and batch sizes that keep fp16/bf16 matmuls off Tensor Cores, and how they are reported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from lightning_mpt.core.numerics import FloatFormat
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.cadence import check_every
from lightning_mpt.diagnostics.sink import Sink

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


def tensor_core_warning(owner: str, findings: list[TensorCoreFinding], fmt: FloatFormat, multiple: int) -> str:
    """The warning that lists ``findings``."""
    lines = "\n".join(f"  {f}" for f in findings)
    return (
        f"{owner}: under {fmt.name}, these dimensions are not multiples of {multiple}, which keeps their matmuls off"
        f" Tensor Cores (pad them, e.g. a vocabulary to a multiple of 64):\n{lines}"
    )


def write_tensor_cores(
    sink: Sink, findings: list[TensorCoreFinding], fmt: FloatFormat, multiple: int, step: int
) -> None:
    """The text ``mpt/tensor_cores``: a table of ``findings``."""
    rows = "\n".join(
        f"| `{f.name}` | {f.kind} | {', '.join(f'{k}={v}' for k, v in f.dims.items())} |" for f in findings
    )
    sink.text(
        tags.TENSOR_CORES,
        f"Dimensions not multiples of {multiple} under {fmt.name}:\n\n| layer | type | dims |\n|---|---|---|\n{rows}",
        step,
    )
