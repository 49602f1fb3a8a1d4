"""MPTPrecision's step time against Lightning's built-in precisions, over interleaved rounds, in one run.

    python benchmarks/step_time.py                                  # CPU: transformer (small) and deep_mlp
    python benchmarks/step_time.py --rounds 5 --steps 12            # a quicker look (noisier)
    python benchmarks/step_time.py --profile                        # also: top ops and step phases per precision
    python benchmarks/step_time.py --accelerator gpu --size gpt2    # GPT-2 small on a CUDA GPU, every precision
    python benchmarks/step_time.py --size tiny --precisions all     # dry run of the GPU path's logic on a CPU

What it does, all in one process:

1. **Rounds.** Every precision trains a fresh model for ``--steps`` optimizer steps, ``--rounds`` times (at least
   5 by default), interleaved: round r runs every precision once, the order rotated by one each round. The step
   time of a run is the median of its steps after ``--warmup`` (CPU), or the mean over the timed window between two
   device syncs (CUDA). Each ratio ``mpt-X / baseline`` is taken per round (both runs of a round saw the same
   machine) and reported as the median over rounds and the spread (min-max).
2. **Bandwidth floor.** A copy benchmark measures the machine's memory bandwidth (``copy_`` between two 256 MiB
   buffers, or buffers the size of the model's fp32 master gradients if larger: beyond the caches, as the plugin's
   data is after a backward pass has streamed the activations through them; the bandwidth at the master gradients'
   size is printed too), and the byte model below counts the bytes that the plugin's own work moves per step. The
   plugin's overhead over the matching "true" precision (``mpt-bf16 - bf16-true``, per round) is printed next to
   that floor, and next to the time of the same passes as bare torch ops on tensors of the model's shapes.
   On the transformer, ``mpt-bf16-nomaster`` (``MPTPrecision("bf16", master_weights=False)``: same autocast, fp32
   norms and step logic, half weights stepped directly) splits that overhead into the master weights' part and
   the rest.
3. **Targets**, each evaluated on the medians (issue 12): transformer ``mpt-bf16 <= 1.0x bf16-true`` with an
   overhead of at most 2x the floor; deep_mlp ``mpt-fp16 <= 0.9x 16-mixed``; on a GPU (GPT-2 small)
   ``mpt-bf16 <= 0.9x bf16-mixed`` and ``mpt-fp16 <= 0.9x 16-mixed``.
4. ``--profile``: one more run per precision under ``torch.profiler``: the top ops by self time per step, and the
   step's phases (forward, backward, optimizer update, the plugin's methods).

Byte model of the floor, per optimizer step. ``H`` = elements of the parameters that have an fp32 master (the half
ones), ``F`` = elements of the parameters kept fp32 (norm layers), which the optimizer steps directly:

* gradient copy to fp32: read the half gradient (2 B) + write the fp32 master gradient (4 B): ``6 H``
* unscale and non-finite check: read + write every fp32 gradient (4 + 4 B): ``8 (H + F)``
* with loss scaling on (fp16): the unscaled values back into the half gradients, read 4 B + write 2 B: ``6 H``
* weight refresh: read the fp32 master (4 B) + write the half weight (2 B): ``6 H``

So ``20 H + 8 F`` bytes for bf16 and ``26 H + 8 F`` for fp16 with a scaler; the floor is those bytes over the copy
bandwidth (each byte counted once, read or written). It counts three separate passes as the issue states them; a
fused kernel could move fewer (bf16: read 2, write 4, then refresh 6). Not in it: the optimizer's own extra traffic
because it steps fp32 tensors (AdamW reads p, g, m, v and writes p, m, v: 28 B per parameter in fp32, 14 B in bf16),
which any fp32-master scheme pays and "bf16-true" does not.

On CPU, ``Trainer(precision="16-mixed")`` silently means bf16 autocast; the "16-mixed" here is
``MixedPrecision("16-mixed", "cpu")`` (fp16 autocast and a ``torch.amp.GradScaler``), what "16-mixed" is on a GPU.
CPUs have no fast fp16 matmul, so on CPU the transformer runs the bf16 precisions only (plus "32-true") unless
``--precisions`` says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import logging
import math
import shlex
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
from common import (  # noqa: E402  # noqa: E402
    GPT_SIZES,
    WORKLOADS,
    Workload,
    get_workload,
    machine,
    release_memory,
    resolve_accelerator,
    time_steps,
)
from example_utils import PRECISIONS, precision_setup  # noqa: E402

from lightning_mpt import MPTPrecision  # noqa: E402

MiB = 2**20
# MPTPrecision("bf16", master_weights=False): the same autocast, fp32 norm layers and step logic, but the half
# weights stepped directly. mpt-bf16 minus it is what the master weights cost; it minus "bf16-true" the rest.
NOMASTER = "mpt-bf16-nomaster"
# the memory modes other than the defaults (mpt-bf16: 16-bit remainders stepped in chunks; mpt-fp16: 4-byte masters,
# the whole step), asked for by name
CHUNKED = "mpt-bf16-chunked"  # MPTPrecision("bf16", master_remainders=False): 4-byte masters stepped in chunks
COPIES = "mpt-bf16-copies"  # MPTPrecision("bf16", master_remainders=False, chunked_step=False): the whole step
FP16_CHUNKED = "mpt-fp16-chunked"  # MPTPrecision("fp16", chunked_step=True)
OPTIONS = {
    NOMASTER: ("bf16", {"master_weights": False}),
    CHUNKED: ("bf16", {"master_remainders": False}),
    COPIES: ("bf16", {"master_remainders": False, "chunked_step": False}),
    FP16_CHUNKED: ("fp16", {"chunked_step": True}),
}
ALL_PRECISIONS = (*PRECISIONS, *OPTIONS)
CPU_TRANSFORMER = ("32-true", "bf16-mixed", "bf16-true", "mpt-bf16", NOMASTER)  # CPUs have no fast fp16 matmul
TRUE_OF = {"mpt-bf16": "bf16-true", "mpt-fp16": "16-true"}
FAMILY = {"mpt-bf16": ("32-true", "bf16-mixed", "bf16-true", NOMASTER), "mpt-fp16": ("32-true", "16-mixed", "16-true")}


def precision_kwargs(name: str, accelerator: str) -> dict[str, Any]:
    """``time_steps`` arguments for one of :data:`ALL_PRECISIONS` (a fresh plugin each call: plugins hold state)."""
    if name in OPTIONS:
        fmt, options = OPTIONS[name]
        return {"plugin": MPTPrecision(fmt, **options)}  # type: ignore[arg-type]
    setup = precision_setup(name, accelerator)
    return {"precision": setup.get("precision"), "plugin": next(iter(setup.get("plugins", [])), None)}


# ================================================================================================ the rounds
@dataclass
class Run:
    """One training run of one precision."""

    seconds: float  # per step
    skipped: int  # steps skipped for non-finite gradients while timing
    peak_bytes: Optional[int] = None  # CUDA only
    memory: Optional[dict[str, int]] = None  # MemoryProbe's counts (first round, when asked for)


@dataclass
class Spread:
    """Median and range of a list of per-round values."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    def fmt(self, digits: int = 3, scale: float = 1.0) -> str:
        m, lo, hi = (scale * v for v in (self.median, self.lo, self.hi))
        return f"{m:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def precisions_for(workload: str, accelerator: str, requested: Optional[list[str]]) -> list[str]:
    """The precisions a workload runs: ``requested`` (``["all"]``: every one), else all of them except the fp16
    ones of the transformer on a CPU."""
    if requested and requested != ["all"]:
        return list(requested)
    if workload != "transformer":
        return list(PRECISIONS)
    if requested == ["all"] or accelerator == "gpu":
        return list(ALL_PRECISIONS)
    return list(CPU_TRANSFORMER)


