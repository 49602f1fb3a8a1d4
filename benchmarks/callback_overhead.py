"""What the diagnostic callbacks cost: step time, host syncs and event-file bytes (issue 5).

On the transformer classifier of ``benchmarks/common.py`` (the ``classifier`` workload: 4 layers, d_model 256, dropout
0.1, the model docs/diagnostics.md was measured with) under ``MPTPrecision("bf16")``, all in one process:

1. **Default cadence vs none, in one run**: the three monitors at their default cadence (``LossScaleMonitor()``,
   ``GradientHistogramMonitor()``, ``UnderflowMonitor()``) are switched on and off in alternating blocks of 7
   optimizer steps (their batch hooks run or not, as a whole batch at a time), and the step times of the "on" and
   "off" blocks are compared. Neighbouring blocks share the machine's load, which on a shared machine drifts far
   more between separate runs than the overhead itself. 520 steps span a whole period of the cadence (fractions
   every 50, histograms every 100, the fp32 reference every 500); with blocks of 7, the logging steps fall into
   "on" blocks about half the time, as the steps do. The script also reports the **amortized** overhead: the
   measured cost of each kind of logging step (from part 2) divided by how often it happens by default.
2. **Logging at every step** (all three monitors, fp32 reference included): step-time ratio, time per hook, and
   host syncs per step (calls to ``Tensor.item``/``tolist``/``__bool__``/``__float__``/``__int__`` counted through
   wrappers), against the same count without callbacks: all parameters' statistics cost one sync per step.
3. **Event-file bytes per 1000 steps** at the default cadence, from 1000 steps of a narrow copy of the transformer
   (same layers and parameter names, d_model 16, so it runs in seconds; the bytes depend on the parameter count,
   not on their size).

Run: ``python benchmarks/callback_overhead.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

sys.path.insert(0, os.path.dirname(__file__))
from common import TransformerClassifier, time_steps, transformer_data

from lightning_mpt import MPTPrecision
from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor

HOOKS = ("on_train_batch_start", "on_after_backward", "on_before_optimizer_step", "on_train_batch_end")
SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__")


# ------------------------------------------------------------------------------------------------- instruments
class SyncCounter:
    """Count the calls that read a tensor on the host (on a GPU each waits for the device) while active."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> SyncCounter:
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(t: torch.Tensor, *args: Any, _original: Callable = original, **kwargs: Any) -> Any:
                self.count += 1
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


class _Clock:
    """Wall and process CPU time of each training batch after ``warmup`` batches. The CPU time of this process is
    the steadier measure on a shared machine: other processes' load stretches wall time, not our CPU seconds."""

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._t0 = (0.0, 0.0)

    def callbacks(self) -> tuple[L.Callback, L.Callback]:
        clock = self

        class Start(L.Callback):  # first in the list: before every other callback's batch hooks
            def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
                clock._t0 = (time.perf_counter(), time.process_time())

        class End(L.Callback):  # last in the list: after every other callback's batch-end work
            def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
                if trainer.global_step > clock.warmup:
                    clock.wall.append(time.perf_counter() - clock._t0[0])
                    clock.cpu.append(time.process_time() - clock._t0[1])

        return Start(), End()


def time_hooks(callback: L.Callback, totals: dict[str, list[float]], prefix: str, warmup: int = 5) -> L.Callback:
    """Wrap the callback's hooks (and the UnderflowMonitor's reference) to record their CPU time per call in
    ``totals``, after ``warmup`` steps (the first steps pay one-time costs: event-file creation, lookup tables)."""
    names = list(HOOKS) + (["_reference"] if isinstance(callback, UnderflowMonitor) else [])
    for name in names:
        method = getattr(callback, name)

        def timed(*args: Any, _method: Callable = method, _key: str = f"{prefix}.{name}", **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return _method(*args, **kwargs)
            finally:
                if args and isinstance(args[0], L.Trainer) and args[0].global_step > warmup:
                    totals[_key].append(time.process_time() - t0)

        setattr(callback, name, timed)
    return callback


def default_monitors() -> list[L.Callback]:
    return [LossScaleMonitor(), GradientHistogramMonitor(), UnderflowMonitor()]


def every_step_monitors() -> list[L.Callback]:
    return [
        LossScaleMonitor(every_n_steps=1),
        GradientHistogramMonitor(every_n_steps=1),
        UnderflowMonitor(every_n_steps=1, reference_every_n_steps=1),
    ]


def run(steps: int, callbacks: list[L.Callback], logdir: str) -> _Clock:
    clock = _Clock()
    start, end = clock.callbacks()
    logger = TensorBoardLogger(logdir, name="", version=0)
    time_steps(
        "classifier",
        steps,
        plugin=MPTPrecision("bf16"),
        callbacks=[start, *callbacks, end],
        accelerator="cpu",
        logger=logger,
    )
    return clock


def dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("events.out.tfevents.*"))


