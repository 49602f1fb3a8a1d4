"""Where the bf16 default's own work goes inside a Trainer step: the 16-bit remainders' store, method by method.

    python benchmarks/store_parts.py                       # the benchmark transformer, 20 steps, MPTPrecision("bf16")
    python benchmarks/store_parts.py --steps 40 --threads 1
    python benchmarks/store_parts.py --size tiny --steps 4 --warmup 2   # its logic (tests/test_examples.py)

The default keeps each master as its bf16 weight plus a 16-bit remainder and steps the model a chunk at a time
(``RemainderStore``): each chunk is checked for edits at the decision and again when it is woken, its fp32 masters are
rebuilt (``join``), stepped, split back (``_split_into``, whose tie search is ``_ties``) and fingerprinted. This wraps
those functions, runs one training of the ``transformer`` workload (:mod:`benchmarks.common`) and prints, per timed
step (after ``--warmup`` steps): wall milliseconds spent in each (nested ones included in their callers), calls, and
the minor page faults taken inside them. Nested calls are counted in both (``sleep`` includes ``_split_into`` and
``_prints``).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import get_workload, time_steps  # noqa: E402
from step_time import quiet_lightning  # noqa: E402

from lightning_mpt import MPTPrecision  # noqa: E402
from lightning_mpt.core.masters import _remainder_store as store_module  # noqa: E402

FUNCTIONS = ("_split_into", "_ties", "join")
METHODS = ("check_chunk", "wake", "sleep", "_prints", "free")


class Window(L.Callback):
    """Counts only from batch ``warmup`` on."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.open = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        self.open = i >= self.warmup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--size", default="small", help="the transformer's size (common.py): tiny, small, gpt2")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_lightning()
    window = Window(args.warmup)
    spent: dict[str, list[float]] = {}  # name -> [seconds, calls, faults]

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            if not window.open:
                return f(*a, **k)
            faults, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            out = f(*a, **k)
            entry = spent.setdefault(name, [0.0, 0, 0])
            entry[0] += time.perf_counter() - t
            entry[1] += 1
            entry[2] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            return out

        return wrapper

    for name in FUNCTIONS:
        setattr(store_module, name, timed(name, getattr(store_module, name)))
    for name in METHODS:
        cls = store_module.RemainderStore
        setattr(cls, name, timed(f"RemainderStore.{name}", getattr(cls, name)))
    timer = time_steps(
        get_workload("transformer", args.size),
        args.steps,
        plugin=MPTPrecision("bf16"),
        callbacks=[window],
        accelerator="cpu",
        warmup=args.warmup,
    )
    n = args.steps - args.warmup
    print(
        f"transformer ({args.size}), MPTPrecision('bf16'), {torch.get_num_threads()} threads: "
        f"step {timer.median * 1e3:.1f} ms (median of {n} steps)"
    )
    print(f"| {'function':<28} | ms/step | calls/step | minor faults/step |")
    print(f"|{'-' * 30}|--:|--:|--:|")
    for name, (seconds, calls, faults) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
        print(f"| {name:<28} | {seconds / n * 1e3:.2f} | {calls / n:.1f} | {faults / n:.1f} |")


if __name__ == "__main__":
    main()
