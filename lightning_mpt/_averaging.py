"""Lightning's weight-averaging callbacks under :class:`~lightning_mpt.MPTPrecision`: they average the fp32 masters.

``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``) read the module's parameters to update
their average and write the average into them: ``WeightAveraging`` swaps it in before each validation and back after
it, and both copy it in at the end of fit. Under the plugin the module's parameters are half precision, so the average
would be fed rounded weights and, swapped in and back, be rounded itself at every validation. While a stage runs, each
such callback object is handed a view of the masters in place of the module (instance attributes that
:meth:`Adapted.release` removes), so the average is fed, swapped and copied in fp32, exactly; the half weights are
refreshed from the masters after every write, and validation runs with the average rounded to the half format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch.callbacks as lightning_callbacks
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module

from lightning_mpt import _compat
from lightning_mpt.core.masters import Masters
from lightning_mpt.core.masters.copies import CopyMasters

__all__ = ["Adapted", "MasterView", "adapt"]

# StochasticWeightAveraging reads and writes the module through these two public static methods
_SWA_METHODS = ("update_parameters", "transfer_weights")
# WeightAveraging's hooks that update the average from the module, that swap the two around validation, and that copy
# the average into the module at the end of fit
_WA_READS = ("on_train_batch_end", "on_train_epoch_end")
_WA_SWAPS = ("on_validation_epoch_start", "on_validation_epoch_end")
_WA_HOOKS = (*_WA_READS, *_WA_SWAPS, "on_train_end")


@dataclass
class Adapted:
    """A weight-averaging callback pointed at the masters, and the instance attributes that do it."""

    callback: Any
    names: tuple[str, ...]

    def release(self) -> None:
        """Remove the instance attributes: the callback's own class methods apply again."""
        for name in self.names:
            self.callback.__dict__.pop(name, None)


def adapt(callbacks: Iterable[Any], masters: Masters) -> list[Adapted]:
    """Point the weight-averaging callbacks among ``callbacks`` at the fp32 masters for the stage that starts.

    Subclasses that override a method the adaptation replaces are left alone, with a warning.

    Args:
        callbacks: the Trainer's callbacks; those that are no weight-averaging callback are ignored.
        masters: the plugin's masters.

    Returns:
        The adapted callbacks, to :meth:`Adapted.release` at teardown.
    """
    weight_averaging: Optional[type] = getattr(lightning_callbacks, "WeightAveraging", None)  # lightning >= 2.6
    adapted = []
    for callback in callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            adapted.append(_adapt_swa(callback, masters))
        elif weight_averaging is not None and isinstance(callback, weight_averaging):
            adapted.append(_adapt_weight_averaging(callback, weight_averaging, masters))
    return [a for a in adapted if a.names]


def _overridden(callback: Any, base: type, names: Iterable[str]) -> list[str]:
    cls = type(callback)
    return [n for n in names if getattr(cls, n, None) is not getattr(base, n, None)]


def _warn_overridden(callback: Any, overridden: list[str], advice: str) -> None:
    rank_zero_warn(
        f"MPTPrecision: {type(callback).__name__} overrides {', '.join(overridden)}, so it is not adapted to the "
        "fp32 master weights: it averages the half-precision weights, and an average written into them is rounded "
        f"to the half format. {advice}, or average `trainer.precision_plugin.master_of(p)` yourself for an "
        "fp32-accurate average."
    )


def _adapt_swa(callback: Any, masters: Masters) -> Adapted:
    overridden = _overridden(callback, StochasticWeightAveraging, _SWA_METHODS)
    if overridden:
        _warn_overridden(callback, overridden, "Leave these methods to StochasticWeightAveraging")
        return Adapted(callback, ())

    # SWA only calls .parameters() on what it is given: a view of the masters stands in for the module
    def update_parameters(average_model: Any, model: Module, n_averaged: Tensor, avg_fn: Any) -> None:
        _absorb_edits(masters)
        view: Any = MasterView(model, masters)
        StochasticWeightAveraging.update_parameters(average_model, view, n_averaged, avg_fn)

    def transfer_weights(src_pl_module: Any, dst_pl_module: Module) -> None:
        view: Any = MasterView(dst_pl_module, masters)
        StochasticWeightAveraging.transfer_weights(src_pl_module, view)
        _refresh(masters)

    setattr(callback, "update_parameters", update_parameters)
    setattr(callback, "transfer_weights", transfer_weights)
    return Adapted(callback, _SWA_METHODS)


def _adapt_weight_averaging(callback: Any, base: type, masters: Masters) -> Adapted:
    # the hooks hand the view on to these helpers: an override of them would receive the view, not the module
    overridden = _overridden(callback, base, _WA_HOOKS + _compat.WEIGHT_AVERAGING_HELPERS)
    if overridden:
        _warn_overridden(callback, overridden, f"Customize {base.__name__} through `should_update`")
        return Adapted(callback, ())
    for name in _WA_HOOKS:
        setattr(callback, name, _hook_on_masters(callback, getattr(base, name), masters, name))
    return Adapted(callback, _WA_HOOKS)


def _hook_on_masters(callback: Any, hook: Callable[..., None], masters: Masters, name: str) -> Callable[..., None]:
    """``hook`` of ``callback`` run on a view of the masters in place of the LightningModule."""
    writes = name not in _WA_READS

    def on_masters(trainer: Any, pl_module: Module, *args: Any, **kwargs: Any) -> None:
        _absorb_edits(masters)
        hook(callback, trainer, MasterView(pl_module, masters), *args, **kwargs)
        if writes:
            _refresh(masters)

    return on_masters


class MasterView:
    """What weight-averaging code reads as a module: the fp32 masters, in the order of ``module.parameters()`` (a
    shared parameter once; parameters without a separate master, such as norm layers', as themselves), and the
    module's own buffers.

    Example:
        ```python
        import torch
        from torch import nn

        from lightning_mpt.core.masters.copies import CopyMasters

        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        masters = CopyMasters(torch.float16)
        masters.convert(model)
        view = MasterView(model, masters)
        assert [p.dtype for p in view.parameters()] == [torch.float32] * 4
        assert len(list(view.buffers())) == 3  # BatchNorm's running statistics and batch count
        masters.restore()
        ```
    """

    def __init__(self, module: Module, masters: Masters) -> None:
        self.module, self.masters = module, masters

    def parameters(self, recurse: bool = True) -> Iterator[Tensor]:
        return iter([self.masters.master_of(p) for p in self.module.parameters(recurse)])

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        return self.module.buffers(recurse)


def _absorb_edits(masters: Masters) -> None:
    """Take an in-place edit of the half weights since the last step (a clamp in ``on_train_batch_end``, in an
    overridden ``optimizer_step`` or in a callback before the averaging one, or one during validation) into the masters
    before the average reads them or a swap moves them, and before a refresh would overwrite it: one check of every
    weight, one host sync (FSDP2's shards are the weights: nothing to take)."""
    if isinstance(masters, CopyMasters):
        masters.absorb_all_edits()


def _refresh(masters: Masters) -> None:
    """Write the masters into the half weights (FSDP2's shards are the weights: nothing to write)."""
    if isinstance(masters, CopyMasters):
        masters.refresh()