# ------------------------------------------------------------------------------------------------------- parts
class _Gate:
    """Runs the wrapped callbacks' batch hooks only in every other block of ``block`` optimizer steps."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.on = False

    def decide(self, trainer: L.Trainer) -> None:
        self.on = (trainer.global_step // self.block) % 2 == 1

    def wrap(self, callback: L.Callback) -> L.Callback:
        for name in HOOKS:
            method = getattr(callback, name)

            def gated(*args: Any, _method: Callable = method, **kwargs: Any) -> Any:
                return _method(*args, **kwargs) if self.on else None

            setattr(callback, name, gated)
        return callback


def default_on_off(
    steps: int, block: int, tmp: str, monitors: bool = True
) -> tuple[list[tuple[bool, float, float, int]], int]:
    """``(on, wall, cpu, step)`` per step after warm-up of one run whose monitors are gated by blocks; the block.
    Without ``monitors`` the blocks switch nothing: the spread of that run is the measurement's noise."""
    gate = _Gate(block)
    records: list[tuple[bool, float, float, int]] = []
    t0 = [0.0, 0.0]

    class Start(L.Callback):  # first: decides the block, starts the clocks
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            gate.decide(trainer)
            t0[:] = [time.perf_counter(), time.process_time()]

    class End(L.Callback):  # last: after every monitor's batch-end work
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step > 5:
                step = trainer.global_step - 1  # the step this batch took
                records.append((gate.on, time.perf_counter() - t0[0], time.process_time() - t0[1], step))

    gated = [gate.wrap(m) for m in default_monitors()] if monitors else []
    logger = TensorBoardLogger(f"{tmp}/gated{int(monitors)}", name="", version=0)
    time_steps(
        "classifier",
        steps,
        plugin=MPTPrecision("bf16"),
        callbacks=[Start(), *gated, End()],
        accelerator="cpu",
        logger=logger,
    )
    return records, block


def every_step(steps: int, tmp: str) -> dict[str, Any]:
    totals: dict[str, list[float]] = defaultdict(list)
    monitors = [time_hooks(m, totals, type(m).__name__) for m in every_step_monitors()]
    with SyncCounter() as base_syncs:
        base = run(steps, [], f"{tmp}/every_base")
    with SyncCounter() as syncs:
        times = run(steps, monitors, f"{tmp}/every")
    return {"base": base, "times": times, "totals": dict(totals), "base_syncs": base_syncs.count, "syncs": syncs.count}


