"""The GPU check in one command, for a CUDA machine with no network and no install step.

    PYTHONPATH=. python3 scripts/gpu_check.py --out build/gpu-check                  # every part, under 8 minutes
    PYTHONPATH=. python3 scripts/gpu_check.py --out $OUT --wheels .whl               # torchao from wheels (fp8)
    python3 scripts/gpu_check.py --out build/gpu-check --dry-run                    # the same logic on a CPU, tiny
    python3 scripts/gpu_check.py --out build/gpu-check --parts gpt2 --max-minutes 4  # one part again

It needs only the standard library and what the GPU machine has (torch, lightning, torchmetrics, tensorboard,
pytest): the checkout is put on ``PYTHONPATH`` of every part (no ``pip install -e``), and ``--wheels DIR`` installs
the wheels in DIR (torchao, for fp8) into a temporary folder (``pip install --no-index --no-deps --target``, or
unzipped when the interpreter has no pip) that goes first on the parts' ``PYTHONPATH``.

The parts, in this order, each a subprocess with its own time limit (a share of ``--max-minutes``; the last one
takes what the others left, and its rounds stop early to fit):

* ``tests``: the CUDA tests, ``pytest -q -m cuda tests/test_cuda.py tests/test_cuda_fp8.py`` (fp8's are skipped
  without torchao);
* ``host``: the plugin's host time per step, ``benchmarks/engine_overhead.py --device cuda --rounds 5 --parts``;
* ``fp8``: ``benchmarks/gpu_fp8.py`` (GPT-2 small under "bf16-mixed", ``MPTPrecision("bf16")`` and fp8), when
  ``torchao.float8`` imports (else skipped, which is not a failure);
* ``gpt2``: GPT-2 small's step time, bytes per parameter at the step and peak memory under every name of
  :data:`PRECISIONS`, ``benchmarks/run_all.py --accelerator gpu --workloads transformer`` (5 interleaved rounds or
  as many as fit, ``--max-minutes``).

A part that fails (non-zero exit, a timeout, a command that cannot start) is recorded with its exit code and the
next part runs; the script exits 1 when any part failed, 3 when there is no CUDA GPU (without ``--dry-run``).
Everything goes into ``--out``: ``gpu-check.md`` (the machine, a status table, each part's tables; rewritten after
every part, so a run cut short keeps what it measured), one ``PART.log`` per part (its command, stdout and stderr),
``gpt2.json`` (the raw numbers) and ``wheels.log`` with ``--wheels``: at most 7 files.

``--dry-run`` runs the same parts on the CPU (``CUDA_VISIBLE_DEVICES`` emptied) with tiny sizes and one round: the
CUDA tests are collected and skipped, the benchmarks run their CPU path on the tiny models. It checks the logic and
the command lines, not the numbers (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

# The precisions of the GPT-2 part, by the names of benchmarks/step_time.py (its ALL_PRECISIONS): Lightning's two
# mixed precisions and every MPTPrecision mode, the defaults and the opt-in ones. The one place to add, drop or rename
# one for the GPU check; tests/test_gpu_check.py fails while an "mpt-" name of step_time.py is missing here.
PRECISIONS = (
    "bf16-mixed",
    "16-mixed",
    "mpt-bf16",
    "mpt-fp16",
    "mpt-bf16-chunked",
    "mpt-bf16-copies",
    "mpt-fp16-chunked",
    "mpt-bf16-nomaster",
)

RESERVE_S = 15.0  # of the budget, kept after the last part: its kill (at most 10 s past its limit), the summary
TAIL_S = 40.0  # of the gpt2 part's limit, not given to its rounds: imports, the round that overruns, the tables
PART_NAMES = ("tests", "host", "fp8", "gpt2")  # the order they run in


@dataclass
class Part:
    """One part of the check: a command with a time limit."""

    name: str
    title: str
    share: Optional[float]  # of --max-minutes; None: what is left (the last part)
    targets: list[str]  # the script or test files it runs (``--script`` replaces them)
    argv: Callable[[list[str], float], list[str]]  # (targets, limit in seconds) -> the command
    markdown: bool  # its stdout is markdown (a benchmark's tables) rather than text
    headline: str = ""  # a regex: the stdout line that sums it up in the status table
    skip: Optional[str] = None  # why it does not run (not a failure)


@dataclass
class Result:
    part: str
    status: str  # passed, failed, timeout, skipped, not run
    code: Optional[int]
    seconds: float
    limit: Optional[float]  # seconds; None: no limit of its own (the wheels) or not run
    command: list[str] = field(default_factory=list)
    stdout: str = ""
    note: str = ""


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the folder for gpu-check.md and the logs (created)")
    p.add_argument("--wheels", type=Path, help="a folder of wheels (torchao) to install into a temporary --target")
    p.add_argument("--max-minutes", type=float, default=8.0, help="the whole check's time budget (default 8)")
    p.add_argument(
        "--dry-run", action="store_true", help="the same parts on the CPU, tiny sizes and one round (the logic only)"
    )
    p.add_argument("--parts", nargs="+", choices=PART_NAMES, default=list(PART_NAMES), help="run only these parts")
    p.add_argument(
        "--precisions", nargs="+", default=list(PRECISIONS), help="the gpt2 part's precisions (default: PRECISIONS)"
    )
    p.add_argument(
        "--script",
        action="append",
        default=[],
        metavar="PART=PATH",
        help="run PATH instead of the part's script (tests: test file); for testing the check itself",
    )
    p.add_argument("--label", default="", help="a note for the summary's header, e.g. the commit checked")
    args = p.parse_args(argv)
    if args.max_minutes <= 0:
        p.error("--max-minutes must be positive")
    for item in args.script:
        name, sep, path = item.partition("=")
        if not sep or name not in PART_NAMES or not path:
            p.error(f"--script {item!r}: expected PART=PATH with PART one of {', '.join(PART_NAMES)}")
    return args


def make_parts(args: argparse.Namespace, py: str, out: Path, scratch: Path) -> list[Part]:
    """The parts' commands: the real ones, or with ``--dry-run`` their CPU path on tiny sizes."""
    dry = args.dry_run

    def tests(targets: list[str], limit: float) -> list[str]:
        return [py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *targets]

    def host(targets: list[str], limit: float) -> list[str]:
        sizes = ["--device", "cpu", "--rounds", "1", "--steps", "4", "--warmup", "2", "--depth", "8"] if dry else []
        return [py, *targets, *(sizes or ["--device", "cuda", "--rounds", "5"]), "--parts"]

    def fp8(targets: list[str], limit: float) -> list[str]:
        sizes = ["--steps", "3", "--warmup", "1", "--batch", "1", "--seq", "64"] if dry else []
        return [py, *targets, *sizes, "--out", str(scratch / "gpu-fp8.md")]

    def gpt2(targets: list[str], limit: float) -> list[str]:
        rounds_minutes = max(limit - TAIL_S, 30.0) / 60
        where = (
            ["--accelerator", "cpu", "--size", "tiny", "--rounds", "1", "--steps", "3", "--warmup", "2"]
            if dry
            else ["--accelerator", "gpu", "--size", "gpt2"]
        )
        return [
            py,
            *targets,
            *where,
            "--workloads",
            "transformer",
            "--precisions",
            *args.precisions,
            "--no-profile",
            "--no-floor",
            "--max-minutes",
            f"{rounds_minutes:.2f}",
            "--json",
            str(out / "gpt2.json"),
        ]

    parts = [
        Part(
            "tests",
            "the CUDA tests",
            0.30,
            ["tests/test_cuda.py", "tests/test_cuda_fp8.py"],
            tests,
            markdown=False,
            headline=r"^(=+ )?\d+ (passed|failed|skipped|error|deselected).*",
        ),
        Part(
            "host",
            "the plugin's host time per step (deep_mlp, engine alone, against GradScaler)",
            0.10,
            ["benchmarks/engine_overhead.py"],
            host,
            markdown=False,
            headline=r"total / GradScaler.*",
        ),
        Part(
            "fp8",
            'GPT-2 small under "bf16-mixed", MPTPrecision("bf16") and fp8 (torchao)',
            0.17,
            ["benchmarks/gpu_fp8.py"],
            fp8,
            markdown=True,
            headline=r'^\| MPTPrecision\("bf16", fp8=.*|.*no CUDA GPU.*',
        ),
        Part(
            "gpt2",
            "GPT-2 small: step time, bytes per parameter and peak memory per precision",
            None,
            ["benchmarks/run_all.py"],
            gpt2,
            markdown=True,
            headline=r"^\| mpt-bf16 / bf16-mixed \|.*",
        ),
    ]
    for item in args.script:
        name, _, path = item.partition("=")
        next(p for p in parts if p.name == name).targets = [path]
    return [p for p in parts if p.name in args.parts]


