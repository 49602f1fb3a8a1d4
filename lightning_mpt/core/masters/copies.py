"""FP32 master copies of a module's half-precision parameters (one device and DDP).

:meth:`CopyMasters.convert` keeps each parameter's fp32 tensor as its master (no copy, so a master is never a
rounded half value) and gives the parameter a new half-precision tensor; modules of ``keep_fp32`` types keep fp32
parameters, which are their own masters, and a parameter shared by several modules (tied weights) has one master.
While converted, ``module.state_dict()`` returns the masters and ``module.load_state_dict()`` writes them.

At a step, :meth:`CopyMasters.prepare` copies the half gradients into fp32 master gradients and unscales them with
torch's fused AMP kernel; on torch >= 2.13 the module's parameters then carry those fp32 gradients and the half ones
are freed. It also flags half weights that user code edited in place since the last step (a WGAN clamp,
``nn.Embedding(max_norm=...)``), for :meth:`CopyMasters.absorb_edits`. :meth:`CopyMasters.enter` puts the masters into
the optimizer's ``param_groups`` (its state follows them) and :meth:`CopyMasters.exit` gives the parameters back and
refreshes the half weights in one foreach copy. The parameters' data never changes dtype during training: that would
reset their autograd gradient accumulators and detach DDP's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_mpt import _compat
from lightning_mpt.core.masters import DEFAULT_KEEP_FP32, HALF_DTYPES, Gradients, distributed
from lightning_mpt.core.masters._conversion import convert_module, exact_state, restore_module
from lightning_mpt.core.masters._copy_step import WholeStep, _by_device, _chunks, _write_halves
from lightning_mpt.core.masters._edits import WeightEdits
from lightning_mpt.core.masters._groups import GroupSwap

__all__ = ["CopyMasters"]


class CopyMasters:
    """FP32 master copies of a module's half-precision parameters.

    Args:
        dtype: the half-precision format, ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types whose parameters stay fp32.
        enabled: keep masters; ``False`` leaves the half weights as the only copy (steps update them directly).
        chunk: step torch's per-parameter optimizers about this many elements at a time
            (:class:`~lightning_mpt.core.masters.chunked.ChunkedStep`), ``"auto"`` for
            :func:`~lightning_mpt.core.masters.chunked.auto_chunk` of the model; ``None``: one whole step
            (:class:`~lightning_mpt.core.masters._copy_step.WholeStep`).

    Example:
        ```python
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        mw = CopyMasters(torch.float16)
        mw.convert(model)
        assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
        assert mw.master_of(model[0].weight).dtype == torch.float32
        mw.restore()
        assert model[0].weight.dtype == torch.float32
        ```
    """

    def __init__(
        self,
        dtype: torch.dtype,
        keep_fp32: tuple[type[nn.Module], ...] = DEFAULT_KEEP_FP32,
        enabled: bool = True,
        chunk: Union[int, Literal["auto"], None] = None,
    ) -> None:
        if dtype not in HALF_DTYPES:
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        self.keep_fp32 = tuple(keep_fp32)
        self.enabled = enabled
        self.masters: dict[Tensor, Tensor] = {}
        self.converted: dict[Tensor, None] = {}  # every parameter given a half tensor (an ordered set)
        self.groups = GroupSwap(self.masters, self.converted)
        self.edits = WeightEdits(self.masters, dtype)
        self.names: dict[Tensor, str] = {}
        self.on_edits: Optional[Callable[[list[str]], None]] = None
        self._handles: list[RemovableHandle] = []
        self.stepper: WholeStep
        self.chunked = chunk is not None  # the step is a ChunkedStep
        if chunk is None:
            self.stepper = WholeStep(self)
        else:
            from lightning_mpt.core.masters.chunked import ChunkedStep  # it extends WholeStep

            self.stepper = ChunkedStep(self, chunk)

    @property
    def separate(self) -> bool:
        """Whether the masters are tensors of their own (not the half weights, stepped directly)."""
        return self.enabled

    # ------------------------------------------------------------------ conversion
    def convert(self, module: nn.Module, restored: bool = False) -> nn.Module:
        """Cast ``module``'s parameters to half precision in place, keeping the fp32 tensors as masters.

        A parameter frozen now (``requires_grad=False``) gets no master: it costs only its half weight. If it is
        unfrozen later, its master is made at its first step, from its half value.

        Args:
            module: the model, its parameters fp32 (or already half).
            restored: the weights were just loaded from a checkpoint of a run under way: a frozen parameter whose
                value the half format cannot hold was trained before (unfrozen then) and keeps its exact master.
        """
        if self.converted:
            self.restore()
        self._handles = convert_module(self, module, restored)
        return module

    def restore(self) -> None:
        """Give the converted parameters fp32 tensors again: their masters, with any edit made to the half weights
        since the last step (for example by a weight-averaging callback at the end of fit) adopted first."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.absorb_all_edits()
        restore_module(self)
        self.converted.clear()
        self.masters.clear()
        self.groups.invalidate()
        self.edits.invalidate()
        self.stepper.reset()

    def add_master(self, param: Tensor, master: Tensor) -> None:
        self.masters[param] = master
        self.groups.invalidate()
        self.edits.invalidate()

    # ------------------------------------------------------------------ queries
    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 tensor that the optimizer steps for ``param`` (``param`` itself when it has no master)."""
        return self.masters.get(param, param)

    def storage(self) -> list[Tensor]:
        """The masters."""
        return list(self.masters.values())

    def saved_master(self, param: Tensor) -> Optional[Tensor]:
        """What a checkpoint saves for ``param``: its master (``None`` when it has none)."""
        return self.masters.get(param)

    def load_master(self, param: Tensor, value: Tensor) -> Optional[Tensor]:
        """Load ``value`` into the master of ``param`` exactly; returns the half value the module should load for
        ``param`` in place of ``value``'s own rounding (``None``: that rounding)."""
        self.masters[param].copy_(value)
        self.edits.forget()  # the half weight is loaded apart: round the masters at the next check
        return None

    def name_of(self, param: Tensor) -> str:
        return self.names.get(param, f"<unnamed {tuple(param.shape)}>")

    def named_masters(self) -> Iterator[tuple[str, Tensor, Tensor]]:
        """``(name, half parameter, master)`` for each converted parameter with a master."""
        for p, m in self.masters.items():
            yield self.names.get(p, ""), p, m

    # ------------------------------------------------------------------ set-up after the module moved / was wrapped
    def follow_devices(self) -> None:
        """Move masters next to their parameters (the module may have moved since :meth:`convert`)."""
        for p, m in list(self.masters.items()):
            if m.device != p.device:
                self.masters[p] = m.to(p.device)
                self.groups.invalidate()
                self.edits.invalidate()

    def broadcast(self, src: int = 0, refresh: bool = True) -> None:
        """Make every process hold the masters of rank ``src``; ``refresh``: the half weights follow (leave them when
        DDP made them equal already and a forward's graph may hold them)."""
        if not distributed() or not self.masters:
            return
        with torch.no_grad():
            for group in _by_device(list(self.masters.values())).values():
                flat = torch.cat([m.reshape(-1) for m in group])
                dist.broadcast(flat, src=src)
                _compat.foreach_copy_(
                    group, [t.view_as(m) for t, m in zip(flat.split([m.numel() for m in group]), group)]
                )
        if refresh:
            self.refresh()
        else:  # the half weights came from rank ``src`` as well: round the masters at the next check
            self.edits.forget()

    def refresh(self) -> None:
        """Write the masters into the half weights."""
        self.write_halves(list(self.masters), list(self.masters.values()))

    def adopt(self, optimizer: Optimizer) -> list[RemovableHandle]:
        """Keep ``optimizer``'s state fp32 and exact, and let ``load_state_dict`` see the masters (torch casts loaded
        state to the dtype of the parameters it finds in ``param_groups``); returns the hooks' handles."""
        exact_state(optimizer, self.masters, self.dtype)
        return [
            optimizer.register_load_state_dict_pre_hook(self._before_load),
            optimizer.register_load_state_dict_post_hook(lambda opt: self.swap_groups(opt, False)),
        ]

    def _before_load(self, optimizer: Optimizer, state_dict: Any) -> None:
        """Hand ``optimizer`` the masters for ``load_state_dict``, unless it reaches its hooks through ``__getattr__``
        (Lightning's ``LightningOptimizer``): torch's load then sets the state and groups on that wrapper alone, and
        its ``__setstate__`` gives it empty post-hooks, so the masters would never be taken back from the optimizer."""
        if "_optimizer_load_state_dict_post_hooks" in vars(optimizer):
            self.swap_groups(optimizer, True)

    def swap_groups(self, optimizer: Optimizer, to_masters: bool) -> None:
        """Put the masters (or back the parameters) into ``optimizer.param_groups``, in place, with their state."""
        self.groups.swap(optimizer, to_masters)

    def absorb_edits(self, grads: Gradients, flags: list[float]) -> list[str]:
        """Copy into the masters the half weights that ``flags`` (the host values of ``grads.edited``) mark as edited
        since the last step; return their names."""
        if grads.edit_flags is not None and any(flags):  # which ones: read only when one was (a second sync)
            flags = grads.edit_flags.tolist()
        edited = self.edits.adopt(list(zip(grads.params, grads.masters)), flags)
        return self.report_edits([p for p, _ in edited])

    def absorb_all_edits(self) -> list[str]:
        """Check every converted parameter for an edit of its half weight (one host sync), adopt what is found and
        report it (before a checkpoint is written, a weight average read, the module restored)."""
        pairs = [(p, m) for p, m in self.masters.items() if p.shape == m.shape]
        flags = self.edits.flags([p for p, _ in pairs]) if pairs else None
        edited = [] if flags is None else self.edits.adopt(pairs, flags.tolist())
        return self.report_edits([p for p, _ in edited])

    def report_edits(self, params: list[Tensor]) -> list[str]:
        """The names of ``params``, whose edits the masters adopted, handed to :attr:`on_edits` when there are any."""
        names = [self.name_of(p) for p in params]
        if names and self.on_edits is not None:
            self.on_edits(names)
        return names

    # ------------------------------------------------------------------ the half weights
    def write_halves(self, params: list[Tensor], masters: list[Tensor]) -> None:
        """Round ``masters`` into their half parameters ``params``."""
        _write_halves(params, masters)
        self.edits.settled(params)

    def write_back(self, params: list[Tensor], masters: list[Tensor]) -> None:
        """After a step: the stepped ``masters`` go back into storage, their half weights refreshed."""
        _write_halves(params, masters)
        self.edits.settled(params)

    def check_edits(self, out: Gradients) -> None:
        """Flag the half weights of ``out.params`` that user code edited since their masters were last written:
        ``out.edited`` one flag on the device, ``out.edit_flags`` one per parameter (``None``: none was)."""
        flags = self.edits.flags(out.params) if out.params else None
        if flags is not None:
            out.edit_flags = flags
            out.edited = flags.any().reshape(1)

    def wake(self, params: list[Tensor], check: bool = True) -> None:
        """Before a chunk's step: make the masters of ``params`` hold their values (fp32 copies always do)."""

    def step_chunks(
        self, params: list[Tensor], masters: list[Tensor], chunk: int
    ) -> list[tuple[list[Tensor], list[Tensor]]]:
        """The chunks that a chunked step hands the optimizer in turn, ``(parameters, masters)``: about ``chunk``
        elements each, in the optimizer's order."""
        return [(params[a:b], masters[a:b]) for a, b in _chunks(params, chunk)]

    # ------------------------------------------------------------------ the step (:attr:`stepper`)
    def in_chunks(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s next step is taken a chunk at a time."""
        return self.chunked and self.stepper.in_chunks(optimizer)

    def prepare(self, optimizer: Optimizer, scale: float, check_edits: bool = True) -> Gradients:
        return self.stepper.prepare(optimizer, scale, check_edits)

    def enter(self, optimizer: Optimizer, grads: Gradients) -> None:
        self.stepper.enter(optimizer, grads)

    def exit(self, optimizer: Optimizer, grads: Gradients, stepped: bool) -> None:
        self.stepper.exit(optimizer, grads, stepped)

    def steps(self, optimizer: Optimizer, grads: Gradients) -> Generator[None, None, None]:
        return self.stepper.steps(optimizer, grads)

    def discard(self, grads: Gradients, zero: bool = False) -> None:
        self.stepper.discard(grads, zero)

    def rescale(self, grads: Gradients, scale: float) -> None:
        self.stepper.rescale(grads, scale)

    def release(self, drop: bool) -> None:
        self.stepper.release(drop)

    def accumulate_in_fp32(self, sync: bool, zeros: bool = True) -> None:
        self.stepper.accumulate_in_fp32(sync, zeros)
