"""Many tensors allocated as views of one flat buffer: the fp32 gradients of a step's masters come from one
allocation (and are unscaled by one kernel over that buffer) instead of one allocation per tensor, whose host cost
grows with the number of tensors (400 ``empty_like`` calls cost about as much as the rest of the step's own work)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class FlatLayout:
    """Where each tensor of a list sits in one flat buffer: tensors of one shape lie next to each other, so that one
    ``unbind`` makes all their views.

    Args:
        tensors: the tensors to mirror (contiguous; their shapes only are used, and they are kept, so that the ids
            keying a cache of layouts stay theirs).

    Example:
        ```python
        layout = FlatLayout([torch.zeros(2, 3), torch.zeros(4), torch.zeros(2, 3)])
        flat, views = layout.views(torch.float32, torch.device("cpu"))
        assert [tuple(v.shape) for v in views] == [(2, 3), (4,), (2, 3)] and flat.numel() == 16
        ```
    """

    def __init__(self, tensors: list[Tensor]) -> None:
        self.tensors = tensors
        groups: dict[torch.Size, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.shape, []).append(i)
        self.groups = list(groups.values())  # the indices of each shape's tensors
        self.blocks = [(len(idx), shape, shape.numel()) for shape, idx in groups.items()]
        self.numel = sum(count * n for count, _, n in self.blocks)
        self.position = [0] * len(tensors)  # tensor i -> its view's place in the blocks' order
        for pos, i in enumerate(i for idx in groups.values() for i in idx):
            self.position[i] = pos

    def views(self, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, list[Tensor]]:
        """A new flat buffer and the views of it shaped as the tensors, in their order (contiguous each)."""
        flat = torch.empty(self.numel, dtype=dtype, device=device)
        parts: list[Tensor] = []
        offset = 0
        for count, shape, n in self.blocks:
            parts.extend(flat[offset : offset + count * n].view(count, *shape).unbind(0))
            offset += count * n
        return flat, [parts[j] for j in self.position]


class FlatLayouts:
    """The :class:`FlatLayout` of recently seen lists of tensors (a few per optimizer: one per range of parameters),
    keyed by the tensors' ids; ``None`` for a list that cannot lie flat (tensors not contiguous, or on several
    devices or of several dtypes).

    Example:
        ```python
        masters = [torch.zeros(2), torch.zeros(3)]
        layouts = FlatLayouts()
        assert layouts.get(masters) is layouts.get(masters)
        ```
    """

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._layouts: dict[tuple[int, ...], Optional[FlatLayout]] = {}

    def get(self, tensors: list[Tensor]) -> Optional[FlatLayout]:
        key = tuple(map(id, tensors))
        if key in self._layouts:
            return self._layouts[key]
        first = tensors[0]
        fits = all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device for t in tensors)
        if len(self._layouts) >= self.size:  # masters made again (moved, reconverted): forget the oldest
            del self._layouts[next(iter(self._layouts))]
        layout = self._layouts[key] = FlatLayout(tensors) if fits else None
        return layout

    def clear(self) -> None:
        self._layouts.clear()