def run_rounds(
    workloads: dict[str, Workload],
    precisions: dict[str, list[str]],
    *,
    rounds: int,
    steps: int,
    warmup: int,
    accelerator: str,
    probe_memory: bool = False,
    deadline: Optional[float] = None,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, list[Run]]]:
    """``rounds`` interleaved rounds: in each, every workload and precision once, in an order rotated per round.

    ``deadline`` (a ``time.perf_counter()`` value): start no round that would end after it, at the pace of the
    rounds so far (the first round always runs)."""
    memory_probe = None
    if probe_memory:
        from memory_breakdown import MemoryProbe  # examples/: imports torchmetrics, so only when needed

        memory_probe = MemoryProbe
    runs: dict[str, dict[str, list[Run]]] = {w: {p: [] for p in precisions[w]} for w in workloads}
    t_start = time.perf_counter()
    for r in range(rounds):
        now = time.perf_counter()
        if r > 0 and deadline is not None and now + (now - t_start) / r > deadline:
            log(f"time budget: stopping after {r} of {rounds} rounds")
            break
        for w, wl in workloads.items():
            names = precisions[w]
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                probe = memory_probe(at_step=warmup - 1) if memory_probe is not None and r == 0 else None
                timer = time_steps(
                    wl,
                    steps,
                    callbacks=[probe] if probe is not None else [],
                    accelerator=accelerator,
                    warmup=warmup,
                    **precision_kwargs(name, accelerator),
                )
                run = Run(timer.seconds_per_step, timer.skipped, timer.peak_bytes, probe.result if probe else None)
                runs[w][name].append(run)
                extra = f", {run.skipped} skipped" if run.skipped else ""
                extra += f", peak {run.peak_bytes / MiB:.0f} MiB" if run.peak_bytes else ""
                log(
                    f"[{time.perf_counter() - t_start:6.1f}s] round {r + 1}/{rounds} {w:<11} {name:<10} "
                    f"{1000 * run.seconds:9.2f} ms/step{extra}"
                )
    return runs


# ================================================================================================ byte model, floor
@dataclass
class ByteModel:
    """The bytes the plugin's own work moves per optimizer step (see the module docstring)."""

    half_params: int  # H: elements with an fp32 master
    fp32_params: int  # F: elements kept fp32 (norm layers), stepped directly
    scaling: bool  # fp16 with a loss scaler: unscaled values are written back into the half grads
    remainders: bool = False  # bf16's default: the masters sleep as 16-bit remainders between steps

    def components(self) -> list[tuple[str, int]]:
        h, f = self.half_params, self.fp32_params
        parts = [
            ("gradient copy to fp32 (2 B read + 4 B write per half param)", 6 * h),
            ("unscale + non-finite check (4 B read + 4 B write per fp32 grad)", 8 * (h + f)),
        ]
        if self.scaling:
            parts.append(("unscaled grads back into the half grads (4 B read + 2 B write per half param)", 6 * h))
        if self.remainders:
            parts.append(("masters woken (2 + 2 B read, 4 B write per half param)", 8 * h))
            parts.append(("masters put to sleep, the weights with them (4 B read, 2 + 2 B write)", 8 * h))
        else:
            parts.append(("weight refresh (4 B read master + 2 B write half weight per half param)", 6 * h))
        return parts

    @property
    def total(self) -> int:
        return sum(b for _, b in self.components())


