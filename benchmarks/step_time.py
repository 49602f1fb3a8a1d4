"""Per-step time of MPTPrecision against Lightning's built-in precisions, measured in one run.

    python benchmarks/step_time.py                      # CPU defaults, a few minutes on 2 cores
    python benchmarks/step_time.py --accelerator gpu --steps 200

Workloads (benchmarks/common.py): (a) ``transformer``, a small transformer encoder, compute-bound, in bf16; (b)
``deep_mlp``, 200 tiny Linear layers, bound by per-op and per-parameter overhead, in fp16. Each precision runs
``--rounds`` times, interleaved, and the median step time over rounds is reported; ratios are MPTPrecision's time
over each baseline's. Targets: MPTPrecision("bf16") <= 1.0x "bf16-mixed" on (a), MPTPrecision("fp16") <= 1.0x
"16-mixed" on (b).

On CPU, ``precision="16-mixed"`` silently means bf16 autocast; the fp16 baseline is built explicitly as
``MixedPrecision("16-mixed", "cpu")`` (fp16 autocast with a ``torch.amp.GradScaler``), which is what "16-mixed" is
on a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

sys.path.insert(0, str(Path(__file__).parent))
from common import time_steps  # noqa: E402

from lightning_mpt import MPTPrecision  # noqa: E402


def baselines(half: str, accelerator: str) -> dict[str, Callable[[], dict[str, Any]]]:
    """For each precision, a factory of fresh Trainer arguments (plugins hold state: one per run)."""
    mixed = "16-mixed" if half == "fp16" else "bf16-mixed"
    true = "16-true" if half == "fp16" else "bf16-true"
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if half == "fp16" and on_cpu:
        mixed_kwargs: Callable[[], dict[str, Any]] = lambda: {"plugin": MixedPrecision("16-mixed", "cpu")}  # noqa: E731
    else:
        mixed_kwargs = lambda: {"precision": mixed}  # noqa: E731
    return {
        "32-true": lambda: {"precision": "32-true"},
        mixed: mixed_kwargs,
        true: lambda: {"precision": true},
        f'MPTPrecision("{half}")': lambda: {"plugin": MPTPrecision(half)},
    }


def measure(workload: str, half: str, steps: int, rounds: int, accelerator: str) -> dict[str, float]:
    configs = baselines(half, accelerator)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, make_kwargs in configs.items():
            times[name].append(time_steps(workload, steps, accelerator=accelerator, **make_kwargs()).median)
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(workload: str, half: str, result: dict[str, float], write: Callable[[str], None]) -> dict[str, float]:
    ours = result[f'MPTPrecision("{half}")']
    write(f"\n{workload} ({half})")
    write(f"  {'precision':<24}{'ms/step':>10}{'MPT / this':>12}")
    ratios = {}
    for name, t in result.items():
        ratios[name] = ours / t
        write(f"  {name:<24}{1000 * t:>10.2f}{ours / t:>12.3f}")
    return ratios


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (the first 5 are warm-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    device = torch.cuda.get_device_name() if args.accelerator in ("gpu", "cuda") else platform.processor() or platform.machine()
    print(f"machine: {device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    out: dict[str, Any] = {"machine": device, "torch": torch.__version__, "results": {}}
    for workload, half in (("transformer", "bf16"), ("deep_mlp", "fp16")):
        result = measure(workload, half, args.steps, args.rounds, args.accelerator)
        out["results"][workload] = {"half": half, "seconds_per_step": result, "mpt_ratio": report(workload, half, result, print)}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
