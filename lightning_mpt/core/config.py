"""Argument checks shared by the Trainer and Fabric plugins: every error says what was wrong and what is accepted."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, Optional, Union

import torch
from torch.nn import Module

from lightning_mpt import _compat
from lightning_mpt.core.fp8 import Float8Setup, check_fp8
from lightning_mpt.core.masters import DEFAULT_KEEP_FP32
from lightning_mpt.core.scaler import DynamicLossScaler

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LIGHTNING_NAMES = {"fp16": "16-mixed", "bf16": "bf16-mixed"}  # Lightning's names of the same formats


def check_arguments(
    precision: Any,
    scaler: Any,
    master_weights: Any,
    keep_fp32: Any,
    max_consecutive_skips: Any,
    accumulate_fp32: Any = False,
) -> tuple[torch.dtype, Optional[DynamicLossScaler], tuple[type[Module], ...]]:
    """Validate the plugins' arguments; return the half dtype, the scaler (``None``: no scaling) and ``keep_fp32``."""
    if precision not in DTYPES:
        raise ValueError(f"MPTPrecision(precision={precision!r}): precision must be one of 'fp16', 'bf16'.")
    if scaler is None:
        scaler = DynamicLossScaler() if precision == "fp16" else None
    elif isinstance(scaler, (int, float)) and not isinstance(scaler, bool):
        if not (math.isfinite(scaler) and scaler > 0):
            raise ValueError(f"MPTPrecision(scaler={scaler!r}): a static scale must be a finite number > 0.")
        scaler = DynamicLossScaler.static(float(scaler))
    elif not isinstance(scaler, DynamicLossScaler):
        raise TypeError(
            f"MPTPrecision(scaler={scaler!r}): expected None, a DynamicLossScaler or a number (a static scale)."
        )
    if precision == "bf16" and scaler is not None and scaler.measuring:
        raise ValueError(
            "MPTPrecision('bf16', scaler=DynamicLossScaler(init_scale='auto')): the automatic scale is measured "
            "against fp16's range; bf16 has fp32's range and needs no loss scale. Use MPTPrecision('bf16') "
            "(no scaler), or a number for init_scale."
        )
    if not isinstance(master_weights, bool):
        raise TypeError(f"MPTPrecision(master_weights={master_weights!r}): expected a bool (True or False).")
    if isinstance(keep_fp32, type):
        keep_fp32 = (keep_fp32,)
    if not isinstance(keep_fp32, (tuple, list)) or not all(
        isinstance(k, type) and issubclass(k, Module) for k in keep_fp32
    ):
        raise TypeError(
            f"MPTPrecision(keep_fp32={keep_fp32!r}): expected a torch.nn.Module subclass or a tuple of them, "
            "e.g. keep_fp32=(torch.nn.LayerNorm, torch.nn.BatchNorm2d)."
        )
    # types of the user's own (an RMSNorm, a Linear) are kept in addition to the default norm layers: a norm layer
    # turned half because another type was named is never what was meant. A tuple that names a default type itself
    # is the whole list, as given (keep_fp32=(nn.LayerNorm,): LayerNorm only; keep_fp32=(): nothing)
    if not any(k in DEFAULT_KEEP_FP32 for k in keep_fp32):
        keep_fp32 = tuple(dict.fromkeys((*DEFAULT_KEEP_FP32, *keep_fp32))) if keep_fp32 else ()
    if not (
        isinstance(max_consecutive_skips, int)
        and not isinstance(max_consecutive_skips, bool)
        and max_consecutive_skips >= 1
    ):
        raise ValueError(f"MPTPrecision(max_consecutive_skips={max_consecutive_skips!r}): expected an int >= 1.")
    if not isinstance(accumulate_fp32, bool):
        raise TypeError(f"MPTPrecision(accumulate_fp32={accumulate_fp32!r}): expected a bool (True or False).")
    if accumulate_fp32 and not (master_weights and _compat.GRAD_DTYPE):
        raise ValueError(
            "MPTPrecision(accumulate_fp32=True) needs master_weights=True and torch >= 2.13 (a half-precision "
            "parameter "
            f"holding an fp32 gradient, Tensor.grad_dtype); this is torch {torch.__version__}."
        )
    return DTYPES[precision], scaler, tuple(keep_fp32)