def param_split(model: torch.nn.Module, keep_fp32: tuple[type[torch.nn.Module], ...]) -> tuple[list, list]:
    """Shapes of the parameters that get an fp32 master and of those kept fp32, as ``MPTPrecision`` splits them
    (each shared parameter once)."""
    kept = {id(p) for m in model.modules() if isinstance(m, keep_fp32) for p in m.parameters()}
    half, fp32 = [], []
    for p in model.parameters():  # deduplicated: tied weights count once
        if p.is_floating_point():
            (fp32 if id(p) in kept else half).append(tuple(p.shape))
    return half, fp32


def byte_model(wl: Workload, mpt: str) -> tuple[ByteModel, list, list]:
    with torch.device("meta"):
        model = wl.model()
    plugin = MPTPrecision(mpt[len("mpt-") :])  # type: ignore[arg-type]
    half, fp32 = param_split(model, plugin.keep_fp32)
    numel = lambda shapes: sum(math.prod(s) for s in shapes)
    model_ = ByteModel(numel(half), numel(fp32), plugin.scaler is not None, plugin.master_remainders)
    return model_, half, fp32


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DRAM_BUFFER = 256 * MiB  # beyond the caches (the 2-core VM of the first runs copies at cache speed up to ~56 MiB)


@functools.cache
def copy_bandwidth(nbytes: int, device: torch.device, reps: int = 5) -> float:
    """Bytes per second of ``dst.copy_(src)`` on fp32 buffers of ``nbytes`` (read + write counted): the best of
    ``reps`` timings, each over enough copies to last about a millisecond. Cached per size and device."""
    n = max(nbytes // 4, 1 << 18)
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    inner = 1
    while True:  # warm up, and find a repeat count that lasts >= 1 ms
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            dst.copy_(src)
        _sync(device)
        if time.perf_counter() - t0 > 1e-3 or inner >= 1 << 12:
            break
        inner *= 2
    best = math.inf
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            dst.copy_(src)
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    del src, dst
    release_memory()
    return 2 * 4 * n / best


def bare_passes(
    half_shapes: list,
    fp32_shapes: list,
    dtype: torch.dtype,
    scaling: bool,
    device: torch.device,
    fresh: bool,
    reps: int = 10,
    remainders: bool = False,
) -> float:
    """Seconds (best of ``reps``) of the byte model's passes as bare torch ops on tensors of the model's shapes: the
    foreach copy of the half grads into fp32, the fused AMP unscale, (the copy back into half), the foreach refresh
    of the half weights, or with ``remainders`` the masters' wake and sleep over one flat buffer. ``fresh``: allocate
    the fp32 gradients anew each time, as the plugin does per step."""
    from lightning_mpt.core.masters._remainder_store import _split_into, join

    numel = sum(math.prod(s) for s in half_shapes)
    flat_half = torch.zeros(numel, dtype=torch.int16, device=device)
    flat_rem, flat_master = torch.zeros_like(flat_half), torch.zeros(numel, device=device)
    half_grads = [torch.randn(s, device=device).to(dtype) for s in half_shapes]
    masters = [torch.randn(s, device=device) for s in half_shapes]
    halves = [m.to(dtype) for m in masters]
    unscaled_halves = [torch.empty_like(g) for g in half_grads]  # not the inputs: they must not shrink per rep
    own_grads = [torch.randn(s, device=device) for s in fp32_shapes]
    kept = [torch.empty_like(m) for m in masters]
    found_inf = torch.zeros((), device=device)
    inv = torch.full((), 1 / 1024 if scaling else 1.0, device=device)

    def once() -> None:
        grads = [torch.empty_like(m) for m in masters] if fresh else kept
        torch._foreach_copy_(grads, half_grads)
        torch._amp_foreach_non_finite_check_and_unscale_(grads + own_grads, found_inf, inv)
        if scaling:
            torch._foreach_copy_(unscaled_halves, grads)
        if remainders:
            join(flat_half.view(torch.bfloat16), flat_rem, out=flat_master)
            _split_into(flat_master, flat_half, flat_rem)
        else:
            torch._foreach_copy_(halves, masters)

    best = math.inf
    for i in range(reps + 2):
        _sync(device)
        t0 = time.perf_counter()
        once()
        _sync(device)
        if i >= 2:
            best = min(best, time.perf_counter() - t0)
    return best


@dataclass
class Floor:
    mpt: str
    bytes: ByteModel
    bandwidth: float  # bytes/s of a copy between buffers beyond the caches (DRAM): the floor's
    bandwidth_model_size: float  # bytes/s of a copy between buffers the size of the fp32 master gradients
    bare_reused: float  # seconds
    bare_fresh: float

    @property
    def seconds(self) -> float:
        return self.bytes.total / self.bandwidth


def measure_floor(wl: Workload, mpt: str, device: torch.device, dram_bytes: int = DRAM_BUFFER) -> Floor:
    model, half, fp32 = byte_model(wl, mpt)
    dtype = torch.bfloat16 if mpt == "mpt-bf16" else torch.float16
    dram = copy_bandwidth(max(4 * model.half_params, dram_bytes), device)
    at_size = copy_bandwidth(4 * model.half_params, device)
    reused = bare_passes(half, fp32, dtype, model.scaling, device, fresh=False, remainders=model.remainders)
    fresh = bare_passes(half, fp32, dtype, model.scaling, device, fresh=True, remainders=model.remainders)
    release_memory()
    return Floor(mpt, model, dram, at_size, reused, fresh)


# ================================================================================================ summary
@dataclass
class Target:
    workload: str
    text: str
    value: Optional[Spread]  # the measured quantity per round
    limit: float
    unit: str = "x"

    @property
    def met(self) -> Optional[bool]:
        return None if self.value is None else self.value.median <= self.limit

    def verdict(self) -> str:
        if self.value is None:
            return "not measured"
        v = "met" if self.met else "NOT met"
        if self.value.lo <= self.limit <= self.value.hi:
            v += " (the spread straddles the limit)"
        return v


@dataclass
class Summary:
    accelerator: str
    size: str
    machine: str
    command: str
    rounds: int
    steps: int
    warmup: int
    descriptions: dict[str, str]
    params: dict[str, int]
    runs: dict[str, dict[str, list[Run]]]
    floors: dict[str, dict[str, Floor]] = field(default_factory=dict)
    dram_bytes: int = DRAM_BUFFER

    def step_times(self, w: str, p: str) -> Spread:
        return Spread([r.seconds for r in self.runs[w][p]])

    def ratio(self, w: str, num: str, den: str) -> Optional[Spread]:
        a, b = self.runs[w].get(num), self.runs[w].get(den)
        if not a or not b:
            return None
        return Spread([x.seconds / y.seconds for x, y in zip(a, b)])

    def overhead(self, w: str, mpt: str, base: Optional[str] = None) -> Optional[Spread]:
        """``mpt``'s step time minus ``base``'s (default: the matching "true" precision), per round."""
        a, b = self.runs[w].get(mpt), self.runs[w].get(base or TRUE_OF[mpt])
        if not a or not b:
            return None
        return Spread([x.seconds - y.seconds for x, y in zip(a, b)])

    def ratio_pairs(self, w: str) -> list[tuple[str, str]]:
        present = self.runs[w]
        pairs = [(m, b) for m in ("mpt-bf16", "mpt-fp16") if m in present for b in FAMILY[m] if b in present]
        own = [(m, "mpt-bf16") for m in (CHUNKED, COPIES) if m in present and "mpt-bf16" in present]
        if FP16_CHUNKED in present and "mpt-fp16" in present:
            own.append((FP16_CHUNKED, "mpt-fp16"))
        return pairs + own

    def targets(self) -> list[Target]:
        out = []
        if "transformer" in self.runs:
            out.append(
                Target(
                    "transformer",
                    "mpt-bf16 / bf16-true <= 1.0",
                    self.ratio("transformer", "mpt-bf16", "bf16-true"),
                    1.0,
                )
            )
            floor = self.floors.get("transformer", {}).get("mpt-bf16")
            over = self.overhead("transformer", "mpt-bf16")
            if floor is not None and over is not None:
                rel = Spread([v / floor.seconds for v in over.values])
                out.append(
                    Target(
                        "transformer", "mpt-bf16 overhead over bf16-true <= 2x the bandwidth floor", rel, 2.0, "x floor"
                    )
                )
            if self.accelerator == "gpu":
                sized = "" if self.size == "gpt2" else f" (size {self.size}, the target is for gpt2)"
                out.append(
                    Target(
                        "transformer",
                        f"GPU: mpt-bf16 / bf16-mixed <= 0.9{sized}",
                        self.ratio("transformer", "mpt-bf16", "bf16-mixed"),
                        0.9,
                    )
                )
                out.append(
                    Target(
                        "transformer",
                        f"GPU: mpt-fp16 / 16-mixed <= 0.9{sized}",
                        self.ratio("transformer", "mpt-fp16", "16-mixed"),
                        0.9,
                    )
                )
        if "deep_mlp" in self.runs:
            out.append(
                Target(
                    "deep_mlp",
                    "mpt-fp16 / 16-mixed (fp16 autocast + GradScaler) <= 0.9",
                    self.ratio("deep_mlp", "mpt-fp16", "16-mixed"),
                    0.9,
                )
            )
        return out

    # ------------------------------------------------------------------ output
    def markdown(self) -> str:
        timing = (
            "mean over the timed window between two device syncs"
            if self.accelerator == "gpu"
            else "median of the timed steps"
        )
        lines = [
            f"Machine: {self.machine}.",
            "",
            f"Command: `{self.command}`: {self.rounds} interleaved round{'s' if self.rounds > 1 else ''}, "
            f"{self.steps} steps per run of which "
            f"{self.warmup} warm-up; step time = {timing}; each value is the median over rounds [min–max].",
        ]
        for w, by_precision in self.runs.items():
            peak = all(r.peak_bytes for runs in by_precision.values() for r in runs)
            lines += ["", f"**{w}** ({self.params[w] / 1e6:.2f}M parameters): {self.descriptions[w]}.", ""]
            lines += [
                "| precision | ms/step | skipped steps while timing |" + (" peak MiB |" if peak else ""),
                "|---|--:|--:|" + ("--:|" if peak else ""),
            ]
            for p, runs in by_precision.items():
                row = f"| {p} | {self.step_times(w, p).fmt(2, 1000)} | {sum(r.skipped for r in runs)} |"
                if peak:
                    row += f" {max(r.peak_bytes or 0 for r in runs) / MiB:.0f} |"
                lines.append(row)
            pairs = self.ratio_pairs(w)
            if pairs:
                lines += ["", "| ratio | median [min–max] over rounds |", "|---|--:|"]
                for m, b in pairs:
                    lines.append(f"| {m} / {b} | {self.ratio(w, m, b).fmt()} |")  # type: ignore[union-attr]
            floors = self.floors.get(w, {})
            if floors:
                first = next(iter(floors.values()))
                dram_mib = max(4 * first.bytes.half_params, self.dram_bytes) / MiB
                lines += [
                    "",
                    f"Copy bandwidth: {first.bandwidth / 1e9:.1f} GB/s between buffers of {dram_mib:.0f} MiB "
                    f"(beyond the caches: the floor's), {first.bandwidth_model_size / 1e9:.1f} GB/s between "
                    f"buffers the size of the fp32 master gradients ({4 * first.bytes.half_params / MiB:.1f} "
                    "MiB).",
                    "",
                    "| plugin overhead | ms/step | plugin bytes/step (byte model) | bandwidth floor "
                    "(beyond the caches) | overhead / floor | floor at cache speed (the gradients' size) "
                    "| the byte model's passes as bare torch ops (fp32 grads reused / allocated per step) |",
                    "|---|--:|--:|--:|--:|--:|--:|",
                ]
                for m, fl in floors.items():
                    rows = [(f"{m} - {TRUE_OF[m]}", self.overhead(w, m), True)]
                    if m == "mpt-bf16" and NOMASTER in by_precision:
                        rows += [
                            (f"{m} - {NOMASTER} (the master weights)", self.overhead(w, m, NOMASTER), True),
                            (
                                f"{NOMASTER} - {TRUE_OF[m]} (autocast, fp32 norms, step logic)",
                                self.overhead(w, NOMASTER, TRUE_OF[m]),
                                False,
                            ),
                        ]
                    for label, over, with_floor in rows:
                        rel = Spread([v / fl.seconds for v in over.values]).fmt(1) if over and with_floor else "–"
                        floor_cells = "– | – | – | – | –"
                        if with_floor:
                            floor_cells = (
                                f"{fl.bytes.total / 1e6:.1f} MB | {1000 * fl.seconds:.3f} ms | {rel} | "
                                f"{1000 * fl.bytes.total / fl.bandwidth_model_size:.3f} ms | "
                                f"{1000 * fl.bare_reused:.3f} / {1000 * fl.bare_fresh:.3f} ms"
                            )
                        lines.append(f"| {label} | {over.fmt(2, 1000) if over else 'n/a'} | {floor_cells} |")
        worst = max(
            ((s.hi / s.lo - 1, w, p) for w, by in self.runs.items() for p in by for s in [self.step_times(w, p)]),
            default=None,
        )
        if worst is not None and len(next(iter(next(iter(self.runs.values())).values()))) > 1:
            spread, w, p = worst
            lines += [
                "",
                f"Largest spread of a step time over the rounds: {100 * spread:.1f}% ({w}, {p})."
                + (
                    " More than 10%: the machine was busy while measuring; these ratios are not reliable (on a"
                    " shared CPU try --threads 1, or measure on a quiet machine)."
                    if spread > 0.10
                    else ""
                ),
            ]
        targets = self.targets()
        if targets:
            lines += ["", "| target (issue 12) | measured: median [min–max] | verdict |", "|---|--:|---|"]
            for t in targets:
                value = "—"
                if t.value is not None:
                    value = t.value.fmt(4) if t.unit == "x" else f"{t.value.fmt(2)} {t.unit}"
                lines.append(f"| {t.workload}: {t.text} | {value} | {t.verdict()} |")
        return "\n".join(lines)

    def byte_model_text(self) -> str:
        out = []
        for w, floors in self.floors.items():
            for m, fl in floors.items():
                b = fl.bytes
                out.append(
                    f"{w} {m}: H = {b.half_params:,} half parameters with a master, F = {b.fp32_params:,} kept fp32"
                )
                out += [f"    {name}: {n / 1e6:.2f} MB" for name, n in b.components()]
                out.append(
                    f"    total {b.total / 1e6:.2f} MB / {fl.bandwidth / 1e9:.1f} GB/s "
                    f"= floor {1000 * fl.seconds:.3f} ms"
                )
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "command": self.command,
            "accelerator": self.accelerator,
            "size": self.size,
            "rounds": self.rounds,
            "steps": self.steps,
            "warmup": self.warmup,
            "params": self.params,
            "runs": {w: {p: [r.__dict__ for r in runs] for p, runs in by.items()} for w, by in self.runs.items()},
            "ratios": {
                w: {
                    f"{m} / {b}": self.ratio(w, m, b).values  # type: ignore[union-attr]
                    for m, b in self.ratio_pairs(w)
                }
                for w in self.runs
            },
            "floors": {
                w: {
                    m: {
                        "bytes": f.bytes.total,
                        "components": f.bytes.components(),
                        "bandwidth": f.bandwidth,
                        "bandwidth_model_size": f.bandwidth_model_size,
                        "floor_seconds": f.seconds,
                        "bare_reused": f.bare_reused,
                        "bare_fresh": f.bare_fresh,
                    }
                    for m, f in fl.items()
                }
                for w, fl in self.floors.items()
            },
            "targets": [
                {
                    "workload": t.workload,
                    "target": t.text,
                    "values": t.value.values if t.value else None,
                    "limit": t.limit,
                    "met": t.met,
                }
                for t in self.targets()
            ],
        }


