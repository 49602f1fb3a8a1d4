"""The half weights of the parameters with masters as views of one flat buffer per device, laid out chunk by chunk.

A pass over the weights is then one kernel over the buffer (or one per run of equal-sized weights, for a value per
weight), whatever the number of tensors: the check for weights that user code edited, the fingerprints of 16-bit
masters, the remainders beside them and the chunks of a chunked step, which are slices of the same layout. The
parameters keep their identity: each one's ``data`` is set to its view once, which keeps its autograd accumulator and
its hooks (same dtype and device). Only the half weights and the 16-bit remainders lie flat: fp32 masters and the
optimizer's state keep storages of their own, so ``state_dict()`` and checkpoints are unchanged.

User code may give a parameter other data (``p.data = p.data.clamp(...)``, ``module.to(device)``): :meth:`HalfWeights.
moved` finds such a parameter by its data pointer (one C-level pass), before anything trusts the buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Optional

import torch
from torch import Tensor

WORD = 4  # 2-byte values per 8-byte word: every tensor starts on a word


def slot(numel: int) -> int:
    """The elements a tensor of ``numel`` takes in a flat buffer: whole words (the rest of its last word unused)."""
    return -(-numel // WORD) * WORD


PERIOD = 65521  # the largest prime below 2**16: a word's weight in a fingerprint is its place modulo it, plus one


def fingerprints(runs: Sequence[Tensor], upper: bool = False, matmul: Optional[bool] = None) -> Tensor:
    """The fingerprint of each row of each of ``runs`` (``(count, n)`` int64 each: tensors' 2-byte values read as
    8-byte words): ``(rows, 2)`` wrapping sums, a row's sum and its sum weighted by each word's place (``1 + place %
    PERIOD``); ``upper``: ``(rows, 3)``, also the sum of its words' upper halves (their top two values, sign-extended)
    weighted by fixed pseudo-random odd numbers (by place, modulo ``PERIOD``). ``matmul``: weigh by integer
    matrix-vector products (``None``: on a CPU; elsewhere integer matmul may be missing, and products and sums are
    taken instead: the same numbers, as integer sums wrap the same in any order).

    An edit of one value changes the first. An edit that keeps the sum, such as a permutation of values or of rows
    (``flip``, a transpose, git re-basin's permutation of hidden units), changes the second. In those two a word's
    top value counts with a weight of ``2**48``: a change of its sign bit is ``2**63``, so two cancel, and rescales by
    powers of two cancel in 64s; the third sees it from bit 32 down, with weights that no arithmetic progression of
    places balances (a hidden unit's weights negated, or rescaled: every fourth value of a row). It costs about as
    much as the other two. An edit goes unseen where all the sums cancel exactly (words moved by a multiple of
    ``PERIOD`` places, or many changes). The temporaries are :data:`_BLOCK` words at most (one row's period where a
    period is more).

    Example:
        ```python
        w = torch.randn(2, 8).half()
        before = fingerprints([w.view(torch.int64)], upper=True)
        w[0] = w[0].roll(4)  # its two words swapped: the same sum
        changed = fingerprints([w.view(torch.int64)], upper=True) != before
        assert changed[:, 0].tolist() == [False, False] and changed[1].tolist() == [False] * 3 and changed[0, 1]
        ```
    """
    return Fingerprints(runs, upper, matmul)()


class Fingerprints:
    """:func:`fingerprints` of fixed ``runs``, its views made once: each call is a few kernels per run and no
    indexing (the weights' fingerprints are taken twice a step).

    Args:
        runs, upper, matmul: as :func:`fingerprints`'s; the runs' values are read at each call.

    Example:
        ```python
        w = torch.zeros(2, 8).half()
        prints = Fingerprints([w.view(torch.int64)], upper=True)
        before = prints()
        w[1, 0] = 1.0
        assert (prints() != before).any(1).tolist() == [False, True]
        ```
    """

    def __init__(self, runs: Sequence[Tensor], upper: bool = False, matmul: Optional[bool] = None) -> None:
        device = runs[0].device if runs else torch.device("cpu")
        ramp, mixed = _weights(device)
        self.matmul = device.type == "cpu" if matmul is None else matmul
        # one column per sum, written in place run by run; the kernels in the order they run, each shift just before
        # the product that reads its scratch
        self.out = torch.empty(3 if upper else 2, sum(w.shape[0] for w in runs), dtype=torch.int64, device=device)
        self.sequence: list[tuple[str, tuple[Tensor, ...]]] = []
        scratch, at = _shifted(device), 0
        for words in runs:
            count, width = words.shape
            self.sequence.append(("sum", (words, self.out[0, at : at + count])))
            for start in range(0, max(width, 1), PERIOD):  # a period at a time (more: rows of 512 KiB or more)
                block, n = words[:, start : start + PERIOD], min(PERIOD, width - start)
                weigh = "add" if start else "weigh"
                self.sequence.append((weigh, (block, ramp[:n], self.out[1, at : at + count])))
                step = max(1, _BLOCK // max(1, n))
                for first in range(0, count if upper else 0, step):  # rows at a time: the scratch stays in cache
                    rows = block[first : first + step]
                    high = scratch[: rows.numel()].view(rows.shape)
                    self.sequence.append(("shift", (rows, high)))
                    self.sequence.append((weigh, (high, mixed[:n], self.out[2, at + first : at + first + len(rows)])))
            at += count

    def __call__(self) -> Tensor:
        """The fingerprints now: ``(rows, 2)``, or ``(rows, 3)`` with ``upper``, a new tensor."""
        matmul = self.matmul
        for kind, args in self.sequence:
            if kind == "sum":
                torch.sum(args[0], 1, out=args[1])
            elif kind == "shift":
                torch.bitwise_right_shift(args[0], 32, out=args[1])
            elif kind == "weigh":
                words, w, where = args
                torch.mv(words, w, out=where) if matmul else torch.sum(words * w, 1, out=where)
            else:
                words, w, where = args
                where += words @ w if matmul else (words * w).sum(1)
        return self.out.t().clone()


#: words (256 KiB) of upper halves shifted at a time (a row's period where that is more): in a core's cache, and
#: never a step's peak
_BLOCK = 2**15


@cache
def _weights(device: torch.device) -> tuple[Tensor, Tensor]:
    """The fingerprints' weights on ``device``: the ramp ``1..PERIOD`` and ``PERIOD`` fixed pseudo-random odd numbers
    below ``2**31`` (the same in every process and run: a fingerprint is compared with one taken earlier)."""
    ramp = torch.arange(1, PERIOD + 1, dtype=torch.int64)
    generator = torch.Generator().manual_seed(0x5EED)
    mixed = torch.randint(0, 2**30, (PERIOD,), dtype=torch.int64, generator=generator) * 2 + 1
    return ramp.to(device), mixed.to(device)


@cache
def _shifted(device: torch.device) -> Tensor:
    """The scratch of the upper halves shifted down (``upper`` fingerprints), kept per device."""
    return torch.empty(max(_BLOCK, PERIOD), dtype=torch.int64, device=device)


# memory formats whose strides a view of a flat buffer can keep (a channels-last convolution stays channels-last)
_DENSE_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


@dataclass(frozen=True)
class Run:
    """Tensors of one size lying side by side: a value per tensor is one reduction over a ``(count, numel)`` view."""

    first: int  # the first tensor's position in the layout
    count: int
    numel: int  # elements of each one's slot (its own, then unused ones up to a whole word)
    offset: int  # the first tensor's first element in the flat buffer


@dataclass(frozen=True)
class Chunk:
    """A slice of the layout: tensors ``[first, stop)``, elements ``[offset, offset + numel)``."""

    first: int
    stop: int
    offset: int
    numel: int
    runs: tuple[Run, ...]


def ranges(sizes: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges of ``sizes`` holding about ``budget`` elements each (a larger one alone).

    Example:
        ```python
        assert ranges([3, 3, 3, 10, 1], 6) == [(0, 2), (2, 4), (4, 5)]
        ```
    """
    out, start, size = [], 0, 0
    for i, n in enumerate(sizes):
        size += n
        if size >= budget:
            out.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


class ChunkLayout:
    """Where tensors lie in one flat buffer: a chunk of about ``chunk`` elements at a time, in their order, and inside a
    chunk sorted by size, so that equal sizes lie side by side (:class:`Run`). Each tensor starts on an 8-byte word of
    2-byte values (:func:`slot`), so that a value per tensor is a sum of words; the unused elements stay zero.

    Args:
        tensors: the tensors to lay out (their shapes and dense strides are kept).
        chunk: about how many elements each chunk holds (a larger tensor is a chunk of its own).

    Example:
        ```python
        layout = ChunkLayout([torch.zeros(2, 3), torch.zeros(4), torch.zeros(2, 3)], chunk=100)
        flat = torch.arange(float(layout.numel))
        views = layout.views(flat)
        assert [tuple(v.shape) for v in views] == [(4,), (2, 3), (2, 3)] and layout.chunks[0].runs[1].count == 2
        assert layout.numel == 4 + 8 + 8  # each tensor on whole words of four elements
        ```
    """

    def __init__(self, tensors: Sequence[Tensor], chunk: int) -> None:
        order: list[int] = []
        chunks: list[Chunk] = []
        offset = 0
        for start, stop in ranges([t.numel() for t in tensors], chunk):
            first, begin = len(order), offset
            runs: list[Run] = []
            for i in sorted(range(start, stop), key=lambda i: slot(tensors[i].numel())):  # stable: order kept
                n = slot(tensors[i].numel())
                if runs and runs[-1].numel == n:
                    last = runs[-1]
                    runs[-1] = Run(last.first, last.count + 1, n, last.offset)
                else:
                    runs.append(Run(len(order), 1, n, offset))
                order.append(i)
                offset += n
            chunks.append(Chunk(first, len(order), begin, offset - begin, tuple(runs)))
        self.tensors = [tensors[i] for i in order]
        self.chunks = chunks
        self.numel = offset
        self.offsets = [r.offset + k * r.numel for c in chunks for r in c.runs for k in range(r.count)]
        self.position = {t: i for i, t in enumerate(self.tensors)}  # tensors hash by identity
        self._shapes = [(t.shape, _dense_strides(t)) for t in self.tensors]

    def views(self, flat: Tensor, chunk: Optional[Chunk] = None) -> list[Tensor]:
        """Views of ``flat`` shaped (and strided) as the tensors, in the layout's order: of every tensor, or of
        ``chunk``'s, with ``flat`` holding that chunk alone."""
        first, stop, base = (0, len(self.tensors), 0) if chunk is None else (chunk.first, chunk.stop, chunk.offset)
        at = flat.storage_offset() - base
        return [
            flat.as_strided(shape, stride, at + offset)
            for (shape, stride), offset in zip(self._shapes[first:stop], self.offsets[first:stop])
        ]

    def view(self, flat: Tensor, position: int) -> Tensor:
        """The view of ``flat`` (the whole buffer) shaped as the tensor at ``position``."""
        shape, stride = self._shapes[position]
        return flat.as_strided(shape, stride, flat.storage_offset() + self.offsets[position])

    def shape_of(self, position: int) -> tuple[torch.Size, tuple[int, ...]]:
        """The shape and strides of the tensor at ``position`` in its views."""
        return self._shapes[position]

    def rows(self, flat: Tensor, run: Run, chunk: Optional[Chunk] = None) -> Tensor:
        """``run``'s tensors in ``flat`` (the whole buffer, or ``chunk``'s slice of it) as a ``(count, numel)``
        view."""
        start = run.offset - (0 if chunk is None else chunk.offset)
        return flat[start : start + run.count * run.numel].view(run.count, run.numel)


def run_words(layout: ChunkLayout, flat: Tensor, chunk: Chunk, alone: bool = False) -> list[Tensor]:
    """Each run of ``chunk`` as ``(count, words)`` int64 rows of ``flat``'s 2-byte values, the input of
    :func:`fingerprints`: ``flat`` is the whole buffer, or (``alone``) one holding ``chunk`` alone from its start.

    Example:
        ```python
        layout = ChunkLayout([torch.zeros(8), torch.zeros(3)], chunk=100)
        words = run_words(layout, torch.zeros(layout.numel, dtype=torch.float16), layout.chunks[0])
        assert [tuple(w.shape) for w in words] == [(1, 1), (1, 2)]
        ```
    """
    bits = flat.view(torch.int16)
    return [
        layout.rows(bits, run, chunk if alone else None).view(torch.int64)
        if run.numel
        else torch.zeros(run.count, 0, dtype=torch.int64, device=flat.device)  # empty tensors: no words to view
        for run in chunk.runs
    ]


def _dense_strides(t: Tensor) -> tuple[int, ...]:
    """``t``'s strides where a view of a flat buffer can have them (a dense memory format), else contiguous ones."""
    for memory_format in _DENSE_FORMATS:
        if t.is_contiguous(memory_format=memory_format):
            return tuple(t.stride())
    return tuple(torch.empty(t.shape, device="meta").stride())


class HalfWeights:
    """Half-precision parameters whose data are views of one flat buffer (see the module's docstring).

    Args:
        params: parameters of one half dtype on one device, each with a master.
        chunk: about how many elements each chunk of the layout holds.

    Example:
        ```python
        w = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float16))
        b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
        halves = HalfWeights([w, b], chunk=2**24)
        assert w.untyped_storage().data_ptr() == halves.flat.untyped_storage().data_ptr()
        assert halves.moved() == [] and torch.equal(halves.flat, torch.tensor([1, 1, 1, 1, 0, 0, 0, 0.0]).half())
        ```
    """

    def __init__(self, params: Sequence[Tensor], chunk: int) -> None:
        self.layout = ChunkLayout(params, chunk)
        self.params = self.layout.tensors
        first = self.params[0]
        self.flat = torch.zeros(self.layout.numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, view in zip(self.params, self.layout.views(self.flat)):
                view.copy_(p.detach())
                p.data = view  # same dtype and device: the parameter keeps its accumulator, hooks and version
        self._pointers = list(map(Tensor.data_ptr, self.params))
        self._strides = list(map(Tensor.stride, self.params))
        # per chunk, each run's weights as rows of 8-byte words: views made once, for the fingerprints
        self._words = [run_words(self.layout, self.flat, c) for c in self.layout.chunks]
        self._all_words = [words for chunk in self._words for words in chunk]
        self._prints: dict[tuple[Optional[int], bool], Fingerprints] = {}  # made when first taken

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def device(self) -> torch.device:
        return self.flat.device

    def fingerprints(self, k: Optional[int] = None, upper: bool = False) -> Tensor:
        """The :func:`fingerprints` of chunk ``k``'s weights (of every weight: ``None``), in the layout's order:
        ``(weights, 2)``, or ``(weights, 3)`` with ``upper``."""
        key = (k, upper)
        prints = self._prints.get(key)
        if prints is None:
            prints = self._prints[key] = Fingerprints(self._all_words if k is None else self._words[k], upper)
        return prints()

    def attached(self, position: int) -> bool:
        """Whether the data of the parameter at ``position`` is still its view of the buffer."""
        p = self.params[position]
        return p.data_ptr() == self._pointers[position] and p.stride() == self._strides[position]

    def view(self, position: int) -> Tensor:
        """The parameter at ``position``'s view of the buffer (its data, unless user code replaced it)."""
        return self.layout.view(self.flat, position)

    def moved(self) -> list[int]:
        """Positions of the parameters whose data is no longer their view of the buffer (replaced by user code, also
        by another view of the same memory such as ``p.data = p.data.t()``, or moved with the module): a comparison of
        data pointers and strides, in C, when none moved."""
        now, strides = list(map(Tensor.data_ptr, self.params)), list(map(Tensor.stride, self.params))
        if now == self._pointers and strides == self._strides:
            return []
        return [
            i for i, (a, b, s, t) in enumerate(zip(now, self._pointers, strides, self._strides)) if a != b or s != t
        ]

    def reattach(self, positions: Sequence[int]) -> None:
        """Put the current values of the parameters at ``positions`` into the buffer and make their data their views
        again (their values, whatever their format now, rounded to the buffer's)."""
        views = self.layout.views(self.flat)
        with torch.no_grad():
            for i in positions:
                p = self.params[i]
                views[i].copy_(p.detach())
                p.data = views[i]
                self._pointers[i], self._strides[i] = p.data_ptr(), p.stride()

    def detach(self) -> None:
        """Give every parameter data of its own again (a copy of its view), before the buffer is dropped."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.data_ptr() == self._pointers[i]:
                    p.data = p.detach().clone()