@dataclass(frozen=True)
class MasterOptions:
    """How the fp32 masters are kept and stepped: the plugins' memory options in one object.

    ``None`` means the format's default (:meth:`resolved`): bf16 keeps its masters as 16-bit remainders and steps
    them a chunk at a time (14 bytes per parameter with AdamW); fp16 keeps 4-byte masters and takes the whole step
    (18 bytes), so that gradient hooks and clipping see its gradients unscaled in fp32 (docs/memory.md). With
    ``accumulate_fp32`` (fp32 gradients from the backward on) both take the whole step with 4-byte masters.

    Args:
        enabled: keep fp32 masters (``master_weights``); ``False`` steps the half weights themselves.
        remainders: store each bf16 master as its 16 low bits beside the weight between steps (``master_remainders``).
        chunk: step the masters a chunk at a time (``chunked_step``): ``True`` for chunks of about a sixteenth of
            the model (between ``2**18`` and ``2**24`` elements), a number of elements, or ``False`` for the whole
            step.
        accumulate_fp32: sum the micro-batches' gradients in fp32 (``accumulate_fp32``).

    Example:
        ```python
        options = MasterOptions().resolved(torch.bfloat16)
        assert options.remainders and options.chunk_size == "auto"  # a sixteenth of the model
        assert MasterOptions().resolved(torch.float16).chunk_size is None  # fp16: the whole step
        ```
    """

    enabled: bool = True
    remainders: Optional[bool] = None
    chunk: Union[bool, int, None] = None
    accumulate_fp32: bool = False

    def resolved(self, dtype: torch.dtype, sharded: bool = False) -> MasterOptions:
        """These options with each default filled in for ``dtype`` (under FSDP2 if ``sharded``: its shards are the
        masters, neither chunked nor stored in 16 bits), checked: a clear error for what cannot be."""
        if not isinstance(self.enabled, bool):
            raise TypeError(f"MPTPrecision(master_weights={self.enabled!r}): expected a bool (True or False).")
        # fp32 accumulation holds fp32 gradients from the backward on: chunks would save nothing at the step
        best = self.enabled and dtype == torch.bfloat16 and not sharded and not self.accumulate_fp32
        chunk = best if self.chunk is None else self.chunk
        # a whole step wakes every remainder's master at once: 2 bytes more than 4-byte masters at its peak
        remainders = best and chunk is not False if self.remainders is None else self.remainders
        check_master_remainders(remainders, dtype, self.enabled)
        check_chunked_step(chunk, self.enabled)
        return replace(self, remainders=remainders, chunk=chunk)

    @property
    def chunk_size(self) -> Union[int, Literal["auto"], None]:
        """Elements per chunk (``"auto"``: a sixteenth of the model, between 2**18 and 2**24), ``None`` for the whole
        step (of resolved options)."""
        return check_chunked_step(self.chunk, self.enabled)


@dataclass(frozen=True)
class SkipPolicy:
    """What the plugins do about a step with non-finite gradients: their skip options in one object.

    Args:
        max_consecutive: raise :class:`~lightning_mpt.NonFiniteGradientError` after this many skipped steps in a row
            of one optimizer (``max_consecutive_skips``).
        retries: run a batch whose gradients overflowed again at the backed-off scale, up to this many times, instead
            of skipping its step (``overflow_retries``): the Trainer's automatic optimization only.
        advance_schedulers: a skipped step counts for the LR schedulers, as in Lightning; ``False``: it does not, as
            in Megatron-LM and DeepSpeed (``skipped_steps_advance_schedulers``).

    Example:
        ```python
        from lightning_mpt import MPTPrecision, SkipPolicy

        plugin = MPTPrecision("fp16", skips=SkipPolicy(retries=2, advance_schedulers=False))
        assert plugin.skips == SkipPolicy(max_consecutive=50, retries=2, advance_schedulers=False)
        ```
    """

    max_consecutive: int = 50
    retries: int = 0
    advance_schedulers: bool = True


@dataclass(frozen=True)
class Fp8Options:
    """fp8 compute for the eligible ``Linear`` layers (torchao's float8 training): the plugins' fp8 options in one
    object, given as ``fp8=Fp8Options(...)``.

    Args:
        recipe: ``True`` (torchao's default, tensorwise scaling), a recipe name (``"tensorwise"``, ``"rowwise"``,
            ``"rowwise_with_gw_hp"``) or a ``torchao.float8.Float8LinearConfig`` (what ``fp8`` takes alone).
        filter: ``fn(module, fqn) -> bool``: convert only the eligible layers it accepts (``fp8_filter``).
        emulate: emulate the fp8 matmuls (CPU, GPUs without fp8 Tensor Cores): slow, for tests and debugging
            (``fp8_emulate``).

    Example:
        ```python
        from lightning_mpt import Fp8Options, MPTPrecision

        plugin = MPTPrecision("bf16", fp8=Fp8Options("rowwise", filter=lambda module, fqn: fqn != "head", emulate=True))
        assert plugin.fp8_config.emulate
        ```
    """

    recipe: Any = True
    filter: Optional[Callable[[Module, str], bool]] = None
    emulate: bool = False