# ================================================================================================ profile
PLUGIN_METHODS = (  # labelled in profiles when they exist (names may change as the plugin evolves)
    ("lightning_mpt.core.masters.copies", "CopyMasters", "prepare"),
    ("lightning_mpt.core.masters.copies", "CopyMasters", "enter"),
    ("lightning_mpt.core.masters.copies", "CopyMasters", "exit"),
    ("lightning_mpt.core.masters.copies", "CopyMasters", "release"),
    # bf16's default: 16-bit remainders stepped in chunks (their own prepare, chunk steps, wake and sleep)
    ("lightning_mpt.core.masters.remainders", "RemainderMasters", "prepare"),
    ("lightning_mpt.core.masters.remainders", "RemainderMasters", "wake"),
    ("lightning_mpt.core.masters.remainders", "RemainderMasters", "write_back"),
    ("lightning_mpt.core.masters.chunked", "ChunkedStep", "steps"),
    ("lightning_mpt.precision", "MPTPrecision", "pre_backward"),
    ("lightning_mpt.core.engine", "MixedPrecisionEngine", "_sync"),  # the step's one host sync
    ("torch.amp.grad_scaler", "GradScaler", "unscale_"),
    ("torch.amp.grad_scaler", "GradScaler", "update"),
)
PHASES = ("model.forward", "model.backward", "optimizer zero_grad", "optimizer update")


