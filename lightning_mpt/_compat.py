"""The one seam for private torch, Lightning, TensorBoard and torchmetrics symbols.

Every use of a ``_``-prefixed name of another library goes through a function or constant here, with a comment
saying why no public API does the job and in which versions the symbol exists (checked against the dependency
floors of pyproject.toml: torch >= 2.3, lightning >= 2.4, torchmetrics >= 1.0, tensorboard >= 2.14, and the
versions the tests run with). When a library changes, this file is the only place to look.

This module imports nothing beyond torch, so that log readers (``lightning-mpt report``) stay fast to start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

# --- diagnostics and report


def event_file_writer(summary_writer: Any) -> Any:
    """The ``FileWriter`` behind a ``SummaryWriter`` (torch's or tensorboardX's), (re)opened if it was closed.

    Why: ``SummaryWriter`` has no public method that writes a ``Summary`` proto as given. The monitors need it for
    (a) one event holding all of a step's scalars (``add_scalar`` per tag makes one event each: 12 ms instead of
    1 ms for 250 scalars, measured) and (b) tensor summaries with lightning-mpt's own plugin metadata (the
    ``mpt/data/`` records). The public attribute ``SummaryWriter.file_writer`` is ``None`` once the writer was
    closed (Lightning closes it at the end of ``fit``); ``_get_file_writer()`` reopens it, as ``add_scalar`` does.
    Exists: ``torch.utils.tensorboard.SummaryWriter._get_file_writer`` since torch 1.1 (through 2.13);
    ``tensorboardX.SummaryWriter._get_file_writer`` since tensorboardX 1.5.
    """
    return summary_writer._get_file_writer()


def should_accumulate(trainer: Any) -> bool:
    """Whether Lightning accumulates the gradients of the batch just run instead of stepping the optimizer.

    Why: the stored half gradients are measured at ``on_after_backward``, before Lightning decides to step; the
    only other way to know is to re-derive Lightning's rule (accumulation count, last batch of the epoch, a
    strategy that accumulates itself) from loop internals, which is worse.
    Exists: ``_FitLoop._should_accumulate()`` in Lightning 2.0 through 2.6.
    """
    return bool(trainer.fit_loop._should_accumulate())


def tensor_version(tensor: Tensor) -> int:
    """The counter of in-place modifications of ``tensor``.

    Why: the monitors of one step share the exponent histograms of the stored gradients; the cache must be
    recomputed when a callback between them edits a gradient in place (``grad[0] = inf``), which only this counter
    shows. No public equivalent.
    Exists: ``Tensor._version`` in every torch release since 0.4 (autograd's saved-tensor check uses it).
    """
    return tensor._version


def foreach_norm(tensors: Sequence[Tensor], ord: float) -> Sequence[Tensor]:
    """The ``ord``-norm of each tensor, one kernel per device and dtype.

    Why: one norm per parameter would launch one kernel per parameter; there is no public batched per-tensor norm
    (``torch.nn.utils.get_total_norm`` returns only the total).
    Exists: ``torch._foreach_norm`` since torch 1.13; ``ord=inf`` since torch 2.0 (through 2.13).
    """
    return torch._foreach_norm(list(tensors), ord)


# torchmetrics ``Metric`` attributes outside ``metric_state`` that ``update``/``forward``/``compute`` change: the
# fp32 reference re-runs ``training_step``, which may update the module's metrics, and restores them all.
# Why: ``Metric.metric_state`` (public) holds only the declared states, ``reset()`` would lose them, and a
# ``deepcopy`` of every metric per reference step would copy their whole state twice.
# Exists: ``_update_count``, ``_computed``, ``_forward_cache`` and ``_is_synced`` in torchmetrics 0.7 through 1.9;
# ``_cache`` (the states saved by ``sync``) in 0.9 through 1.9. Missing names are skipped.
METRIC_CACHE_ATTRIBUTES = ("_update_count", "_computed", "_forward_cache", "_is_synced", "_cache")


def metric_private_state(metric: Any) -> dict[str, Any]:
    """The values of :data:`METRIC_CACHE_ATTRIBUTES` that ``metric`` has, to restore with ``setattr``."""
    return {k: metric.__dict__[k] for k in METRIC_CACHE_ATTRIBUTES if k in metric.__dict__}