def check_chunked_step(chunked_step: Any, master_weights: bool) -> Union[int, Literal["auto"], None]:
    """Validate ``MPTPrecision(chunked_step=...)``; return the chunk's size in elements, ``"auto"`` (a sixteenth of
    the model, between 2**18 and 2**24 elements) for ``True``, ``None`` for a whole step."""
    chunk: Union[int, Literal["auto"]]
    if chunked_step is False:
        return None
    if chunked_step is True:
        chunk = "auto"
    elif isinstance(chunked_step, int) and chunked_step >= 1:
        chunk = chunked_step
    else:
        raise ValueError(
            f"MPTPrecision(chunked_step={chunked_step!r}): expected True, False or a number of elements per chunk >= 1."
        )
    if not master_weights:
        raise ValueError("MPTPrecision(chunked_step=...) steps fp32 masters in chunks: it needs master_weights=True.")
    return chunk


def check_master_remainders(master_remainders: Any, dtype: torch.dtype, master_weights: bool) -> bool:
    """Validate ``MPTPrecision(master_remainders=...)``: a bool; the remainders need bf16 weights and masters."""
    if not isinstance(master_remainders, bool):
        raise TypeError(f"MPTPrecision(master_remainders={master_remainders!r}): expected a bool (True or False).")
    if master_remainders and dtype != torch.bfloat16:
        raise ValueError(
            "MPTPrecision(master_remainders=True) needs precision='bf16': an fp32 master is its bf16 weight plus 16 "
            "low bits, but fp16's bits are not a prefix of fp32's. fp16 keeps 4-byte masters."
        )
    if master_remainders and not master_weights:
        raise ValueError("MPTPrecision(master_remainders=True) stores fp32 masters: it needs master_weights=True.")
    return master_remainders


def check_overflow_retries(overflow_retries: Any, scaler: Optional[DynamicLossScaler]) -> int:
    """Validate ``MPTPrecision(overflow_retries=...)``: an int >= 0; retries need a dynamic scale to back off."""
    if isinstance(overflow_retries, bool) or not isinstance(overflow_retries, int) or overflow_retries < 0:
        raise ValueError(f"MPTPrecision(overflow_retries={overflow_retries!r}): expected an int >= 0 (0: no retry).")
    if overflow_retries and (scaler is None or scaler.is_static):
        raise ValueError(
            f"MPTPrecision(overflow_retries={overflow_retries}) runs an overflowing batch again at a lower scale: it "
            "needs a dynamic loss scale (fp16 with scaler=None or a DynamicLossScaler), not a static or no scale."
        )
    return overflow_retries


@dataclass(frozen=True)
class PluginArguments:
    """The plugins' arguments, checked and grouped (:func:`read_arguments`).

    Args:
        dtype: the half format.
        scaler: the loss scaler (``None``: no scaling).
        keep_fp32: the module types whose parameters stay fp32.
        masters: the masters' options as given (``None``: the format's default, which FSDP2 resolves its own way).
        skips: what a skipped step does, ``retries`` checked against the scaler.
        fp8: the fp8 conversion (``None``: off).
        masters_object: the ``MasterOptions`` given as ``masters=``, if it was (later errors name its fields).

    Example:
        ```python
        args = read_arguments("bf16", skips=SkipPolicy(max_consecutive=10))
        assert args.dtype == torch.bfloat16 and args.scaler is None and args.skips.max_consecutive == 10
        ```
    """

    dtype: torch.dtype
    scaler: Optional[DynamicLossScaler]
    keep_fp32: tuple[type[Module], ...]
    masters: MasterOptions
    skips: SkipPolicy
    fp8: Optional[Float8Setup]
    masters_object: Optional[MasterOptions] = None  # given as masters=MasterOptions(...): errors name its fields