@contextlib.contextmanager
def labelled_methods() -> Iterator[None]:
    """Wrap the plugin's (and GradScaler's) step methods in ``record_function`` labels while profiling."""
    saved = []
    for module_name, cls_name, method in PLUGIN_METHODS:
        cls = getattr(importlib.import_module(module_name), cls_name, None)
        fn = getattr(cls, method, None) if cls is not None else None
        if fn is None or not callable(fn):
            continue
        label = f"{cls_name}.{method}"

        def make(fn: Callable, label: str) -> Callable:
            @wraps(fn)
            def labelled(*args: Any, **kwargs: Any) -> Any:
                with torch.profiler.record_function(label):
                    return fn(*args, **kwargs)

            return labelled

        saved.append((cls, method, cls.__dict__.get(method)))
        setattr(cls, method, make(fn, label))
    try:
        yield
    finally:
        for cls, method, original in saved:
            if original is None:
                delattr(cls, method)  # it was inherited
            else:
                setattr(cls, method, original)


class ProfileWindow(L.Callback):
    """``torch.profiler`` over batches ``start`` to ``start + count - 1``, after one profiled warm-up batch (the
    profiler's first batch pays its own start-up)."""

    def __init__(self, start: int, count: int, cuda: bool) -> None:
        self.start, self.count = start, count
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=count, repeat=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule)
        self.wall = 0.0
        self._t0 = 0.0
        self._cuda = cuda
        self._on = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.start - 1:
            self.prof.__enter__()
            self._on = True
        if batch_idx == self.start:
            if self._cuda:
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._on:
            return
        if batch_idx == self.start + self.count - 1:
            if self._cuda:
                torch.cuda.synchronize()
            self.wall = time.perf_counter() - self._t0
        self.prof.step()
        if batch_idx == self.start + self.count - 1:
            self.prof.__exit__(None, None, None)
            self._on = False


