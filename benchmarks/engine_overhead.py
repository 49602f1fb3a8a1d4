"""The host time of the plugin's own step phases on an overhead-bound model, without Lightning, next to
``torch.amp.GradScaler``'s ``unscale_`` + ``update`` on the same gradients.

    python benchmarks/engine_overhead.py                        # deep_mlp (400 tensors), fp16 with a scaler
    python benchmarks/engine_overhead.py --steps 200 --threads 1
    python benchmarks/engine_overhead.py --parts                # also: where the time goes, method by method
                                                                # (means: a round's first step lays out buffers)
    python benchmarks/engine_overhead.py --floor                # also: the tensor work alone, without bookkeeping,
                                                                # and the least a step does; each as a ratio too
    python benchmarks/engine_overhead.py --device cuda          # the host time on a GPU (make gpu-check)
    python benchmarks/engine_overhead.py --convert 2000          # conversion time: 2000 and 8000 tensors

Each phase of every step is timed around the engine's calls (``decide``: the masters' ``prepare`` and the one host
sync; ``step``: ``enter``, the optimizer, ``exit``; ``release``), and the optimizer's own ``step`` alone is timed in
the same loop and subtracted from ``step``. The clock is this thread's CPU time on a CPU (``time.thread_time``: time
that other processes take from a shared machine does not count; with ``--threads 1``, the default, every op runs on
this thread) and the wall clock on a GPU (``--clock`` chooses). Reported per phase: median and ``[min-max]`` over
``--rounds`` rounds of the per-round median over steps. The GradScaler baseline runs interleaved, one round each, and
the last lines are the ratio of the two per round, then the same with ``optimizer.zero_grad()`` (set to ``None``)
counted on both sides: the plugin's ``release`` drops the gradients before it, GradScaler leaves them to it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_mpt.core.engine import MixedPrecisionEngine  # noqa: E402
from lightning_mpt.core.masters._edits import FlatEdits  # noqa: E402
from lightning_mpt.core.masters._flat import FlatLayout  # noqa: E402
from lightning_mpt.core.masters._halves import HalfWeights  # noqa: E402
from lightning_mpt.core.masters.copies import CopyMasters  # noqa: E402
from lightning_mpt.core.scaler import DynamicLossScaler  # noqa: E402


def deep_mlp(depth: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


class Timed(torch.optim.AdamW):
    """AdamW that times its own ``step`` (subtracted from the engine's step phase)."""

    spent = 0.0

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        t = clock()
        out = super().step(closure)
        self.spent = clock() - t
        return out


clock = time.thread_time  # set by main()


def settle(device: torch.device) -> None:
    """On a GPU: wait for the queued kernels, so that a phase's host time does not include the backward's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mpt_round(steps: int, depth: int, width: int, dtype: torch.dtype, device: torch.device) -> dict[str, list[float]]:
    model = deep_mlp(depth, width).to(device)
    engine = MixedPrecisionEngine(CopyMasters(dtype), DynamicLossScaler(init_scale=2.0**10))
    engine.convert(model)
    opt = Timed(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, width, device=device), torch.randn(16, width, device=device)
    times: dict[str, list[float]] = {"decide": [], "step (plugin)": [], "release": [], "total": [], "zero_grad": []}
    for _ in range(steps):
        t0 = clock()
        engine.release_gradients(drop=True)
        t1 = clock()
        with torch.autocast(device.type, dtype=dtype, enabled=False):
            loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        engine.scale_loss(loss).backward()
        settle(device)
        t2 = clock()
        pending = engine.decide(opt)
        t3 = clock()
        engine.step(opt, pending)
        t4 = clock()
        del pending  # as in Lightning's loop: nothing holds a step's gradients past it (the buffer is then reused)
        t5 = clock()
        opt.zero_grad()
        times["zero_grad"].append(clock() - t5)
        times["release"].append(t1 - t0)
        times["decide"].append(t3 - t2)
        times["step (plugin)"].append(t4 - t3 - opt.spent)
        times["total"].append((t1 - t0) + (t3 - t2) + (t4 - t3 - opt.spent))
    engine.restore()
    return times


def timed_parts() -> dict[str, list[float]]:
    """Time the masters' inner methods by wrapping them (``--parts``): seconds of each call, per method."""
    from lightning_mpt.core.masters import _copy_step, _edits, _groups, copies

    wrapped = [
        (_copy_step.WholeStep, "collect", "collect (which gradients)"),
        (_copy_step.WholeStep, "_to_fp32", "copy to fp32 (all)"),
        (_edits.WeightEdits, "flags", "edit check"),
        (_copy_step, "_unscale_", "unscale"),
        (_copy_step.WholeStep, "sync_edits", "sync_edits"),
        (_groups.GroupSwap, "swap", "swap (x2)"),
        (copies.CopyMasters, "write_back", "write back"),
        (_copy_step.WholeStep, "release", "release (x2)"),
    ]
    spent: dict[str, list[float]] = {label: [] for _, _, label in wrapped}
    for owner, name, label in wrapped:
        original = getattr(owner, name)

        def timed(*args, _f=original, _label=label, **kwargs):  # type: ignore[no-untyped-def]
            t = clock()
            out = _f(*args, **kwargs)
            spent[_label].append(clock() - t)
            return out

        setattr(owner, name, timed)
    return spent


def scaler_round(steps: int, depth: int, width: int, device: torch.device) -> dict[str, list[float]]:
    model = deep_mlp(depth, width).to(device)
    opt = Timed(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    x, y = torch.randn(16, width, device=device), torch.randn(16, width, device=device)
    times: dict[str, list[float]] = {"unscale_+update": [], "zero_grad (GradScaler)": []}
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        settle(device)
        t0 = clock()
        scaler.unscale_(opt)
        t1 = clock()
        scaler.step(opt)
        t2 = clock()
        scaler.update()
        t3 = clock()
        opt.zero_grad()
        times["zero_grad (GradScaler)"].append(clock() - t3)
        times["unscale_+update"].append((t1 - t0) + (t2 - t1 - opt.spent) + (t3 - t2))
    return times


def conversion(tensors: int, dtype: torch.dtype) -> float:
    """Seconds to convert, then restore, a module of ``tensors`` small parameters (``--convert``)."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(tensors // 2)])
    engine = MixedPrecisionEngine(CopyMasters(dtype), None)
    t = time.perf_counter()
    engine.convert(model)
    engine.restore()
    return time.perf_counter() - t


def tensor_passes(
    steps: int, depth: int, width: int, dtype: torch.dtype, device: torch.device, least: bool = False
) -> list[float]:
    """Seconds per step of the plugin's tensor work alone, without its bookkeeping (``--floor``), in a training loop
    of its own that runs as the plugin's does (a half model's forward and backward, then the timed work before the
    optimizer's step on the masters, the step untimed, then the timed work after it), so that the data and the
    tensors' metadata are in the caches as they are in the plugin's step: the half gradients copied into one fp32
    buffer, the edit check (the masters rounded into a scratch laid out as the flat half weights, the bits compared at
    once), the unscale with its non-finite check, and the masters rounded into the weights.

    ``least``: the least that a step of the plugin does instead, as it runs from the second step on: the edit check is
    the flat weights' fingerprints compared with those expected, taken again after the refresh (the check that needs no
    copy of the weights), and each fp32 gradient is attached to its parameter (where hooks and clipping see it; torch
    >= 2.13) and dropped at the end, as ``release`` does."""
    model = deep_mlp(depth, width).to(device=device, dtype=dtype)
    halves = list(model.parameters())
    masters = [h.detach().float() for h in halves]
    layout = FlatLayout(masters)  # the plugin's gradient buffer: each shape's tensors side by side
    fp32, views = layout.views(torch.float32, device)
    for m, g in zip(masters, views):
        m.grad = g  # the optimizer steps the masters with them
    opt = torch.optim.AdamW(masters, lr=1e-3)
    flat = HalfWeights(halves, chunk=2**24)  # the plugin's flat half weights and its edit check
    check = FlatEdits(flat)
    master_of = dict(zip(halves, masters))
    aligned = [master_of[p] for p in flat.params]
    found, inv = torch.zeros((), device=device), torch.full((), 1 / 1024, device=device)
    on_params = least and hasattr(torch.Tensor, "grad_dtype")  # torch >= 2.13: as under the plugin
    for h in halves if on_params else ():
        h.grad_dtype = None  # a half parameter may hold an fp32 gradient
    expected = flat.fingerprints(upper=True)
    x, y = torch.randn(16, width, device=device, dtype=dtype), torch.randn(16, width, device=device)
    times = []
    for _ in range(steps):
        (nn.functional.mse_loss(model(x).float(), y) * 1024).backward()
        settle(device)
        t = clock()
        grads = [h.grad for h in halves]
        torch._foreach_copy_(views, grads)
        del grads
        if least:
            for h, g in zip(halves, views):
                h.grad = g if on_params else None
            torch.equal(flat.fingerprints(upper=True), expected)
        else:
            for h in halves:
                h.grad = None
            check.flags(aligned)
        torch._amp_foreach_non_finite_check_and_unscale_([fp32], found, inv)
        settle(device)
        spent = clock() - t
        opt.step()
        settle(device)
        t = clock()
        with torch.no_grad():
            torch._foreach_copy_(halves, masters)
        if least:
            expected = flat.fingerprints(upper=True)
            for h in halves:
                h.grad = None
        settle(device)
        times.append(spent + clock() - t)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--depth", type=int, default=200)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the host time of the same phases on a GPU")
    p.add_argument("--clock", choices=["thread", "wall"], help="default: thread on a CPU, wall on a GPU")
    p.add_argument("--parts", action="store_true", help="also time the masters' inner methods (adds a little to each)")
    p.add_argument("--floor", action="store_true", help="also time the tensor work alone, and the least a step does")
    p.add_argument(
        "--convert", type=int, metavar="N", help="instead: convert and restore N and 4N tensors (linear: ratio ~4)"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    device = torch.device(args.device)
    global clock
    clock = (
        time.thread_time
        if (args.clock or ("thread" if device.type == "cpu" else "wall")) == "thread"
        else time.perf_counter
    )
    if args.convert:
        small, large = (min(conversion(n, dtype) for _ in range(3)) for n in (args.convert, 4 * args.convert))
        print(
            f"convert + restore, best of 3: {args.convert} tensors {small:.3f} s, {4 * args.convert} tensors "
            f"{large:.3f} s: {large / small:.1f}x for 4x the tensors"
        )
        return
    floors = {"tensor work alone": False, "least a step does": True} if args.floor else {}
    parts = timed_parts() if args.parts else {}
    per_round: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, least in floors.items():
            times = tensor_passes(args.steps, args.depth, args.width, dtype, device, least)
            per_round.setdefault(name, []).append(1000 * statistics.median(times[args.warmup :]))
        for times in (
            mpt_round(args.steps, args.depth, args.width, dtype, device),
            scaler_round(args.steps, args.depth, args.width, device),
        ):
            for name, values in times.items():
                per_round.setdefault(name, []).append(1000 * statistics.median(values[args.warmup :]))
    shape = f"{args.depth} x Linear({args.width}, {args.width})"
    kind = "thread CPU" if clock is time.thread_time else "wall-clock"
    print(f"deep_mlp {shape}, {args.dtype}, {device.type}, {args.rounds} rounds, host ms/step ({kind} time)")
    for name, values in per_round.items():
        print(f"  {name:18s} {statistics.median(values):7.3f}  [{min(values):.3f}-{max(values):.3f}]")
    # per round (both measured on the same machine state, one right after the other): robust to a shared machine
    ratios = [total / scaler for total, scaler in zip(per_round["total"], per_round["unscale_+update"])]
    print(f"  {'total / GradScaler':18s} {statistics.median(ratios):7.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
    # with zero_grad(set_to_none=True) counted on both sides: the plugin's release drops the gradients first
    with_zero = [
        (total + zero) / (scaler + scaler_zero)
        for total, zero, scaler, scaler_zero in zip(
            per_round["total"],
            per_round["zero_grad"],
            per_round["unscale_+update"],
            per_round["zero_grad (GradScaler)"],
        )
    ]
    label = "with zero_grad"
    print(f"  {label:18s} {statistics.median(with_zero):7.2f}x [{min(with_zero):.2f}-{max(with_zero):.2f}]")
    scaler_zero = [a + b for a, b in zip(per_round["unscale_+update"], per_round["zero_grad (GradScaler)"])]
    for name in floors:  # the same per-round ratios for the floors (which drop the gradients, as zero_grad does)
        for label, against in ((f"{name} / GradScaler", "unscale_+update"), ("  with zero_grad", None)):
            base = per_round[against] if against else scaler_zero
            ratios = [floor / scaler for floor, scaler in zip(per_round[name], base)]
            print(f"  {label:18s} {statistics.median(ratios):7.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
    if parts:
        print("the masters' inner methods, ms per step (mean over every step of every round; x2: two calls a step)")
        for label, values in parts.items():
            print(f"  {label:26s} {1000 * sum(values) / (args.rounds * args.steps):7.3f}")


if __name__ == "__main__":
    main()
