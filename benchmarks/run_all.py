"""The benchmark table: step time, bytes per parameter and saved-activation bytes per step, for every precision on
every benchmark model, on this machine.

    python benchmarks/run_all.py                       # CPU: about 5 minutes on 2 cores (fp16 matmuls are slow there)
    python benchmarks/run_all.py --accelerator gpu --steps 30
    python benchmarks/run_all.py --update              # also paste the table into benchmarks/README.md and docs/benchmarks.md

For each model of ``benchmarks/common.py`` (``WORKLOADS``) and each precision (Lightning's ``"32-true"``,
``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``, ``"bf16-true"`` and ``MPTPrecision("fp16"/"bf16")``), one run of
``--steps`` optimizer steps: ``common.time_steps`` gives the median time of the steps after its 5 warm-up steps,
and ``MemoryProbe`` (from ``examples/memory_breakdown.py``) measures step 2: the bytes of weights, fp32 masters,
gradients (model and master) and optimizer state per parameter, and the bytes autograd saves for the backward.

On CPU, ``"16-mixed"`` is built as ``MixedPrecision("16-mixed", "cpu")`` (real fp16 autocast with a GradScaler):
``Trainer(precision="16-mixed")`` would switch to bf16 there. CPUs have no fast fp16 matmul, so the fp16 rows of the
compute-bound model are slow on CPU and say nothing about a GPU; ``benchmarks/step_time.py`` measures speed ratios
with repeated, interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Optional

import lightning
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
from common import WORKLOADS, time_steps  # noqa: E402
from example_utils import PRECISIONS, precision_setup  # noqa: E402
from memory_breakdown import MemoryProbe  # noqa: E402

MiB = 2**20
MARKERS = ("<!-- bench:start -->", "<!-- bench:end -->")  # where --update pastes the table
TARGETS = (ROOT / "benchmarks" / "README.md", ROOT / "docs" / "benchmarks.md")


def machine(accelerator: str) -> str:
    """CPU model, cores, torch threads, torch and Lightning versions, and the GPU when one is used."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    parts = [f"{cpu}, {os.cpu_count()} cores ({threads} torch thread{'s' if threads > 1 else ''})"]
    if accelerator != "cpu" and torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name()}")
    parts.append(f"torch {torch.__version__}, lightning {lightning.__version__}")
    return ", ".join(parts)


def measure(workload: str, precision: str, steps: int, accelerator: str) -> dict[str, Any]:
    """One run: median seconds per step and the probe's byte counts."""
    setup = precision_setup(precision, accelerator)
    probe = MemoryProbe(at_step=2)
    timer = time_steps(
        workload, steps, precision=setup.get("precision"), plugin=next(iter(setup.get("plugins", [])), None),
        callbacks=[probe], accelerator=accelerator,
    )
    return {"seconds_per_step": timer.median, **probe.result}


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: one row per model and precision."""
    rows = [
        "| model | precision | ms/step | weights | fp32 masters | grads | master grads | optimizer state "
        "| total B/param | activations MiB/step | weight copies MiB/step |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for workload, by_precision in results.items():
        for precision, r in by_precision.items():
            n = r["params"]
            per_param = [r[k] / n for k in ("weights", "masters", "grads", "master_grads", "optimizer_state")]
            rows.append(
                f"| {workload} ({n / 1e6:.2f}M params) | {precision} | {1000 * r['seconds_per_step']:.1f} | "
                + " | ".join(f"{v:.2f}" for v in per_param)
                + f" | {sum(per_param):.2f} | {r['activations'] / MiB:.2f} | {r['weight_copies'] / MiB:.2f} |"
            )
    return "\n".join(rows)


def paste(path: Path, text: str) -> None:
    """Replace what lies between the two markers in ``path`` with ``text``."""
    start, end = (re.escape(m) for m in MARKERS)
    old = path.read_text(encoding="utf-8")
    new, count = re.subn(f"{start}.*?{end}", lambda _: f"{MARKERS[0]}\n{text}\n{MARKERS[1]}", old, flags=re.S)
    if count != 1:
        raise ValueError(f"{path}: expected one {MARKERS[0]} ... {MARKERS[1]} section, found {count}")
    path.write_text(new, encoding="utf-8")


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Measure, print the machine line and the table, optionally paste them; return everything measured."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run; the first 5 are warm-up")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's); 1 steadies CPU timings "
                   "on a machine that other jobs share")
    p.add_argument("--json", type=Path, help="also write the raw numbers here")
    p.add_argument("--update", action="store_true", help=f"paste the table into {', '.join(str(t.relative_to(ROOT)) for t in TARGETS)}")
    args = p.parse_args(argv)
    if args.steps < 6:
        p.error("--steps must be at least 6: time_steps times the steps after 5 warm-up steps")
    if args.threads:
        torch.set_num_threads(args.threads)

    results = {w: {name: measure(w, name, args.steps, args.accelerator) for name in args.precisions} for w in args.workloads}
    text = f"Machine: {machine(args.accelerator)}. {args.steps - 5} timed steps per run.\n\n{table(results)}"
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(args.accelerator), "results": results}, indent=2))
    if args.update:
        for target in TARGETS:
            paste(target, text)
    return {"machine": machine(args.accelerator), "results": results, "markdown": text}


if __name__ == "__main__":
    main()
