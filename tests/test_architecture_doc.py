"""docs/architecture.md against the package: a table row for every module, no row for a module that is gone, and
the figures of one optimizer step as ``scripts/layout_stats.py`` counts them now."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_mpt"
DOC = ROOT / "docs" / "architecture.md"
SCRIPT = ROOT / "scripts" / "layout_stats.py"

# "64 calls of 47 functions in 9 modules"
FIGURES = re.compile(r"(\d+) calls of (\d+) functions in (\d+) modules")
BACKTICKED = re.compile(r"`([^`\s]+)`")


def modules() -> set[str]:
    """Every module file of the package, relative to ``lightning_mpt/``."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.glob("**/*.py")}


def table_rows(text: str) -> list[list[str]]:
    """The cells of each markdown table row (a line starting with ``|``)."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|")
    ]


def listed_and_named(text: str) -> tuple[set[str], set[str]]:
    """The ``.py`` paths in the first cell of a table row (the modules given a row), and those anywhere in a row."""
    listed: set[str] = set()
    named: set[str] = set()
    for cells in table_rows(text):
        listed.update(p for p in BACKTICKED.findall(cells[0]) if p.endswith(".py"))
        named.update(p for cell in cells for p in BACKTICKED.findall(cell) if p.endswith(".py"))
    return listed, named


def step_figures(text: str) -> tuple[int, int, int]:
    """``(calls, functions, modules)`` of the first such sentence under "## One optimizer step"."""
    section = text.split("\n## One optimizer step\n", 1)[1].split("\n## ", 1)[0]
    found = FIGURES.search(section)
    assert found, 'no "N calls of F functions in M modules" under "## One optimizer step"'
    calls, functions, count = map(int, found.groups())
    return calls, functions, count


def test_every_module_has_a_row() -> None:
    listed, named = listed_and_named(DOC.read_text(encoding="utf-8"))
    package = modules()
    missing = sorted(package - listed)
    stale = sorted(named - package)
    assert not missing, "modules without a table row in docs/architecture.md:\n" + "\n".join(missing)
    assert not stale, "table rows of docs/architecture.md name modules that do not exist:\n" + "\n".join(stale)


def test_step_figures_match_layout_stats() -> None:
    # the script has no function that returns the figures (step_calls prints them): run it as it is meant to be run
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    measured = re.search(r"one fp16 step: " + FIGURES.pattern, out)
    assert measured, f"scripts/layout_stats.py printed no step figures:\n{out}"
    calls, functions, count = map(int, measured.groups())
    doc_calls, doc_functions, doc_count = step_figures(DOC.read_text(encoding="utf-8"))
    sentence = f"{calls} calls of {functions} functions in {count} modules"
    where = f'docs/architecture.md, "## One optimizer step": scripts/layout_stats.py now counts {sentence}'
    assert abs(doc_calls - calls) <= 10, f"{where}; the page says {doc_calls} calls"
    assert abs(doc_functions - functions) <= 5, f"{where}; the page says {doc_functions} functions"
    assert doc_count == count, f"{where}; the page says {doc_count} modules"
