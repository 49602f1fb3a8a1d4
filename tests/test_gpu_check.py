"""``scripts/gpu_check.py`` without a GPU: its dry run (the same parts on the CPU, tiny sizes, one round) writes every
part's section and table, installs wheels from a folder, records a part that fails with its exit code and goes on,
and exits non-zero. Its logic, not its timings: the timings need the GPU machine (``make gpu-check``)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_check() -> ModuleType:
    """The script as a module (scripts/ is no package)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # before running it: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def make_wheel(folder: Path) -> Path:
    """A one-module pure-Python wheel, built by hand (what ``--wheels`` installs: torchao's on the GPU machine)."""
    folder.mkdir(parents=True)
    wheel = folder / "gpu_check_probe-0.1-py3-none-any.whl"
    info = "gpu_check_probe-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("gpu_check_probe/__init__.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def status_table(text: str) -> dict[str, tuple[str, str]]:
    """``part -> (status, exit)`` from the summary's status table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in ("wheels", "tests", "host", "fp8", "gpt2"):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One dry run of every part, with wheels from a folder and the fp8 part pointed at a missing script."""
    tmp = tmp_path_factory.mktemp("gpu-check")
    make_wheel(tmp / "wheels")
    out = tmp / "out"
    command = [
        sys.executable,
        "scripts/gpu_check.py",
        "--out",
        str(out),
        "--dry-run",
        "--wheels",
        str(tmp / "wheels"),
        "--script",
        "fp8=benchmarks/no_such_benchmark.py",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    return done, out


@pytest.mark.slow
def test_dry_run_writes_every_part_and_records_the_failing_one(
    dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, out = dry_run
    assert done.returncode == 1, done.stdout + done.stderr  # a part failed
    assert sorted(p.name for p in out.iterdir()) == [
        "fp8.log",
        "gpt2.json",
        "gpt2.log",
        "gpu-check.md",
        "host.log",
        "tests.log",
        "wheels.log",
    ]
    text = (out / "gpu-check.md").read_text()
    assert "**dry run**" in text
    rows = status_table(text)
    assert rows == {
        "wheels": ("passed", "0"),
        "tests": ("passed", "0"),
        "host": ("passed", "0"),
        "fp8": ("failed", "2"),  # python: can't open file
        "gpt2": ("passed", "0"),  # the part after the failing one still ran
    }
    assert "no_such_benchmark.py" in (out / "fp8.log").read_text()
    assert "gpu_check_probe-0.1-py3-none-any.whl" in text
    for part in ("tests", "host", "fp8", "gpt2"):
        assert f"## {part}: " in text
        assert re.search(rf"^  {part} +(passed|failed) ", done.stdout, re.M), done.stdout
    assert str(out / "gpu-check.md") in done.stdout
    # the CUDA tests were collected and skipped (no GPU), the host time measured
    tests = text.split("## tests: ")[1].split("\n## ")[0]
    assert re.search(r"\d+ skipped", tests)
    assert "-m cuda" in tests
    assert "tests/test_cuda_fp8.py" in tests
    assert "total / GradScaler" in text.split("## host: ")[1]
    # GPT-2's part on the tiny model: a row per precision in the step-time and memory tables, the raw numbers
    gpt2: dict[str, Any] = json.loads((out / "gpt2.json").read_text())
    assert set(gpt2["results"]["transformer"]) == set(gpu_check().PRECISIONS)
    section = text.split("## gpt2: ")[1]
    assert "total B/param" in section
    for name in gpu_check().PRECISIONS:
        assert f"| transformer | {name} |" in section


def test_every_mpt_precision_of_the_benchmarks_is_in_the_gpu_check() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_time

    precisions = gpu_check().PRECISIONS
    assert {"bf16-mixed", "16-mixed"} <= set(precisions)
    assert set(precisions) <= set(step_time.ALL_PRECISIONS)  # names the benchmark knows
    missing = [name for name in step_time.ALL_PRECISIONS if name.startswith("mpt-") and name not in precisions]
    assert not missing, f"add {missing} to PRECISIONS in scripts/gpu_check.py"


def test_wheels_install_from_a_folder_and_a_missing_folder_fails(tmp_path: Path) -> None:
    module = gpu_check()
    code, note = module.install_wheels(tmp_path / "nowhere", tmp_path / "site", sys.executable, tmp_path / "w.log")
    assert code != 0
    assert "no such folder" in note
    (tmp_path / "empty").mkdir()
    code, note = module.install_wheels(tmp_path / "empty", tmp_path / "site", sys.executable, tmp_path / "w.log")
    assert code != 0
    assert "no .whl" in note


def test_bad_options_are_refused() -> None:
    module = gpu_check()
    with pytest.raises(SystemExit):
        module.parse_args(["--out", "x", "--script", "nopart=foo.py"])
    with pytest.raises(SystemExit):
        module.parse_args(["--out", "x", "--max-minutes", "0"])
    args = module.parse_args(["--out", "x", "--script", "gpt2=other.py", "--parts", "gpt2"])
    parts = module.make_parts(args, "python3", Path("out"), Path("scratch"))
    assert [p.name for p in parts] == ["gpt2"]
    command = parts[0].argv(parts[0].targets, 300.0)
    assert command[:2] == ["python3", "other.py"]
    assert command[command.index("--max-minutes") + 1] == f"{(300 - module.TAIL_S) / 60:.2f}"
    assert command[command.index("--accelerator") + 1] == "gpu"