# ================================================================================================ running
def run_command(command: list[str], limit: float, env: dict[str, str], log: Path) -> tuple[Optional[int], str, str]:
    """Run ``command`` from the repository root, killed (its whole process group) after ``limit`` seconds.

    Returns ``(exit code or None on a timeout, stdout, note)``; writes the command, stdout and stderr to ``log``, also
    when this script is stopped while the command runs."""
    code: Optional[int] = None
    note = "stopped with the check"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            try:
                proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
            except OSError as e:
                code, note = 127, f"could not start: {e}"
            else:
                try:
                    code, note = proc.wait(timeout=limit), ""
                except subprocess.TimeoutExpired:
                    note = f"killed after its limit of {limit:.0f} s"
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)
                finally:
                    # what the part left in its process group (workers, a killed run's children) goes too, so that
                    # the next part has the GPU to itself; and the part goes if this script is stopped (SIGTERM)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)
        finally:
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            log.write_text(
                f"$ {shlex.join(command)}\n# exit: {code if code is not None else 'none'} {note}\n\n"
                f"----- stdout -----\n{stdout}\n----- stderr -----\n{stderr}",
                encoding="utf-8",
            )
    return code, stdout, note


PROBE = r"""
import json, platform, sys
from importlib import metadata
info = {"python": platform.python_version(), "executable": sys.executable}
for name in ("lightning", "torchmetrics", "tensorboard", "pytest"):
    try:
        info[name] = metadata.version(name)
    except Exception as e:
        info[name] = "missing"
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda"] = torch.cuda.is_available()
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        gib = props.total_memory / 2**30
        info["gpu"] = f"{props.name}, compute capability {props.major}.{props.minor}, {gib:.1f} GiB"
        info["gpus"] = torch.cuda.device_count()
    info["cuda_version"] = torch.version.cuda
except Exception as e:
    info["torch"] = f"not importable: {type(e).__name__}: {e}"
    info["cuda"] = False
try:
    import torchao.float8
    import torchao
    info["torchao"] = getattr(torchao, "__version__", "?") + " (" + str(torchao.__file__) + ")"
except Exception as e:
    info["torchao_error"] = f"{type(e).__name__}: {e}"
print("PROBE " + json.dumps(info))
"""