def _self_device_us(e: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, name, None)
        if v is not None:
            return float(v)
    return 0.0


@dataclass
class Profile:
    precision: str
    steps: int
    wall_ms: float  # per step, profiled (the profiler slows small ops down)
    ops: dict[str, float]  # op -> self time ms per step (device time on CUDA, CPU time otherwise)
    total_ms: float  # sum of all ops' self time per step
    phases: dict[str, float]  # label -> host ms per step, exclusive of nested labels


def profile_run(wl: Workload, precision: str, accelerator: str, warmup: int, count: int) -> Profile:
    cuda = accelerator == "gpu"
    window = ProfileWindow(warmup, count, cuda)
    with labelled_methods():
        time_steps(
            wl,
            warmup + count,
            callbacks=[window],
            accelerator=accelerator,
            warmup=warmup,
            **precision_kwargs(precision, accelerator),
        )
    averages = window.prof.key_averages()
    ops: dict[str, float] = {}
    for e in averages:
        if not e.key.startswith("aten::"):
            continue  # labels, runtime calls and (on CUDA) the kernels themselves: each aten op counts its kernels
        t = _self_device_us(e) if cuda else float(e.self_cpu_time_total)
        if t > 0:
            ops[e.key] = t / 1000 / count
    labels = {"model.forward", "model.backward"} | {f"{c}.{m}" for _, c, m in PLUGIN_METHODS}
    phases: dict[str, float] = defaultdict(float)

    def visit(ev: Any, owner: Optional[str]) -> None:
        if ev.device_type != torch.autograd.DeviceType.CPU:
            return  # a label's copy on the GPU timeline (gpu_user_annotation)
        name = ev.name
        if name.startswith("Optimizer.step#"):
            name = "optimizer update"
        elif name.startswith("Optimizer.zero_grad#"):
            name = "optimizer zero_grad"
        if name in labels or name in ("optimizer update", "optimizer zero_grad"):
            phases[name] += ev.cpu_time_total / 1000 / count
            if owner is not None:
                phases[owner] -= ev.cpu_time_total / 1000 / count  # exclusive: nested labels are their own rows
            owner = name
        for child in ev.cpu_children:
            visit(child, owner)

    for ev in window.prof.events():
        if ev.cpu_parent is None:
            visit(ev, None)
    return Profile(precision, count, 1000 * window.wall / count, ops, sum(ops.values()), dict(phases))