def event_bytes(steps: int, tmp: str) -> int:
    """Bytes of event files written over ``steps`` steps at the default cadence (narrow transformer, bf16)."""
    L.seed_everything(0, verbose=False)
    logdir = f"{tmp}/bytes"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        plugins=[MPTPrecision("bf16")],
        callbacks=default_monitors(),
        logger=TensorBoardLogger(logdir, name="", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TransformerClassifier(vocab=1000, d_model=16, layers=4, heads=4)
    trainer.fit(model, transformer_data(steps * 4, seq=8, batch_size=4))
    without = f"{tmp}/bytes_none"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        plugins=[MPTPrecision("bf16")],
        logger=TensorBoardLogger(without, name="", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        TransformerClassifier(vocab=1000, d_model=16, layers=4, heads=4), transformer_data(4, seq=8, batch_size=4)
    )
    return dir_bytes(logdir) - dir_bytes(without)  # what the callbacks added


# -------------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=520,
        help="optimizer steps of the on/off run (5 warm-up excluded); 520 span a reference period",
    )
    parser.add_argument("--block", type=int, default=7, help="steps per on/off block")
    parser.add_argument("--every-steps", type=int, default=16, help="steps of the logging-at-every-step runs")
    parser.add_argument("--bytes-steps", type=int, default=1000, help="steps of the event-bytes run")
    parser.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="skip the control run (same blocks, nothing switched: the noise of the measurement)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.every_steps, args.bytes_steps = 40, 8, 100
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        gated, block = default_on_off(args.steps, args.block, tmp)
        control = default_on_off(args.steps, args.block, tmp, monitors=False)[0] if args.control else []
        every = every_step(args.every_steps, tmp)
        nbytes = event_bytes(args.bytes_steps, tmp)

    med, mean = statistics.median, statistics.fmean

    def ratios(a: _Clock, b: _Clock) -> str:
        return (
            f"CPU time: median {med(b.cpu) / med(a.cpu):.3f}, mean {mean(b.cpu) / mean(a.cpu):.3f};"
            f" wall time: median {med(b.wall) / med(a.wall):.3f}, mean {mean(b.wall) / mean(a.wall):.3f}"
        )

    print(f"\n== bf16 transformer (MPTPrecision('bf16'), CPU, {torch.get_num_threads()} threads) ==")
    off = [r for r in gated if not r[0]]
    on = [r for r in gated if r[0]]
    print(
        f"step without callbacks: CPU time median {med([r[2] for r in off]) * 1e3:.0f} ms, wall time median"
        f" {med([r[1] for r in off]) * 1e3:.0f} ms"
    )

    def on_off(records: list[tuple[bool, float, float, int]]) -> str:
        # pair each "on" block with the "off" block before it: both saw about the same machine load
        pairs: dict[int, dict[bool, list[float]]] = defaultdict(lambda: {True: [], False: []})
        for r in records:
            pairs[r[3] // (2 * block)][r[0]].append(r[2])
        pair_ratios = [mean(p[True]) / mean(p[False]) for p in pairs.values() if p[True] and p[False]]
        on_cpu = [r[2] for r in records if r[0]]
        off_cpu = [r[2] for r in records if not r[0]]
        on_wall = [r[1] for r in records if r[0]]
        off_wall = [r[1] for r in records if not r[0]]
        return (
            f"CPU time: ratio of means {mean(on_cpu) / mean(off_cpu):.3f} (logging steps included), median"
            f" over {len(pair_ratios)} block pairs {med(pair_ratios):.3f}; wall time: ratio of means"
            f" {mean(on_wall) / mean(off_wall):.3f}"
        )

    print(
        f"1. three callbacks at default cadence, on vs off in alternating blocks of {block} steps of one run"
        f" ({len(on)} steps on, {len(off)} off):"
    )
    print(f"   {on_off(gated)}")
    logging = {r[3]: r[2] for r in on if r[3] % 50 == 0}
    off_median = med([r[2] for r in off])
    print(
        "   CPU ms of the logging steps that fell in 'on' blocks: "
        + ", ".join(f"step {k}: {v * 1e3:.0f}" for k, v in sorted(logging.items()))
        + f" (vs median {off_median * 1e3:.0f} off)"
    )
    # robust to load spikes: the steady-state ratio of the block pairs plus what the logging steps added
    pairs: dict[int, dict[bool, list[float]]] = defaultdict(lambda: {True: [], False: []})
    for r in gated:
        pairs[r[3] // (2 * block)][r[0]].append(r[2])
    steady = med([mean(p[True]) / mean(p[False]) for p in pairs.values() if p[True] and p[False]])
    excess = sum(max(0.0, t - off_median) for t in logging.values()) / (len(on) * off_median)
    print(
        f"   estimate robust to load spikes: {steady:.3f} (median block pair) + {excess:.3f} (logging steps' excess"
        f" over the 'on' steps; the fp32 reference falls in twice as often as at the default cadence)"
        f" = {steady + excess:.3f}"
    )
    if control:
        print(f"   control run, same blocks switching nothing (the noise of this measurement): {on_off(control)}")

    n = args.every_steps
    totals = every["totals"]
    per_step = {k: mean(v) for k, v in totals.items()}  # every step logs: the cost of one logging step
    print("2. logging at every step (fp32 reference included):")
    print(f"   {ratios(every['base'], every['times'])}")
    extra_syncs = (every["syncs"] - every["base_syncs"]) / n
    print(
        f"   host reads per step (Tensor.item/tolist/__bool__/__float__/__int__ calls): {every['base_syncs'] / n:.2f}"
        f" without callbacks (Lightning, torch and the plugin), {every['syncs'] / n:.2f} with them:"
        f" +{extra_syncs:.2f} per step for all statistics of all parameters"
    )
    print("   CPU time per step in the hooks (ms):")
    for key in sorted(per_step):
        print(f"     {key:<55s} {per_step[key] * 1e3:8.2f}")

    # amortized: each activity's cost per logging step over its period at the default cadence
    step_time = mean([r[2] for r in off])
    ref = per_step.get("UnderflowMonitor._reference", 0.0)
    periods = {"LossScaleMonitor": 1, "GradientHistogramMonitor": 100, "UnderflowMonitor": 50}
    amortized = ref / 500
    for key, cost in per_step.items():
        owner, hook = key.split(".", 1)
        if hook == "_reference":
            continue
        if owner == "UnderflowMonitor" and hook == "on_before_optimizer_step":
            cost -= ref  # the reference runs inside this hook
        amortized += cost / periods[owner]
    print(
        "   amortized at the default cadence (scale every step, histograms every 100, fractions every 50,"
        " reference every 500):"
    )
    print(f"     +{amortized * 1e3:.2f} ms per step = ratio {1 + amortized / step_time:.4f}")
    print(
        f"3. event-file bytes per 1000 steps at the default cadence: {nbytes * 1000 / args.bytes_steps / 1e3:.0f} kB"
        f" (measured over {args.bytes_steps} steps)"
    )


if __name__ == "__main__":
    main()
