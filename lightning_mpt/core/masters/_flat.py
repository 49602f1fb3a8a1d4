"""Many tensors allocated as views of one flat buffer: the fp32 gradients of a step's masters come from one
allocation (and are unscaled by one kernel over that buffer) instead of one allocation per tensor, whose host cost
grows with the number of tensors (400 ``empty_like`` calls cost about as much as the rest of the step's own work).
The buffer and its views are made once and reused from step to step while nothing else holds them; between steps
their memory is given back."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Generic, Optional, TypeVar

import torch
from torch import Tensor

from lightning_mpt import _compat


class _ReusedBuffer:
    """A buffer and its views, kept for the next step, with the counts of what holds them when nothing but this does.

    Args:
        numel, dtype, device: the buffer's.
        views_of: makes the views of the buffer.
    """

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, views_of: Callable[[Tensor], list[Tensor]]
    ):
        self.flat = torch.empty(numel, dtype=dtype, device=device)  # held by this attribute alone
        self.views = views_of(self.flat)
        self.nbytes = self.flat.untyped_storage().nbytes()
        self.counts = self._counts()
        # its memory given back while nothing held it: the views are reachable through this object alone since,
        # so it is free until it wakes (no count to take again)
        self.asleep = False

    def _counts(self) -> tuple[int, int, int, int]:
        """Tensors sharing the storage (views, whoever holds them, Python or C++), and Python references to the views
        (a hook may keep a gradient), to the buffer (a view's ``_base``) and to the storage (``untyped_storage()``).
        The views' counts are summed: taken first while only ``views`` holds them, no count can be lower later."""
        return (
            _compat.storage_holders(self.flat),
            sum(map(sys.getrefcount, self.views)),
            sys.getrefcount(self.flat),
            sys.getrefcount(self.flat.untyped_storage()),
        )

    def free(self) -> bool:
        """Whether nothing else holds the buffer, its storage, a view of it, or one of its views' Python objects: only
        then may its memory be given back, or its values overwritten."""
        return self._counts() == self.counts

    def sleep(self) -> bool:
        """Give the memory back, keeping the views; ``False`` where the storage cannot be resized."""
        try:
            self.flat.untyped_storage().resize_(0)
        except RuntimeError:
            return False
        self.asleep = True
        return True

    def wake(self) -> None:
        storage = self.flat.untyped_storage()
        if storage.nbytes() != self.nbytes:
            storage.resize_(self.nbytes)
        self.asleep = False


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
        self.offsets = [0]  # where each shape's block starts in the flat buffer
        for count, _, n in self.blocks:
            self.offsets.append(self.offsets[-1] + count * n)
        self.numel = self.offsets.pop()
        self.position = [0] * len(tensors)  # tensor i -> its view's place in the blocks' order
        for pos, i in enumerate(i for idx in groups.values() for i in idx):
            self.position[i] = pos
        self._kept: dict[tuple[str, torch.dtype, torch.device], _ReusedBuffer] = {}

    def views(self, dtype: torch.dtype, device: torch.device, purpose: str = "") -> tuple[Tensor, list[Tensor]]:
        """A flat buffer and the views of it shaped as the tensors, in their order (contiguous each), their values
        undefined: the last call's for the same ``purpose`` again when nothing else holds them now (see
        :meth:`release`), else new ones. Each use held at once needs a purpose of its own: the caller's own lists do
        not count as holding the views."""
        key = (purpose, dtype, device)
        kept = self._kept.get(key)
        if kept is not None:
            if kept.asleep or kept.free():
                kept.wake()
                return kept.flat, kept.views
            del self._kept[key]  # a holder keeps them: theirs now
        kept = self._kept[key] = _ReusedBuffer(self.numel, dtype, device, self._views_of)
        return kept.flat, kept.views

    def _views_of(self, flat: Tensor) -> list[Tensor]:
        parts: list[Tensor] = []
        offset = 0
        for count, shape, n in self.blocks:
            parts.extend(flat[offset : offset + count * n].view(count, *shape).unbind(0))
            offset += count * n
        return [parts[j] for j in self.position]

    def release(self, purpose: Optional[str] = None) -> None:
        """Between steps: the memory of each buffer (of ``purpose``, or all) that nothing else holds goes back (its
        views are kept for the next step); a buffer that something still holds is forgotten, and freed when its holder
        lets go."""
        for key, kept in list(self._kept.items()):
            if kept.asleep or (purpose is not None and key[0] != purpose):
                continue
            if not (kept.free() and kept.sleep()):
                del self._kept[key]


V = TypeVar("V")


class PerList(Generic[V]):
    """Values made once per list of tensors, keyed by the tensors' ids, the oldest forgotten past ``size``; the list
    asked for last is found by identity alone (a plan's lists stay unchanged from step to step: no key is built).

    Args:
        make: the value of a list not seen yet.
        size: the most lists remembered (masters made again, moved or reconverted, make new lists); ``None``: all.

    Example:
        ```python
        sizes = PerList(lambda tensors: sum(t.numel() for t in tensors))
        tensors = [torch.zeros(2), torch.zeros(3)]
        assert sizes.get(tensors) == 5 and sizes.get(list(tensors)) == 5  # the same tensors: the same key
        ```
    """

    def __init__(self, make: Callable[[list[Tensor]], V], size: Optional[int] = 16) -> None:
        self.make = make
        self.size = size
        self.values: dict[tuple[int, ...], V] = {}
        self._last: Optional[tuple[list[Tensor], V]] = None  # the list last asked for, held

    def get(self, tensors: list[Tensor]) -> V:
        last = self._last
        if last is not None and last[0] is tensors:
            return last[1]
        key = tuple(map(id, tensors))
        if key in self.values:
            value = self.values[key]
        else:
            if self.size is not None and len(self.values) >= self.size:
                del self.values[next(iter(self.values))]
            value = self.values[key] = self.make(tensors)
        self._last = (tensors, value)
        return value

    def clear(self) -> None:
        self.values.clear()
        self._last = None


class FlatLayouts(PerList[Optional[FlatLayout]]):
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
        super().__init__(_layout_of, size)

    def release(self) -> None:
        """:meth:`FlatLayout.release` of every layout."""
        for layout in self.values.values():
            if layout is not None:
                layout.release()


def _layout_of(tensors: list[Tensor]) -> Optional[FlatLayout]:
    """The :class:`FlatLayout` of ``tensors``, ``None`` where they cannot lie flat."""
    first = tensors[0]
    fits = all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device for t in tensors)
    return FlatLayout(tensors) if fits else None