def profile_markdown(w: str, profiles: list[Profile], top: int, cuda: bool) -> str:
    kind = "self CUDA time" if cuda else "self CPU time"
    chosen: list[str] = []
    for p in profiles:
        for op, _ in sorted(p.ops.items(), key=lambda kv: -kv[1])[:top]:
            if op not in chosen:
                chosen.append(op)
    chosen.sort(key=lambda op: -max(p.ops.get(op, 0.0) for p in profiles))
    head = "| op | " + " | ".join(p.precision for p in profiles) + " |"
    lines = [
        f"**{w}**: top {top} ops of each precision by {kind}, ms per step (share of all ops' self time); "
        f"{profiles[0].steps} profiled steps.",
        "",
        head,
        "|---|" + "--:|" * len(profiles),
    ]
    for op in chosen:
        cells = [f"{p.ops[op]:.2f} ({100 * p.ops[op] / p.total_ms:.0f}%)" if op in p.ops else "–" for p in profiles]
        lines.append(f"| `{op.replace('|', '/')}` | " + " | ".join(cells) + " |")
    lines.append("| all ops | " + " | ".join(f"{p.total_ms:.2f}" for p in profiles) + " |")
    lines.append("| profiled wall time per step | " + " | ".join(f"{p.wall_ms:.2f}" for p in profiles) + " |")
    names = [n for n in PHASES if any(n in p.phases for p in profiles)]
    names += sorted({n for p in profiles for n in p.phases} - set(names))
    host = "host ms per step (including waits at device syncs)" if cuda else "ms per step"
    lines += [
        "",
        f"**{w}**: step phases, {host}: each label's time minus the labels nested in it. `optimizer update`"
        " is `Optimizer.step` without what the closure runs inside it (forward, backward, zero_grad and the"
        " plugin's labelled methods, not Lightning's own closure bookkeeping); `CopyMasters.prepare` copies"
        " and unscales the gradients, `CopyMasters.exit` refreshes the half weights; with bf16's remainders"
        " `RemainderMasters.prepare` checks for edits, `ChunkedStep.steps` runs the chunks, `.wake` rebuilds"
        " a chunk's fp32 masters and `.write_back` splits them back into weights and remainders.",
        "",
        "| phase | " + " | ".join(p.precision for p in profiles) + " |",
        "|---|" + "--:|" * len(profiles),
    ]
    for n in names:
        cells = [f"{p.phases[n]:.2f}" if n in p.phases else "–" for p in profiles]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_profiles(
    workloads: dict[str, Workload],
    precisions: dict[str, list[str]],
    accelerator: str,
    warmup: int,
    count: int,
    top: int,
    log: Callable[[str], None] = print,
) -> str:
    parts = []
    for w, wl in workloads.items():
        profiles = []
        for name in precisions[w]:
            profiles.append(profile_run(wl, name, accelerator, warmup, count))
            log(f"profiled {w} {name}: {profiles[-1].wall_ms:.2f} ms/step under the profiler")
        parts.append(profile_markdown(w, profiles, top, accelerator == "gpu"))
    return "\n\n".join(parts)


