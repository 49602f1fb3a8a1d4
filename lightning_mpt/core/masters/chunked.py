"""A step that never holds every fp32 gradient at once: the masters are stepped a chunk of parameters at a time.

:class:`ChunkedMasters` keeps fp32 master copies like :class:`~lightning_mpt.core.masters.copies.CopyMasters`, but at
a step only the current chunk's gradients exist in fp32. :meth:`ChunkedMasters.prepare` decides the step from the
half gradients: one pass, a chunk at a time, copies them into fp32 scratch, unscales them (the non-finite flag),
takes each one's norm (for clipping by norm) and checks the half weights for edits, then frees the scratch. The engine
syncs once. :meth:`ChunkedMasters.steps` then steps the masters chunk by chunk: the chunk's gradients are made in fp32
again (bitwise the first pass's values), clipped with the global coefficient, handed to the optimizer with only that
chunk's masters in its ``param_groups``, and freed once the half weights are refreshed.

The chunks give the same masters as one whole step only for optimizers whose update of a parameter reads nothing but
that parameter, its gradient and its own state: torch's built-in ones (:data:`CHUNKABLE`) and torchao's low-bit Adam
family (:data:`TORCHAO_CHUNKABLE`). Any other optimizer (LBFGS, a user's optimizer, bitsandbytes', whose per-parameter
overrides are looked up by the parameter's index in its group) gets the whole step of :class:`CopyMasters`.

Between the backward and the step the module's parameters hold their half gradients as the backward left them:
scaled by the loss scale (fp16). Hooks that read ``p.grad`` there see those; clipping through the plugin uses the
true global norm.
"""

from __future__ import annotations

import warnings
from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch
from torch import Tensor, optim
from torch.optim import Optimizer

from lightning_mpt import _compat
from lightning_mpt.core.masters import DEFAULT_KEEP_FP32, Gradients, params_of
from lightning_mpt.core.masters._copy_step import DEFAULT_CHUNK, MIN_CHUNK, WholeStep, _chunks, _unscale_, auto_chunk
from lightning_mpt.core.masters.copies import CopyMasters

__all__ = [
    "CHUNKABLE",
    "DEFAULT_CHUNK",
    "MIN_CHUNK",
    "TORCHAO_CHUNKABLE",
    "ChunkedGrads",
    "ChunkedMasters",
    "ChunkedStep",
    "auto_chunk",
    "chunkable",
]

#: torch's optimizers whose update of a parameter reads only that parameter, its gradient and its state, so stepping
#: the parameters in chunks gives the masters of one whole step, bitwise (exact classes: a subclass may differ)
CHUNKABLE: tuple[type[Optimizer], ...] = (
    optim.SGD,
    optim.Adam,
    optim.AdamW,
    optim.Adamax,
    optim.NAdam,
    optim.RAdam,
    optim.Adagrad,
    optim.Adadelta,
    optim.RMSprop,
    optim.Rprop,
    optim.ASGD,
    *((optim.Adafactor,) if hasattr(optim, "Adafactor") else ()),  # torch >= 2.5
)


#: torchao's low-bit Adam family (``torchao.optim``): each parameter is stepped alone, from its own state and its
#: group's hyper-parameters (exact classes, by name: torchao is optional and imported only by its users)
TORCHAO_CHUNKABLE = frozenset(("Adam8bit", "Adam4bit", "AdamFp8", "AdamW8bit", "AdamW4bit", "AdamWFp8", "_AdamW"))


