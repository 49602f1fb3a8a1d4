"""Noticing half weights that user code edited in place outside the optimizer step (a WGAN clamp,
``nn.Embedding(max_norm=...)``, a weight average copied in), so that the masters adopt the edits instead of the next
refresh undoing them. A half weight was edited when it differs from its master rounded to the half format."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_mpt import _compat


def edit_flags(
    params: list[Tensor], masters: list[Tensor], scratch: list[Tensor], groups: Optional[list[list[int]]] = None
) -> Tensor:
    """Whether each half weight differs from its rounded master, on the device (cast and compare in ``scratch``,
    which is overwritten). On CPU a single flag for all of them: :func:`edited_pairs` then finds which.

    Args:
        params: the half weights.
        masters: their fp32 masters.
        scratch: tensors like ``params``, overwritten (not used on CPU).
        groups: the indices of ``params`` of each shape, when known (on CPU each group is compared at once).

    Example:
        ```python
        w = torch.tensor([1.0, 2.0], dtype=torch.float16)
        m = torch.tensor([1.0, 2.0001])  # rounds to w: not an edit
        assert not edit_flags([w], [m], [torch.empty_like(w)]).any()
        w[0] = 3.0
        assert edit_flags([w], [m], [torch.empty_like(w)]).all()
        ```
    """
    if not params:
        return torch.zeros(0, dtype=torch.bool)
    if params[0].device.type == "cpu":
        # CPUs emulate half arithmetic (60 ms for 3.4M values) and pay per tensor in Python: one comparison of the
        # bit patterns of everything, a single flag; which parameters were edited is worked out only if one was
        if groups is None:
            groups = _by_shape(params)
        return _any_edited(params, masters, groups).reshape(1)
    _compat.foreach_copy_(scratch, masters)  # the masters rounded to the half format
    flags = torch.zeros(len(params), dtype=torch.bool, device=params[0].device)
    full = [i for i, t in enumerate(scratch) if t.numel()]  # an empty tensor cannot be edited (nor normed)
    if full:  # one fused launch per op: difference, then each tensor's largest
        _compat.foreach_sub_([scratch[i] for i in full], [params[i].detach() for i in full])
        changed = torch.stack(list(_compat.foreach_norm([scratch[i] for i in full], float("inf")))) != 0
        flags = (
            changed
            if len(full) == len(params)
            else flags.index_copy(0, torch.tensor(full, device=flags.device), changed)
        )
    return flags


def _by_shape(tensors: list[Tensor]) -> list[list[int]]:
    """The indices of ``tensors`` grouped by shape."""
    groups: dict[torch.Size, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.shape, []).append(i)
    return list(groups.values())


def _any_edited(params: list[Tensor], masters: list[Tensor], groups: list[list[int]]) -> Tensor:
    """Whether any half weight differs from its master rounded (0-dim): the weights, and the masters, of one shape
    (``groups``) stacked in one call each, not viewed or copied one by one from Python (which costs more than the
    comparison), the masters rounded in one cast (the rounding of a copy into the half format). A group of mixed
    dtypes is stacked in the widest: that may flag an unedited weight, never miss an edited one, and
    :func:`edited_pairs` compares each weight exactly once a flag is up."""
    with torch.no_grad():  # the weights' stack needs no autograd record
        halves = [torch.stack([params[i] for i in idx]).reshape(-1) for idx in groups]
        rounded = [torch.empty_like(h) for h in halves]  # the masters rounded straight into the half format
        for idx, r in zip(groups, rounded):  # (an fp32 stack of them would hold 4 more bytes per parameter)
            # views shaped as the masters: one unbind, not a reshape per master (each Python call costs microseconds)
            views = r.view(len(idx), *masters[idx[0]].shape).unbind(0)
            _compat.foreach_copy_(list(views), [masters[i] for i in idx])
        if len(groups) == 1:
            return bits_differ(halves[0], rounded[0])
        # one comparison per shape: concatenating the stacks would hold 4 more bytes per parameter at the step's peak
        return torch.stack([bits_differ(h, r) for h, r in zip(halves, rounded)]).any()


def edit_flags_of(pairs: list[tuple[Tensor, Tensor]]) -> list[float]:
    """:func:`edit_flags` of ``(half weight, master)`` pairs, read on the host (one sync)."""
    if not pairs:
        return []
    with torch.no_grad():
        flags = edit_flags([p for p, _ in pairs], [m for _, m in pairs], [torch.empty_like(p) for p, _ in pairs])
    return list(flags.tolist())


def edited_pairs(pairs: list[tuple[Tensor, Tensor]], flags: list[float]) -> list[tuple[Tensor, Tensor]]:
    """The ``(half weight, master)`` pairs that ``flags`` (host values of :func:`edit_flags`) mark as edited. Fewer
    flags than pairs (CPU flags a range of pairs at once) say only that one was: each is compared then, which is
    rare."""
    if len(flags) != len(pairs):  # a flag per range of pairs (CPU compares each range at once): one was edited
        if not any(flags):
            return []
        flags = [float(bits_differ(m.to(p.dtype), p)) for p, m in pairs]
    return [pair for pair, f in zip(pairs, flags) if f]


def copy_into_masters(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """Adopt the edits: each master takes its half weight's value."""
    if pairs:
        with torch.no_grad():
            _compat.foreach_copy_([m for _, m in pairs], [p for p, _ in pairs])


def bits_differ(a: Tensor, b: Tensor) -> Tensor:
    """Whether two half tensors of one shape differ in any bit (0-dim, on their device), compared as integers: as
    int64 words of four values where the layout allows, else value by value as int16."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    aligned = a.numel() % 4 == 0 and a.storage_offset() % 4 == 0 and b.storage_offset() % 4 == 0
    word = torch.int64 if aligned else torch.int16
    return torch.ne(a.view(word), b.view(word)).any()