# ================================================================================================ entry point
def add_arguments(p: argparse.ArgumentParser, steps: int = 25, rounds: int = 5) -> None:
    p.add_argument("--accelerator", default="cpu", help="cpu, gpu (cuda), or auto")
    p.add_argument(
        "--size",
        choices=list(GPT_SIZES),
        default=None,
        help="transformer size: tiny, small (default on CPU), gpt2 (default on GPU: GPT-2 small, 124M)",
    )
    p.add_argument(
        "--dropout", type=float, default=0.0, help="dropout of the transformer (default 0, as in pretraining)"
    )
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument(
        "--precisions",
        nargs="+",
        choices=[*ALL_PRECISIONS, "all"],
        help=f"default: all; on CPU the transformer runs 32-true and the bf16 ones only. {NOMASTER} is "
        f"MPTPrecision('bf16', master_weights=False) (the transformer runs it by default); {CHUNKED}: "
        f"master_remainders=False (4-byte masters, chunked); {COPIES}: that and chunked_step=False (the whole step, "
        f"the bf16 default before 0.4); {FP16_CHUNKED}: MPTPrecision('fp16', chunked_step=True)",
    )
    p.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (the issue asks for at least 5)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps per run, warm-up included (default {steps} on CPU, 13 on GPU)",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed first steps of each run (default 5 on CPU, 3 on GPU)"
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-floor", action="store_true", help="skip the bandwidth floor")
    p.add_argument(
        "--bandwidth-mib",
        type=int,
        default=DRAM_BUFFER // MiB,
        help="buffer size of the copy benchmark (default 256: beyond the caches); the model's fp32 master "
        "gradients' size if larger",
    )
    p.add_argument("--profile", action="store_true", help="also profile one run per precision (top ops, phases)")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--top", type=int, default=6, help="ops per precision in the profile table")
    p.add_argument(
        "--max-minutes",
        type=float,
        help="time budget of the rounds (and the profile): start no round "
        "that would end past it; the rounds done are reported",
    )
    p.add_argument("--json", type=Path, help="also write the raw numbers here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def quiet_lightning() -> None:
    """Lightning's per-run banners and the warnings that every benchmark run repeats."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_utilities"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for msg in (
        ".*does not have many workers.*",
        ".*isinstance\\(treespec, LeafSpec\\).*",
        ".*litlogger.*",
        ".*precision.*is not supported by the model summary.*",
        ".*TensorFloat32.*",
    ):
        warnings.filterwarnings("ignore", message=msg)


@dataclass
class Config:
    accelerator: str
    size: str
    steps: int
    warmup: int
    workloads: dict[str, Workload]
    precisions: dict[str, list[str]]
    deadline: Optional[float] = None  # time.perf_counter() value, from --max-minutes

    def time_left(self) -> bool:
        return self.deadline is None or time.perf_counter() < self.deadline


def configure(args: argparse.Namespace) -> Config:
    accelerator = resolve_accelerator(args.accelerator)
    gpu = accelerator == "gpu"
    size = args.size or ("gpt2" if gpu else "small")
    warmup = args.warmup if args.warmup is not None else (3 if gpu else 5)
    steps = args.steps if args.steps is not None else (13 if gpu else 25)
    if warmup < 2:
        raise SystemExit("--warmup must be at least 2")
    if steps <= warmup:
        raise SystemExit(f"--steps ({steps}) must exceed --warmup ({warmup})")
    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = {w: get_workload(w, size, args.dropout) for w in args.workloads}
    precisions = {w: precisions_for(w, accelerator, args.precisions) for w in workloads}
    deadline = time.perf_counter() + 60 * args.max_minutes if args.max_minutes else None
    return Config(accelerator, size, steps, warmup, workloads, precisions, deadline)


def progress(args: argparse.Namespace) -> Callable[[str], None]:
    """Where progress lines go: stderr (the tables go to stdout), or nowhere with ``--quiet``."""
    return (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))


def measure(args: argparse.Namespace, cfg: Config, command: str, probe_memory: bool = False) -> Summary:
    log = progress(args)
    params = {}
    for w, wl in cfg.workloads.items():
        with torch.device("meta"):
            params[w] = sum(p.numel() for p in wl.model().parameters())
    runs = run_rounds(
        cfg.workloads,
        cfg.precisions,
        rounds=args.rounds,
        steps=cfg.steps,
        warmup=cfg.warmup,
        accelerator=cfg.accelerator,
        probe_memory=probe_memory,
        deadline=cfg.deadline,
        log=log,
    )
    rounds = min(len(r) for by in runs.values() for r in by.values())
    summary = Summary(
        cfg.accelerator,
        cfg.size,
        machine(cfg.accelerator),
        command,
        rounds,
        cfg.steps,
        cfg.warmup,
        {w: wl.description for w, wl in cfg.workloads.items()},
        params,
        runs,
        dram_bytes=args.bandwidth_mib * MiB,
    )
    if not args.no_floor:
        device = torch.device("cuda" if cfg.accelerator == "gpu" else "cpu")
        for w, wl in cfg.workloads.items():
            for m in ("mpt-bf16", "mpt-fp16"):
                if m in runs[w] and TRUE_OF[m] in runs[w]:
                    summary.floors.setdefault(w, {})[m] = measure_floor(wl, m, device, args.bandwidth_mib * MiB)
        log("bandwidth floor measured")
    return summary


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    quiet_lightning()
    cfg = configure(args)
    command = "python benchmarks/step_time.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    summary = measure(args, cfg, command.strip())
    text = summary.markdown()
    print(text)
    if summary.floors:
        print("\nByte model (bytes the plugin's own work moves per optimizer step):\n" + summary.byte_model_text())
    profile = ""
    if args.profile and not cfg.time_left():
        print("\n(profile skipped: --max-minutes spent)")
    elif args.profile:
        profile = run_profiles(
            cfg.workloads, cfg.precisions, cfg.accelerator, cfg.warmup, args.profile_steps, args.top, log=progress(args)
        )
        print("\n" + profile)
    out = {**summary.to_json(), "markdown": text, "profile": profile}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