def probe(py: str, env: dict[str, str]) -> dict[str, object]:
    """The machine as the parts will see it: versions, the GPU, whether ``torchao.float8`` imports."""
    try:
        done = subprocess.run(
            [py, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": "the probe timed out (120 s)", "cuda": False, "torchao_error": "not probed"}
    line = next((x for x in done.stdout.splitlines() if x.startswith("PROBE ")), None)
    if line is None:
        tail = (done.stdout + done.stderr).strip()[-500:]
        return {"error": f"the probe failed (exit {done.returncode}): {tail}", "cuda": False, "torchao_error": tail}
    info: dict[str, object] = json.loads(line[len("PROBE ") :])
    return info


def install_wheels(folder: Path, target: Path, py: str, log: Path) -> tuple[int, str]:
    """Install every wheel in ``folder`` into ``target`` without the network: pip's ``--no-index --no-deps --target``,
    or, if this interpreter has no pip, unzip them (a wheel is a zip of its site-packages files). ``(code, note)``."""
    if not folder.is_dir():
        note = f"--wheels {folder}: no such folder (a git-ignored folder must be carried to the machine)"
        log.write_text(note + "\n", encoding="utf-8")
        return 2, note
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        note = f"--wheels {folder}: no .whl file in it"
        log.write_text(note + "\n", encoding="utf-8")
        return 2, note
    command = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(target)]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    done = subprocess.run([*command, *map(str, wheels)], capture_output=True, text=True, env=env, check=False)
    text = f"$ {shlex.join([*command, *map(str, wheels)])}\n# exit {done.returncode}\n{done.stdout}{done.stderr}"
    code, how = done.returncode, "pip"
    if code != 0 and "No module named pip" in done.stderr:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(target)
        for data in target.glob("*.data"):  # a wheel's purelib/platlib files belong in site-packages
            for lib in ("purelib", "platlib"):
                if (data / lib).is_dir():
                    shutil.copytree(data / lib, target, dirs_exist_ok=True)
        code, how = 0, "unzipped (no pip)"
        text += f"\nno pip: unzipped {len(wheels)} wheel(s) into {target}\n"
    log.write_text(text, encoding="utf-8")
    names = ", ".join(w.name for w in wheels)
    return code, f"{how}: {names}" if code == 0 else f"pip exit {code}: {done.stderr.strip()[-300:]}"


def headline(part: Optional[Part], result: Result) -> str:
    """The line that sums up a part: its note when it did not pass, else the stdout line its regex picks."""
    if part is None or (result.note and result.status != "passed"):
        return result.note
    if part.headline:
        for line in reversed(result.stdout.splitlines()):
            if re.search(part.headline, line.strip()):
                line = line.strip().strip("=").strip()
                if line.startswith("|"):  # a table row: "first cell: the others"
                    cells = [c.strip() for c in line.strip("|").split("|")]
                    return f"{cells[0]}: {', '.join(cells[1:])}"
                return " ".join(line.split())
    last = [x.strip() for x in result.stdout.splitlines() if x.strip()]
    return last[-1] if last else ""


# ================================================================================================ the summary
def machine_text(info: dict[str, object], wheels_note: str) -> str:
    if "error" in info:
        return f"Machine: {info['error']}"
    gpu = info.get("gpu") or "no CUDA GPU"
    if info.get("gpus", 1) not in (0, 1):
        gpu = f"{gpu} (x{info['gpus']})"
    lines = [
        f"Machine: {gpu}; python {info.get('python')}, torch {info.get('torch')} (CUDA {info.get('cuda_version')}), "
        f"lightning {info.get('lightning')}, torchmetrics {info.get('torchmetrics')}, "
        f"tensorboard {info.get('tensorboard')}, pytest {info.get('pytest')}.",
        f"torchao: {info.get('torchao') or 'not importable (' + str(info.get('torchao_error')) + ')'}"
        + (f"; wheels {wheels_note}" if wheels_note else "")
        + ".",
    ]
    return "\n".join(lines)


def fence(text: str, limit: int = 80) -> str:
    lines = text.rstrip().splitlines()
    if len(lines) > limit:
        lines = [f"... ({len(lines) - limit} lines above: see the log)", *lines[-limit:]]
    body = "\n".join(lines).replace("```", "'''")
    return f"```text\n{body}\n```"


def write_summary(
    out: Path,
    header: list[str],
    parts: list[Part],
    results: list[Result],
    started: float,
) -> str:
    by_name = {r.part: r for r in results}
    rows = ["| part | status | exit | seconds | limit s | summary |", "|---|---|--:|--:|--:|---|"]
    for r in results:
        code = "" if r.code is None else str(r.code)
        line = headline(next((p for p in parts if p.name == r.part), None), r)
        limit = "" if r.limit is None else f"{r.limit:.0f}"
        rows.append(f"| {r.part} | {r.status} | {code} | {r.seconds:.0f} | {limit} | {line.replace('|', '/')} |")
    sections = []
    for part in parts:
        found = by_name.get(part.name)
        if found is None:
            sections.append(f"## {part.name}: {part.title}\n\nnot run yet.")
            continue
        r = found
        text = f"## {part.name}: {part.title}\n\n"
        text += f"Status: **{r.status}**" + (f", exit {r.code}" if r.code is not None else "")
        text += f", {r.seconds:.0f} s" + ("" if r.limit is None else f" of {r.limit:.0f} s")
        text += (f" ({r.note})" if r.note else "") + ".\n"
        if r.command:
            text += f"\nCommand: `{shlex.join(r.command)}` (log: `{part.name}.log`)\n"
        if r.stdout.strip():
            text += "\n" + (r.stdout.strip() if part.markdown and r.status == "passed" else fence(r.stdout)) + "\n"
        sections.append(text)
    total = time.perf_counter() - started
    body = "\n".join(header) + f"\n\nElapsed: {total:.0f} s.\n\n" + "\n".join(rows) + "\n\n" + "\n\n".join(sections)
    (out / "gpu-check.md").write_text(body + "\n", encoding="utf-8")
    return body


# ================================================================================================ main
def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the part's group is killed too
    budget = 60 * args.max_minutes
    deadline = started + budget
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if args.dry_run:
            env["CUDA_VISIBLE_DEVICES"] = ""
        paths = [str(ROOT)]
        results: list[Result] = []
        wheels_note = ""
        if args.wheels is not None:
            t = time.perf_counter()
            site = scratch / "site"
            site.mkdir()
            installed, wheels_note = install_wheels(args.wheels.resolve(), site, py, out / "wheels.log")
            status = "passed" if installed == 0 else "failed"
            results.append(Result("wheels", status, installed, time.perf_counter() - t, None, note=wheels_note))
            if installed == 0:
                paths.insert(0, str(site))
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
        info = probe(py, env)
        parts = make_parts(args, py, out, scratch)
        if "torchao" not in info:
            for part in parts:
                if part.name == "fp8":
                    part.skip = f"torchao.float8 does not import: {info.get('torchao_error')}"
        command = "python3 scripts/gpu_check.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        mode = (
            "**dry run** on the CPU: tiny sizes, one round; the numbers mean nothing" if args.dry_run else "on the GPU"
        )
        header = [
            "# GPU check",
            "",
            f"Command: `{command.strip()}` ({mode}){'; ' + args.label if args.label else ''}.",
            f"Budget: {args.max_minutes:g} minutes: "
            + ", ".join(f"{p.name} {p.share:.0%}" if p.share else f"{p.name} the rest" for p in parts)
            + ".",
            "",
            machine_text(info, wheels_note),
        ]
        if not args.dry_run and not info.get("cuda"):
            print(f"gpu-check: no CUDA GPU on this machine ({info.get('torch')}); --dry-run checks the logic on a CPU.")
            write_summary(out, [*header, "", "No CUDA GPU: nothing was run."], parts, results, started)
            return 3
        write_summary(out, header, parts, results, started)
        for i, part in enumerate(parts):
            left = deadline - time.perf_counter() - RESERVE_S
            later = sum(p.share or 0.0 for p in parts[i + 1 :] if p.skip is None)
            share_s = budget * part.share if part.share is not None else left
            limit = max(0.0, min(share_s, left - budget * later))
            if part.skip is not None:
                results.append(Result(part.name, "skipped", None, 0.0, None, note=part.skip))
            elif limit < 5:
                results.append(Result(part.name, "not run", None, 0.0, limit, note="the time budget is spent"))
            else:
                command_line = part.argv(part.targets, limit)
                t = time.perf_counter()
                code, stdout, note = run_command(command_line, limit, env, out / f"{part.name}.log")
                status = "timeout" if code is None else ("passed" if code == 0 else "failed")
                results.append(
                    Result(part.name, status, code, time.perf_counter() - t, limit, command_line, stdout, note)
                )
            write_summary(out, header, parts, results, started)
        failed = [r for r in results if r.status not in ("passed", "skipped")]
        print(f"gpu-check: tables in {out / 'gpu-check.md'} (logs beside it), {time.perf_counter() - started:.0f} s")
        for r in results:
            line = headline(next((p for p in parts if p.name == r.part), None), r)
            of = "" if r.limit is None else f" of {r.limit:.0f} s"
            exit_code = "" if r.code is None else f", exit {r.code}"
            print(f"  {r.part:6s} {r.status:8s} ({r.seconds:.0f} s{of}{exit_code}) {line}")
        return 1 if failed else 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
