"""The one seam for private torch, Lightning, TensorBoard and torchmetrics symbols.

Every use of a ``_``-prefixed name of another library goes through a function or constant here, with a comment
saying why no public API does the job and in which versions the symbol exists (checked against the dependency
floors of pyproject.toml: torch >= 2.4, lightning >= 2.4, torchmetrics >= 1.0, tensorboard >= 2.18, and the
versions the tests run with). When a library changes, this file is the only place to look.

This module imports nothing beyond torch, so that log readers (``lightning-mpt report``) stay fast to start.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

# --- core: the optimizer step -----------------------------------------------------------------------------------------

# torch >= 2.13: a parameter may hold a gradient of another dtype once ``grad_dtype`` is set to None (public attribute;
# feature-tested, not version-tested). The plugin then hands hooks and clipping the fp32 gradients on the module's own
# parameters and frees the half ones at the step.
GRAD_DTYPE = hasattr(Tensor, "grad_dtype")


# The fused kernels of the step, bound as they are (no wrapper call per use on the hot path). Why private: torch's
# ``GradScaler`` and ``clip_grad_norm_`` use these same ops and expose no public equivalent; ``torch._foreach_*`` exist
# since torch 1.7 (``_foreach_copy_`` since 2.1) and the fused unscale since 1.10.

#: ``grads[i] *= inv_scale`` in place, ``found_inf`` set where a value is non-finite: behind ``GradScaler.unscale_``;
#: one launch per device and dtype, no host sync. Called as ``unscale_(grads, found_inf, inv_scale)``.
unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
#: ``dst[i].copy_(src[i])`` in one fused launch, casting as needed.
foreach_copy_ = torch._foreach_copy_
#: ``dst[i] -= src[i]`` in one fused launch.
foreach_sub_ = torch._foreach_sub_
#: ``t *= factor`` for every tensor, in one fused launch.
foreach_mul_ = torch._foreach_mul_


def storage_holders(tensor: Tensor) -> int:
    """How many tensors (views included, whoever holds them, Python or C++: an autograd graph, a collective) share
    ``tensor``'s storage now.

    Why: the plugin reuses the buffer of a step's fp32 gradients at the next step, which is safe only when nothing
    outside it still holds a view of the buffer: a Python reference count does not see a view made from a view, nor a
    tensor held by C++. No public API counts a storage's users.
    Exists: ``torch._C._storage_Use_Count`` in torch 2.1 and later (checked on 2.4 and 2.13).
    """
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


def version(tensor: Tensor) -> int:
    """The counter of in-place modifications of ``tensor``.

    Why: only this counter shows an in-place edit of a tensor. The plugin uses it to notice hooks that edited a
    gradient or clipped a master gradient between the unscale and the step; the monitors of one step share the
    exponent histograms of the stored gradients and recompute them when a callback edits a gradient in place
    (``grad[0] = inf``). No public equivalent.
    Exists: ``Tensor._version`` in every torch release since 0.4 (autograd's saved-tensor check uses it).
    """
    return tensor._version


def register_state_dict_post_hook(module: torch.nn.Module, hook: Any) -> Any:
    """``module.register_state_dict_post_hook(hook)``: public from torch 2.5 (hook(module, state_dict, prefix,
    local_metadata)); torch 2.4 has the same hook only as ``module._register_state_dict_hook``. The masters are
    written into a module's ``state_dict`` this way."""
    public = getattr(module, "register_state_dict_post_hook", None)
    if public is not None:
        return public(hook)
    return module._register_state_dict_hook(hook)


def register_load_state_dict_pre_hook(module: torch.nn.Module, hook: Any) -> Any:
    """``module.register_load_state_dict_pre_hook(hook)``: public from torch 2.5 (hook(module, state_dict, prefix,
    ...)); torch 2.4 has it as ``module._register_load_state_dict_pre_hook(hook, with_module=True)``. Loaded values
    reach the masters this way."""
    public = getattr(module, "register_load_state_dict_pre_hook", None)
    if public is not None:
        return public(hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)


def mark_optimizer_stepped(optimizer: Optimizer) -> None:
    """Tell torch's LR schedulers that ``optimizer.step()`` ran, for a step the plugin skipped (as
    ``torch.amp.GradScaler`` does, the optimizer is not called at all): otherwise a run whose first steps overflow gets
    torch's "lr_scheduler.step() before optimizer.step()" warning. torch >= 2.0 reads ``optimizer._opt_called``."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def after_closure(plugin: Any, model: Any, optimizer: Any) -> None:
    """Lightning's ``Precision._after_closure`` (lightning >= 2.0): the ``on_before_optimizer_step`` hooks, then
    gradient clipping, in Lightning's own order. The plugin calls it rather than copying its body."""
    from lightning.pytorch.plugins.precision import Precision

    Precision._after_closure(plugin, model, optimizer)


def attached_trainer(module: Any) -> Optional[Any]:
    """The Trainer a LightningModule is attached to, or ``None`` (lightning >= 2.0 keeps it in ``_trainer``; the public
    ``module.trainer`` raises when there is none)."""
    return getattr(module, "_trainer", None)


def logged_results(trainer: Any) -> Optional[dict[str, Any]]:
    """What ``self.log`` logged in the loop running now: its ``_ResultCollection``, a dict from a key per logged name
    to a ``_ResultMetric`` (a torchmetrics ``Metric`` holding the running reduction), or ``None`` outside a loop.

    Why: ``overflow_retries`` runs ``training_step`` again on the same batch and must take back what a discarded try
    logged, or the epoch's aggregates count that batch once per try; Lightning has no public way to reach the logged
    values before the epoch ends. Exists: ``Trainer._results`` and the ``_ResultMetric`` attributes ``value``,
    ``cumulated_batch_size`` and ``has_reset`` in Lightning 2.0 through 2.6.6.
    """
    results: Optional[dict[str, Any]] = trainer._results
    return results


# Lightning's ``WeightAveraging`` (lightning >= 2.6, through 2.6.6) moves weights between the LightningModule and its
# average in two private methods, which its public hooks call with the module. The plugin hands those hooks a view of
# the fp32 masters in place of the module; a subclass that overrides one of these methods would receive that view, so
# such a subclass is left unadapted, with a warning. Why: no public method does the swap or the copy.
WEIGHT_AVERAGING_HELPERS = ("_swap_models", "_copy_average_to_current")


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


# --- torchao ----------------------------------------------------------------------------------------------------------


def float8_scale(tensor: Any) -> Tensor:
    """The scale torchao cast ``tensor`` (a ``Float8TrainingTensor``) with: ``_scale``, which torchao's own FSDP2
    all-gather hooks read and write (torchao >= 0.18)."""
    scale: Tensor = tensor._scale
    return scale


# --- FSDP2 (torch.distributed.fsdp.fully_shard) -----------------------------------------------------------------------


def fsdp_mp_policy(module: Any) -> Optional[Any]:
    """The ``MixedPrecisionPolicy`` that ``fully_shard(module, mp_policy=...)`` was given, or ``None`` if it cannot be
    read. FSDP2 has no public getter: the policy lives on the module's FSDP state as ``_mp_policy`` (torch 2.4 to
    2.13 at least; ``fully_shard.state(module)`` is the state accessor that torch's ``contract`` decorator documents).
    The plugin reads it once at set-up, to check that the model all-gathers in the plugin's half format."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    return getattr(state, "_mp_policy", None) if state is not None else None


@contextmanager
def fsdp_forward_hooks_suspended(module: torch.nn.Module) -> Iterator[int]:
    """Run without the forward hooks that ``fully_shard`` (FSDP2) registered on ``module`` and its submodules; yields
    how many it suspended. The fp32 reference re-runs a sharded model with whole fp32 weights swapped in
    (``torch.func.functional_call``): with FSDP's hooks on, its pre-forward hook would all-gather the half compute copy
    into the module attributes over those weights, and the hooks it registers for the backward would reduce-scatter
    into the step's real gradients. Without them nothing of FSDP runs. Only FSDP's own hooks are taken out (a user's
    hooks stay), and they are put back in their places in the hook dicts afterwards, also on an exception.

    Why: FSDP2 has no public switch for its hooks. Its state (``fully_shard.state(module)``, the accessor of torch's
    ``contract`` decorator) keeps the handles of the hooks it registered as ``_pre_forward_hook_handle`` and
    ``_post_forward_hook_handle``: a ``RemovableHandle`` each, or one ``_MultiHandle`` (public attribute ``handles``)
    for a ``fully_shard([a, b])`` group; a handle's public ``id`` and ``hooks_dict_ref`` name its entry.
    Exists: both attributes in torch 2.4 through 2.13 (``FSDPState.init``; ``fully_shard`` and ``FSDPModule`` are
    imported from their public place, torch >= 2.6, as in :mod:`lightning_mpt.core.masters.sharded`). A torch without
    them raises ``AttributeError`` here, which turns the reference off with a warning rather than measuring FSDP's half
    copy.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    handles: list[Any] = []
    states: set[int] = set()
    for m in module.modules():
        state = fully_shard.state(m) if isinstance(m, FSDPModule) else None  # type: ignore[attr-defined]
        if state is None or id(state) in states:  # a group's modules share one state
            continue
        states.add(id(state))
        for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
            handle = getattr(state, name)
            handles.extend(getattr(handle, "handles", (handle,)))
    taken: dict[int, tuple[dict[int, Any], list[int], dict[int, Any]]] = {}  # per hook dict: its order, the hooks out
    try:
        for handle in handles:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                entry = taken.setdefault(id(hooks), (hooks, list(hooks), {}))
                entry[2][handle.id] = hooks.pop(handle.id)
        yield sum(len(out) for _, _, out in taken.values())
    finally:
        for hooks, order, out in taken.values():
            hooks.update(out)
            place = {k: i for i, k in enumerate(order)}
            ordered = sorted(hooks.items(), key=lambda kv: place.get(kv[0], len(order)))  # new hooks stay last
            hooks.clear()
            hooks.update(ordered)


def forward_pre_hooks(module: torch.nn.Module) -> list[Any]:
    """The forward pre-hooks registered on ``module`` (torch keeps them in a private dict; the legacy hook-based
    ``spectral_norm`` and ``weight_norm`` are found there)."""
    return list(module._forward_pre_hooks.values())