def read_arguments(
    precision: Any,
    scaler: Any = None,
    master_weights: Any = True,
    keep_fp32: Any = DEFAULT_KEEP_FP32,
    max_consecutive_skips: Any = 50,
    accumulate_fp32: Any = False,
    skipped_steps_advance_schedulers: Any = True,
    fp8: Any = None,
    fp8_filter: Any = None,
    fp8_emulate: Any = False,
    chunked_step: Any = None,
    master_remainders: Any = None,
    masters: Any = None,
    overflow_retries: Any = 0,
    skips: Any = None,
) -> PluginArguments:
    """Check the plugins' arguments (a clear error for each, saying what is accepted) and group them: the grouped
    options (``masters=MasterOptions(...)``, ``skips=SkipPolicy(...)``, ``fp8=Fp8Options(...)``) or the single
    arguments that stand for their fields, never both."""
    if masters is not None:
        master_weights, master_remainders, chunked_step, accumulate_fp32 = _grouped(
            "masters",
            masters,
            MasterOptions,
            "MasterOptions(remainders=False, chunk=2**22)",
            (master_weights, master_remainders, chunked_step, accumulate_fp32),
            (True, None, None, False),
        )
    if skips is not None:
        max_consecutive_skips, overflow_retries, skipped_steps_advance_schedulers = _grouped(
            "skips",
            skips,
            SkipPolicy,
            "SkipPolicy(max_consecutive=100, advance_schedulers=False)",
            (max_consecutive_skips, overflow_retries, skipped_steps_advance_schedulers),
            (50, 0, True),
        )
    fp8_given = fp8 if isinstance(fp8, Fp8Options) else None
    if fp8_given is not None:
        fp8, fp8_filter, fp8_emulate = _grouped(
            "fp8",
            fp8,
            Fp8Options,
            "Fp8Options('rowwise', emulate=True)",
            (None, fp8_filter, fp8_emulate),
            (None, None, False),
        )
    with named_as_given("masters", masters), named_as_given("skips", skips), named_as_given("fp8", fp8_given):
        if not isinstance(skipped_steps_advance_schedulers, bool):
            raise TypeError(
                f"MPTPrecision(skipped_steps_advance_schedulers={skipped_steps_advance_schedulers!r}): expected a bool "
                "(True: a skipped step counts for the LR schedulers, as in Lightning; False: it does not, as in "
                "Megatron-LM and DeepSpeed)."
            )
        dtype, checked_scaler, kept = check_arguments(
            precision, scaler, master_weights, keep_fp32, max_consecutive_skips, accumulate_fp32
        )
        retries = check_overflow_retries(overflow_retries, checked_scaler)
        fp8_setup = check_fp8(fp8, fp8_filter, precision, fp8_emulate)
    return PluginArguments(
        dtype,
        checked_scaler,
        kept,
        MasterOptions(master_weights, master_remainders, chunked_step, accumulate_fp32),
        SkipPolicy(max_consecutive_skips, retries, skipped_steps_advance_schedulers),
        fp8_setup,
        masters,
    )


#: the single arguments that stand for the fields of each grouped option, in the fields' order
SINGLES = {
    "masters": ("master_weights", "master_remainders", "chunked_step", "accumulate_fp32"),
    "skips": ("max_consecutive_skips", "overflow_retries", "skipped_steps_advance_schedulers"),
    "fp8": ("fp8", "fp8_filter", "fp8_emulate"),
}


@contextmanager
def named_as_given(argument: str, options: Any) -> Iterator[None]:
    """Make an error raised inside name the fields of ``options``, given as ``MPTPrecision(<argument>=options)``,
    where it names the single arguments that stand for them: ``masters.chunk=0`` for ``chunked_step=0``. With
    ``options`` ``None`` (the single arguments were given) errors pass unchanged.

    Args:
        argument: ``"masters"``, ``"skips"`` or ``"fp8"``.
        options: the grouped object given, or ``None``.

    Example:
        ```python
        import pytest

        with pytest.raises(ValueError, match="masters.chunk=0"):
            with named_as_given("masters", MasterOptions(chunk=0)):
                check_chunked_step(0, True)
        ```
    """
    try:
        yield
    except (TypeError, ValueError) as error:
        if options is None:
            raise
        named = {single: f"{argument}.{f.name}" for single, f in zip(SINGLES[argument], fields(type(options)))}
        # a name with "_" is an identifier wherever it stands; "fp8" is also a word of the sentence, an argument only
        # before "="; one pass, so that a field named as its argument is not named twice
        pattern = "|".join(rf"{s}\b" if "_" in s else rf"{s}(?==)" for s in named)
        message = re.sub(rf"(?<![.\w])(?:{pattern})", lambda m: named[m.group(0)], str(error))
        if message == str(error):
            raise
        raise type(error)(message) from None


def _grouped(
    argument: str, options: Any, cls: type, example: str, singles: tuple[Any, ...], defaults: tuple[Any, ...]
) -> Any:
    """The fields of ``MPTPrecision(<argument>=cls(...))``, in their order; the single arguments that stand for them
    (their values ``singles``, named in :data:`SINGLES`; ``None`` for the one the object itself is given as) must be
    left at their ``defaults``."""
    if not isinstance(options, cls):
        raise TypeError(
            f"MPTPrecision({argument}={options!r}): expected a lightning_mpt.{cls.__name__}, e.g. {example}."
        )
    # a default given explicitly (max_consecutive_skips=50) is no conflict; True for 1 or 0 for False would be
    given = [
        name
        for name, value, unset in zip(SINGLES[argument], singles, defaults)
        if name != argument and not (type(value) is type(unset) and value == unset)
    ]
    if given:
        names = ", ".join(f.name for f in fields(cls))
        raise ValueError(
            f"MPTPrecision({argument}={cls.__name__}(...), {', '.join(f'{n}=...' for n in given)}): give these options "
            f"once, in {cls.__name__} ({names}) or as single arguments."
        )
    return tuple(getattr(options, f.name) for f in fields(cls))
