"""The one place that turns the plugins' options into masters: 4-byte copies, chunked, 16-bit remainders or FSDP2's
own shards."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Optional

import torch
from torch.nn import Module

from lightning_mpt.core.config import MasterOptions
from lightning_mpt.core.masters import Masters
from lightning_mpt.core.masters.chunked import ChunkedStep

if TYPE_CHECKING:
    from lightning_mpt.core.masters.copies import CopyMasters


def build_masters(
    options: MasterOptions,
    dtype: torch.dtype,
    keep_fp32: tuple[type[Module], ...],
    sharded: Optional[Literal["trainer", "fabric"]] = None,
    report_half_kept: Optional[Callable[[list[str]], None]] = None,
    chunks_asked: bool = True,
) -> Masters:
    """The masters that ``options`` (resolved for ``dtype``) describe.

    Args:
        options: resolved :class:`~lightning_mpt.core.config.MasterOptions`.
        dtype: the half format of the weights.
        keep_fp32: module types whose parameters stay fp32 (their own masters).
        sharded: under FSDP2, the loop that drives it: its fp32 shards are the masters.
        report_half_kept: under FSDP2, told the norm layers it all-gathers in the half format.
        chunks_asked: the chunked step was asked for (not the format's default): an optimizer that cannot be
            stepped in chunks is then named in a warning.

    Example:
        ```python
        from lightning_mpt.core.masters.remainders import RemainderMasters

        options = MasterOptions().resolved(torch.bfloat16)
        assert isinstance(build_masters(options, torch.bfloat16, ()), RemainderMasters)
        ```
    """
    if sharded is not None:
        from lightning_mpt.core.masters.sharded import ShardedMasters

        return ShardedMasters(dtype, keep_fp32, report_half_kept, loop=sharded)
    chunk = options.chunk_size
    if options.remainders:
        from lightning_mpt.core.masters.remainders import RemainderMasters

        masters: CopyMasters = RemainderMasters(keep_fp32, chunk)
    elif chunk is not None:
        from lightning_mpt.core.masters.chunked import ChunkedMasters

        masters = ChunkedMasters(dtype, keep_fp32, chunk)
    else:
        from lightning_mpt.core.masters.copies import CopyMasters

        return CopyMasters(dtype, keep_fp32, enabled=options.enabled)
    if isinstance(masters.stepper, ChunkedStep):
        masters.stepper.warn_whole = chunks_asked
    return masters
