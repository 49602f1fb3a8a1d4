"""The benchmark tables (``make bench``): speed ratios over interleaved rounds with their spread, the plugin's
overhead next to its bandwidth floor, the targets of issue 12, bytes per parameter and saved activations, and a
profile of each precision's step.

    python benchmarks/run_all.py                         # CPU: about 3-4 minutes on 2 quiet cores
    python benchmarks/run_all.py --threads 1             # steadier on a CPU that other jobs share
    python benchmarks/run_all.py --update                # and paste the tables into the README and docs/benchmarks.md
    python benchmarks/run_all.py --accelerator gpu       # GPT-2 small (124M) on a CUDA GPU (make gpu-check)
    python benchmarks/run_all.py --size tiny --rounds 2 --steps 6 --warmup 3 --precisions all   # dry run, < 1 minute

Speed: ``step_time.py``'s rounds (see its docstring for the method, the byte model and the targets). Memory: in
the first round, ``MemoryProbe`` (from ``examples/memory_breakdown.py``) looks at the last warm-up step of every
run: the bytes of weights, fp32 masters, gradients (model and master) and optimizer state per parameter, and the
bytes autograd saves for the backward. On CUDA the peak allocated memory of the timed steps
(``torch.cuda.max_memory_allocated``) is reported per precision. Profile: one more run per precision under
``torch.profiler`` (``--no-profile`` skips it).

On CPU, ``"16-mixed"`` is built as ``MixedPrecision("16-mixed", "cpu")`` (real fp16 autocast with a GradScaler):
``Trainer(precision="16-mixed")`` would switch to bf16 there. CPUs have no fast fp16 matmul, so on CPU the
transformer runs "32-true" and the bf16 precisions only (``--precisions all`` runs every one).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import step_time  # noqa: E402

MiB = 2**20
MARKERS = ("<!-- bench:start -->", "<!-- bench:end -->")  # where --update pastes the tables (both pages)
PROFILE_MARKERS = ("<!-- profile:start -->", "<!-- profile:end -->")  # the profile (benchmarks/README.md)
TARGETS = (ROOT / "benchmarks" / "README.md", ROOT / "docs" / "benchmarks.md")


def memory_table(summary: step_time.Summary) -> str:
    """Markdown: one row per model and precision, bytes per parameter from the first round's probe."""
    peak = summary.accelerator == "gpu"
    rows = [
        "| model | precision | weights | fp32 masters | grads | master grads | optimizer state | total B/param "
        "| activations MiB/step | weight copies MiB/step |" + (" peak allocated MiB |" if peak else ""),
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|" if peak else ""),
    ]
    for workload, by_precision in summary.runs.items():
        for precision, runs in by_precision.items():
            r = runs[0].memory
            if not r:
                continue
            n = r["params"]
            per_param = [r[k] / n for k in ("weights", "masters", "grads", "master_grads", "optimizer_state")]
            row = (
                f"| {workload} | {precision} | "
                + " | ".join(f"{v:.2f}" for v in per_param)
                + f" | {sum(per_param):.2f} | {r['activations'] / MiB:.2f} | {r['weight_copies'] / MiB:.2f} |"
            )
            if peak:
                row += f" {max(x.peak_bytes or 0 for x in runs) / MiB:.0f} |"
            rows.append(row)
    return "\n".join(rows)


def paste(path: Path, text: str, markers: tuple[str, str] = MARKERS) -> None:
    """Replace what lies between the two ``markers`` in ``path`` with ``text``."""
    start, end = (re.escape(m) for m in markers)
    old = path.read_text(encoding="utf-8")
    new, count = re.subn(f"{start}.*?{end}", lambda _: f"{markers[0]}\n{text}\n{markers[1]}", old, flags=re.S)
    if count != 1:
        raise ValueError(f"{path}: expected one {markers[0]} ... {markers[1]} section, found {count}")
    path.write_text(new, encoding="utf-8")


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Measure, print the tables, optionally paste them; return everything measured."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    step_time.add_arguments(p)
    p.add_argument("--no-profile", action="store_true", help="skip the profile runs")
    p.add_argument("--out", type=Path, help="also write the markdown here")
    p.add_argument(
        "--update",
        action="store_true",
        help=f"paste the tables into {', '.join(str(t.relative_to(ROOT)) for t in TARGETS)}",
    )
    args = p.parse_args(argv)
    step_time.quiet_lightning()
    cfg = step_time.configure(args)
    command = ("python benchmarks/run_all.py " + shlex.join(argv if argv is not None else sys.argv[1:])).strip()
    summary = step_time.measure(args, cfg, command, probe_memory=True)
    memory = "Memory at the optimizer step, bytes per parameter (first round, last warm-up step):"
    text = f"{summary.markdown()}\n\n{memory}\n\n{memory_table(summary)}"
    print(text)
    if summary.floors:
        print("\nByte model (bytes the plugin's own work moves per optimizer step):\n" + summary.byte_model_text())
    profile = ""
    if not args.no_profile and not cfg.time_left():
        print("\n(profile skipped: --max-minutes spent)")
    elif not args.no_profile:
        profile = step_time.run_profiles(
            cfg.workloads,
            cfg.precisions,
            cfg.accelerator,
            cfg.warmup,
            args.profile_steps,
            args.top,
            log=step_time.progress(args),
        )
        profile = f"Command: `{command}` (profile part).\n\n{profile}"
        print("\n" + profile)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + ("\n\n" + profile if profile else "") + "\n", encoding="utf-8")
    if args.update:
        for target in TARGETS:
            paste(target, text)
        if profile:
            paste(TARGETS[0], profile, PROFILE_MARKERS)
    results = {
        w: {
            name: {"seconds_per_step": summary.step_times(w, name).median, **(runs[0].memory or {})}
            for name, runs in by.items()
        }
        for w, by in summary.runs.items()
    }
    out = {**summary.to_json(), "results": results, "markdown": text, "profile": profile, "summary": summary}
    if args.json:
        args.json.write_text(json.dumps({k: v for k, v in out.items() if k != "summary"}, indent=2))
    return out


if __name__ == "__main__":
    main()