def chunkable(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` can step its parameters a chunk at a time with the result of one whole step.

    Example:
        ```python
        w = torch.nn.Parameter(torch.zeros(2))
        assert chunkable(torch.optim.AdamW([w])) and not chunkable(torch.optim.LBFGS([w]))
        ```
    """
    cls = type(optimizer)
    return cls in CHUNKABLE or (cls.__module__ == "torchao.optim.adam" and cls.__name__ in TORCHAO_CHUNKABLE)


_WHOLE_STEP = (
    "MPTPrecision(chunked_step=...): {name} is stepped whole, not in chunks. Only torch's per-parameter optimizers "
    "and torchao's low-bit Adams are known to give the result of one whole step a chunk at a time (another may read "
    "several parameters at once, as LBFGS does, or a subclass may). Its step holds every fp32 gradient, as without "
    "chunked_step; docs/memory.md lists the optimizers."
)


def stepped_in_chunks(optimizer: Optimizer, warned: set[int], warn: bool = True) -> bool:
    """Whether ``optimizer`` is :func:`chunkable`; the first time one is not (its id not in ``warned``), a warning says
    that its step is whole (if ``warn``: the chunks were asked for, not the format's default)."""
    if chunkable(optimizer):
        return True
    if warn and id(optimizer) not in warned:
        warned.add(id(optimizer))
        warnings.warn(_WHOLE_STEP.format(name=type(optimizer).__name__), stacklevel=2)
    return False


@dataclass
class ChunkedGrads(Gradients):
    """A chunked step's gradients: the half ones stay on the parameters until the step; the decision's by-products."""

    scale: float = 1.0  # the loss scale the half gradients carry
    coefficient: Optional[Tensor] = None  # clipping by norm: the factor every gradient is multiplied by
    clip_value: Optional[float] = None  # clipping by value
    chunk: int = DEFAULT_CHUNK

    @property
    def left_scale(self) -> float:
        """The half gradients left on the parameters still carry the loss scale."""
        return self.scale

    def fp32_grads(self) -> list[Tensor]:
        """The gradients as they are now, aligned with :meth:`all_params`: the half ones (scaled; a non-finite value
        is non-finite at any scale) and the fp32 parameters' own (unscaled)."""
        return [p.grad for p in self.all_params() if p.grad is not None]

    def clip_by_norm(self, max_norm: float) -> Tensor:
        """Clip by the global 2-norm, as ``torch.nn.utils.clip_grad_norm_`` over the masters of a whole step would:
        each gradient's norm (:meth:`half_norms`), stacked in the optimizer's parameter order. The fp32 parameters'
        gradients are clipped now, the others chunk by chunk at the step. Returns the total norm.

        Raises:
            ValueError: after a clip by value in the same step: its norm would be that of the clamped gradients, which
                a chunked step never holds at once.
        """
        if self.clip_value is not None:
            raise ValueError(
                "Clipping by norm after clipping by value in one step needs the norm of the clamped gradients, and "
                "MPTPrecision(chunked_step=...) never holds them all at once. Clip by norm first, then by value (the "
                "chunks apply them in that order), or turn chunked_step off."
            )
        with_grad = [p for p in self.own_params if p.grad is not None]
        own: list[Tensor] = [p.grad for p in with_grad]  # type: ignore[misc]
        norm_of = dict(zip(map(id, self.params), self.half_norms()))
        if own:
            norm_of.update(zip(map(id, with_grad), _compat.foreach_norm(own, 2.0)))
        ordered = [norm_of[id(p)] for p in params_of(self.optimizer) if id(p) in norm_of]  # type: ignore[arg-type]
        if not ordered:
            return torch.tensor(0.0)
        total: Tensor = torch.linalg.vector_norm(torch.stack([n.to(ordered[0].device) for n in ordered]), 2.0)
        coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        self.coefficient = coefficient if self.coefficient is None else self.coefficient * coefficient
        if own:
            _compat.foreach_mul_(own, coefficient.to(own[0].device))
        return total

    def half_norms(self) -> list[Tensor]:
        """The 2-norm of each unscaled gradient of ``params``, computed a chunk at a time from the half gradients on
        the parameters now (the values a whole step's fp32 gradients have: the same copy and unscale)."""
        norms: list[Tensor] = []
        for start, stop in _chunks(self.params, self.chunk):
            kept = [(p, m) for p, m in zip(self.params[start:stop], self.masters[start:stop]) if p.grad is not None]
            fp32 = _fp32_copies([p for p, _ in kept], [m for _, m in kept])
            if fp32 and self.scale != 1.0:  # x * 1 is x
                _unscale_(fp32, 1.0 / self.scale)
            norm_of = dict(zip(map(id, (p for p, _ in kept)), _compat.foreach_norm(fp32, 2.0) if fp32 else []))
            zero = torch.zeros((), device=self.params[start].device)
            norms.extend(norm_of.get(id(p), zero) for p in self.params[start:stop])
        return norms

    def clip_by_value(self, value: float) -> None:
        """Clamp every gradient to ``[-value, value]``: the fp32 parameters' now, the others chunk by chunk."""
        own = [p.grad for p in self.own_params if p.grad is not None]
        for g in own:
            g.clamp_(-value, value)
        self.clip_value = value if self.clip_value is None else min(self.clip_value, value)


class ChunkedStep(WholeStep):
    """The step of fp32 masters taken a chunk of parameters at a time, so that it holds one chunk of fp32 gradients;
    an optimizer that is not :func:`chunkable` gets the :class:`~lightning_mpt.core.masters._copy_step.WholeStep`.

    Args:
        owner: the masters this step belongs to (besides what a whole step needs: ``wake`` and ``step_chunks``).
        chunk: about how many elements each chunk holds (a larger tensor is a chunk of its own); ``"auto"``:
            :func:`auto_chunk` of the model.

    Example:
        ```python
        masters = CopyMasters(torch.bfloat16, chunk=16)  # builds its ChunkedStep
        assert masters.stepper.chunk == 16 and masters.in_chunks(torch.optim.SGD([torch.zeros(1)]))
        ```
    """

    def __init__(self, owner: CopyMasters, chunk: Union[int, Literal["auto"]] = "auto") -> None:
        if chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be 'auto' or a positive number of elements, got {chunk!r}")
        super().__init__(owner)
        self.warn_whole = True  # say when an optimizer cannot be stepped in chunks (off where chunks are a default)
        self.asked_chunk = chunk
        # per optimizer, its latest chunked step while no backward has come since: a step taken again clips alike
        self._last: dict[Optimizer, ChunkedGrads] = {}
        self._whole: set[int] = set()  # ids of the optimizers told that they are stepped whole
        # optimizers whose next step is whole: its fp32 gradients all on the masters (fabric.clip_gradients clips them)
        self.whole_next: set[Optimizer] = set()

    @property
    def chunk(self) -> int:
        """Elements per chunk: as asked, or :func:`auto_chunk` of the masters (sized again when masters are added)."""
        return self.auto_chunk() if self.asked_chunk == "auto" else self.asked_chunk

    def prepare(self, optimizer: Optimizer, scale: float, check_edits: bool = True) -> Gradients:
        """Decide from the half gradients as they are: the non-finite flag (a fused check over all of them, their
        values unchanged) and the edit flags stay on the device; no fp32 gradient is made (clipping by norm makes each
        chunk's in turn, :meth:`ChunkedGrads.clip_by_norm`). An optimizer that is not :func:`chunkable` gets the whole
        step's fp32 gradients."""
        if not self.in_chunks(optimizer):
            return super().prepare(optimizer, scale, check_edits)
        out = ChunkedGrads(optimizer=optimizer, scale=scale, chunk=self.chunk)
        last = self._last.pop(optimizer, None)
        if last is not None:  # stepped again with no backward: the same gradients, clipped as they were
            out.coefficient, out.clip_value = last.coefficient, last.clip_value
        plan, halves = self.collect(optimizer, out)
        found = _unscale_(halves, 1.0, plan.device)  # x * 1 is x: only the flag
        own = [p.grad for p in out.own_params]  # unscaled in place (already, for a step taken again)
        found_own = _unscale_(own, 1.0 if last is not None else 1.0 / scale, plan.device)  # type: ignore[arg-type]
        flags = [f for f in (found, found_own) if f is not None]
        out.found_inf = flags[0] if len(flags) == 1 else (torch.stack(flags).sum() if flags else None)
        if check_edits:
            self.owner.check_edits(out)
        return out

    def steps(self, optimizer: Optimizer, grads: Gradients) -> Generator[None, None, None]:
        """Hand ``optimizer`` the masters a chunk at a time, each with its fp32 gradients, clipped as decided; the
        caller steps once per chunk. The fp32 parameters go with the first chunk."""
        if not isinstance(grads, ChunkedGrads):
            yield from super().steps(optimizer, grads)
            return
        owner = self.owner
        chunks = owner.step_chunks(grads.params, grads.masters, grads.chunk) or [([], [])]
        # the masters in the groups, and the state keyed by them, as for a whole step (a parameter used as a key
        # stands for its master); each chunk then narrows the groups to its own masters
        self.groups.swap(optimizer, True)
        groups = [(g["params"], list(g["params"])) for g in optimizer.param_groups]
        own = {id(p) for p in grads.own_params}
        try:
            for n, (params, masters) in enumerate(chunks):
                owner.wake(params)
                fp32 = _chunk_gradients(grads, params, masters)
                stepped = {id(m) for m in masters} | own if n == 0 else {id(m) for m in masters}
                for slots, full in groups:  # in place: the group's list object stays the optimizer's
                    slots[:] = [m for m in full if id(m) in stepped]
                grads.entered = True
                try:
                    yield
                finally:
                    for slots, full in groups:
                        slots[:] = full
                    for m in masters:
                        m.grad = None
                    grads.entered = False
                    owner.write_back(params, masters)
                    del fp32
            self._last[optimizer] = grads
        finally:
            for slots, full in groups:
                slots[:] = full
            self.groups.swap(optimizer, False)

    def in_chunks(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` is stepped a chunk at a time (it is :func:`chunkable`; if not, a warning says so
        once)."""
        return optimizer not in self.whole_next and stepped_in_chunks(optimizer, self._whole, self.warn_whole)

    def exit(self, optimizer: Optimizer, grads: Gradients, stepped: bool) -> None:
        self.whole_next.discard(optimizer)
        if isinstance(grads, ChunkedGrads):  # the chunks have already given everything back
            return
        super().exit(optimizer, grads, stepped)

    def discard(self, grads: Gradients, zero: bool = False) -> None:
        self.whole_next.discard(grads.optimizer)
        self._last.pop(grads.optimizer, None)  # type: ignore[arg-type]
        super().discard(grads, zero)  # a chunked step's masters hold no gradient: the same drop as a whole step's

    def reset(self) -> None:
        self._last.clear()
        super().reset()

    def release(self, drop: bool) -> None:
        self._last.clear()
        super().release(drop)

    def rescale(self, grads: Gradients, scale: float) -> None:
        """Before a backward into what a chunked step left, or into gradients clipped for a step not taken yet: the
        half gradients still carry the scale they were made with and go to ``scale`` (a power of two: exact unless a
        value leaves the format), clipped first as decided (rounded to the half format: the backward adds to the
        clipped gradients, as under "32-true"); the fp32 parameters' gradients were unscaled (and clipped) and are
        multiplied by ``scale``."""
        if not isinstance(grads, ChunkedGrads):
            super().rescale(grads, scale)
            return
        half = [p.grad for p in grads.params if p.grad is not None]
        if half:
            _clip(half, grads, grads.scale)
        grads.coefficient = grads.clip_value = None  # applied: the next decision starts from these gradients
        if half and scale != grads.scale:
            _compat.foreach_mul_(half, scale / grads.scale)
        own = [p.grad for p in grads.own_params if p.grad is not None]
        if own and scale != 1.0:
            _compat.foreach_mul_(own, scale)


class ChunkedMasters(CopyMasters):
    """FP32 master copies stepped a chunk of parameters at a time (:class:`ChunkedStep`), so that the step holds one
    chunk of fp32 gradients: :class:`~lightning_mpt.core.masters.copies.CopyMasters` with a ``chunk``.

    Args:
        dtype: the half-precision format, ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: module types whose parameters stay fp32.
        chunk: about how many elements each chunk holds (a larger tensor is a chunk of its own); ``"auto"``:
            :func:`auto_chunk` of the model.

    Example:
        ```python
        from torch import nn
        from lightning_mpt.core.engine import MixedPrecisionEngine

        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        engine = MixedPrecisionEngine(ChunkedMasters(torch.bfloat16, chunk=16))
        engine.convert(model)
        optimizer = torch.optim.AdamW(model.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.scale_loss(model(torch.randn(3, 4)).float().sum()).backward()
        engine.step(optimizer, engine.decide(optimizer))   # three chunks, one sync
        engine.restore()
        ```
    """

    def __init__(
        self,
        dtype: torch.dtype,
        keep_fp32: tuple[type[torch.nn.Module], ...] = DEFAULT_KEEP_FP32,
        chunk: Union[int, Literal["auto"]] = "auto",
    ) -> None:
        super().__init__(dtype, keep_fp32, enabled=True, chunk=chunk)


def _chunk_gradients(grads: ChunkedGrads, params: list[Tensor], masters: list[Tensor]) -> list[Tensor]:
    """A chunk's fp32 gradients on its masters: made from the half gradients now on the parameters (a hook may have
    edited or dropped one), unscaled by the same kernel as at the decision, then clipped."""
    kept = [(p, m) for p, m in zip(params, masters) if p.grad is not None]
    fp32 = _fp32_copies([p for p, _ in kept], [m for _, m in kept])
    if fp32:
        if grads.scale != 1.0:  # without a loss scale (bf16) the copies are the true values already
            _unscale_(fp32, 1.0 / grads.scale)
        _clip(fp32, grads, 1.0)
    for (_, m), g in zip(kept, fp32):
        m.grad = g
    return fp32


def _clip(tensors: list[Tensor], grads: ChunkedGrads, scale: float) -> None:
    """Apply ``grads``' clipping as decided to ``tensors`` (gradients carrying ``scale``), in place: the norm's
    coefficient, then the value's bound."""
    if grads.coefficient is not None:
        _compat.foreach_mul_(tensors, grads.coefficient.to(tensors[0].device))
    if grads.clip_value is not None:
        for g in tensors:
            g.clamp_(-grads.clip_value * scale, grads.clip_value * scale)


def _fp32_copies(params: list[Tensor], masters: list[Tensor]) -> list[Tensor]:
    """New fp32 tensors holding the gradients of ``params`` (never the gradient itself, even when it is fp32)."""
    fp32 = [torch.empty_like(m) for m in masters]
    if fp32:
        _compat.foreach_copy_(fp32, [p.grad for p in params])  # type: ignore[misc]
    return fp32
