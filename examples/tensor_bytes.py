"""Counting the bytes that tensors hold, for the memory examples: shards, shared storages and tensor subclasses.

A tensor's bytes are what its storage holds for it, not ``numel * element_size`` of what it shows: torchao's 8-bit
and 4-bit optimizer states show as fp32 tensors but hold uint8 codes and fp32 block scales, so a subclass that
flattens (``__tensor_flatten__``) is counted by its inner tensors. An FSDP2 ``DTensor`` is counted by its local shard.

Example::

    import torch
    from tensor_bytes import nbytes

    w = torch.zeros(4, 4)
    assert nbytes([w, w, w[0]], set()) == 64 + 16   # each view once, a tensor named twice once
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

try:  # FSDP2 (torch >= 2.6)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def local(t: Tensor) -> Tensor:
    """This process's part of ``t``: the local shard of an FSDP2 ``DTensor``, ``t`` itself otherwise.

    Args:
        t: any tensor.

    Example::

        assert local(torch.zeros(2)).shape == (2,)
    """
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def is_shard(t: Tensor) -> bool:
    """Whether ``t`` is an FSDP2 shard (a ``DTensor``).

    Args:
        t: any tensor.

    Example::

        assert not is_shard(torch.zeros(2))
    """
    return DTensor is not None and isinstance(t, DTensor)


def storage(t: Tensor) -> int:
    """The address of the storage that holds ``t`` (of its local shard).

    Args:
        t: a plain tensor or a ``DTensor``.

    Example::

        w = torch.zeros(4)
        assert storage(w[1:]) == storage(w)
    """
    return local(t).untyped_storage().data_ptr()


def parts(t: Tensor) -> list[Tensor]:
    """The plain tensors that hold ``t``: its inner tensors for a flattening subclass (torchao's ``OptimState8bit``:
    codes and scales), recursively, else ``t`` itself.

    Args:
        t: any tensor.

    Example::

        assert len(parts(torch.zeros(2))) == 1
    """
    if type(t) is not Tensor and hasattr(t, "__tensor_flatten__") and not is_shard(t):
        names, _ = t.__tensor_flatten__()
        return [p for name in names for p in parts(getattr(t, name))]
    return [t]


def nbytes(tensors: Any, counted: set[Any]) -> int:
    """Bytes of ``tensors`` (their local shards, their inner tensors) not in ``counted`` yet (which they join).

    A tensor is counted once however many names it has (a module's gradient that is its master's gradient), and views
    of one buffer (FSDP's gradient shards of a group) each count.

    Args:
        tensors: an iterable of tensors or ``None``.
        counted: keys of the tensors counted so far; updated.

    Example::

        seen: set = set()
        assert nbytes([torch.zeros(2)], seen) == 8
    """
    total = 0
    for t in tensors:
        if t is None:
            continue
        for p in parts(local(t)):
            key = (p.untyped_storage().data_ptr(), p.storage_offset(), p.numel(), p.dtype)
            if key not in counted:
                counted.add(key)
                total += p.numel() * p.element_size()
    return total


def is_weight_cast(t: Tensor) -> bool:
    """Whether ``t`` is (a view of) a dtype cast of a leaf that requires grad: autocast's per-op copy of a weight.

    Args:
        t: a tensor autograd saved for the backward.

    Example::

        w = torch.nn.Parameter(torch.zeros(2))
        assert is_weight_cast(w.half()) and not is_weight_cast(w * 2)
    """
    fn = (t._base if t._is_view() else t).grad_fn  # linear saves the transposed view of the cast weight
    return (
        fn is not None
        and fn.name() == "ToCopyBackward0"
        and any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None)
    )


def master_tensors(plugin: Any, optimizer: Any) -> list[Any]:
    """The tensors holding the masters: ``MPTPrecision.master_storage()`` (the int16 remainders of masters stored in
    16 bits, without waking them), else Lightning's ``main_params(optimizer)``."""
    held = getattr(plugin, "master_storage", None)
    return list(held() if held is not None else plugin.main_params(optimizer))
