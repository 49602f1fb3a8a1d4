"""Every ```python block of docs/*.md and README.md runs, one test per block; the strict documentation build fails on
a broken link.

The blocks of one page share a namespace and run in page order, so a page can build up state (a model in one
block, a Trainer in the next). Running one block alone (``pytest -k "concepts.md and 3"``) first runs the blocks
before it. Each page runs in its own temporary working directory, so logs and checkpoints land there.

Code that cannot run on a CPU in seconds (a GPU, a cluster, a long training) belongs in a ```bash or ```text
block; fences must name their language, so a python block cannot slip through unlabeled.
"""

from __future__ import annotations

import linecache
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import torch.distributed.fsdp

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# a fenced block: opening fence (maybe indented, e.g. inside an admonition), its info string, body, closing fence
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: Path
    number: int  # 1-based among the page's python blocks
    line: int  # of the opening fence
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.number}"


def fences(page: Path) -> list[tuple[str, int, str]]:
    """``(info string, line of the opening fence, dedented body)`` of each fenced block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [
        (m["info"].strip(), text.count("\n", 0, m.start()) + 1, textwrap.dedent(m["body"]))
        for m in FENCE.finditer(text)
    ]


def python_blocks(page: Path) -> list[Block]:
    found = [(line, body) for info, line, body in fences(page) if info.split(" ")[0] in ("python", "py")]
    return [Block(page, i, line, body) for i, (line, body) in enumerate(found, 1)]


BLOCKS = [b for page in PAGES for b in python_blocks(page)]


class _Page:
    """The shared namespace of one page and how many of its blocks have run in it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.namespace: dict[str, Any] = {}
        self.done = 0


_pages: dict[Path, _Page] = {}
FSDP2 = hasattr(torch.distributed.fsdp, "fully_shard")


def needs_fsdp2(code: str) -> bool:
    return "fully_shard" in code or "mp_policy" in code


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_python_block(block: Block, tmp_path_factory: pytest.TempPathFactory) -> None:
    if not FSDP2 and any(needs_fsdp2(b.code) for b in python_blocks(block.page)[: block.number]):
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) is public from torch 2.6")
    page = _pages.get(block.page)
    if page is None or page.done >= block.number:  # first visit, or a re-run: start the page afresh
        page = _pages[block.page] = _Page(tmp_path_factory.mktemp(block.page.stem))
    cwd = os.getcwd()
    os.chdir(page.workdir)
    try:
        failure = _run_through(page, python_blocks(block.page)[page.done : block.number])
    finally:
        os.chdir(cwd)
    if failure is not None:
        failed, trace = failure
        builds_on = "" if failed == block else f", which block {block.number} builds on,"
        pytest.fail(
            f"{block.page.name}: python block {failed.number} (line {failed.line}){builds_on} failed:\n{trace}",
            pytrace=False,
        )


def _run_through(page: _Page, blocks: list[Block]) -> Optional[tuple[Block, str]]:
    """Run ``blocks`` in order in the page's namespace; return the first that fails and its traceback."""
    for b in blocks:
        filename = f"{b.page.relative_to(ROOT)}:{b.line} (python block {b.number})"
        linecache.cache[filename] = (len(b.code), None, b.code.splitlines(keepends=True), filename)  # for tracebacks
        code = compile(b.code, filename, "exec")
        try:
            exec(code, page.namespace)  # noqa: S102  (running the documentation's own examples is the test)
        except Exception:
            return b, traceback.format_exc()
        page.done = b.number
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_fences_name_their_language(page: Path) -> None:
    unlabeled = [line for info, line, _ in fences(page) if not info]
    assert not unlabeled, (
        f"{page.name}: fenced blocks without a language at lines {unlabeled} (python, bash, text, ...)"
    )


def test_blocks_are_found() -> None:
    """The parser sees the blocks it should: an indented fence, a fence with attributes, the line numbers."""
    page = ROOT / "docs" / "index.md"
    assert any(b.page == page for b in BLOCKS)
    sample = 'text\n\n```python title="a.py"\nx = 1\n```\n\n!!! note\n    ```python\n    y = x + 1\n    ```\n'
    matches = list(FENCE.finditer(sample))
    assert [m["info"] for m in matches] == ['python title="a.py"', "python"]
    assert textwrap.dedent(matches[1]["body"]) == "y = x + 1\n"


def makefile_docs_build() -> list[str]:
    """The documentation build of the Makefile's ``test`` target (what CI runs), run by this interpreter."""
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile has no test target"
    (line,) = [line for line in recipe[1].splitlines() if "mkdocs build" in line]
    return [sys.executable, "-m", "mkdocs", *shlex.split(line.split("mkdocs", 1)[1], comments=True)]


@pytest.mark.slow
def test_the_strict_docs_build_fails_on_a_broken_link_and_says_so(tmp_path: Path) -> None:
    """``make test``'s build of a copy of the documentation with a link to a missing page fails, and its output names
    the link (a build that hides its warnings, ``--quiet``, counts none of them in strict mode)."""
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / "index.md", "a", encoding="utf-8") as page:
        page.write("\n[a page that is not there](does-not-exist.md)\n")
    build = subprocess.run(
        makefile_docs_build(),
        cwd=tmp_path,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = build.stdout + build.stderr
    assert build.returncode != 0, output[-3000:]
    assert "does-not-exist.md" in output, output[-3000:]


EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if "\ndef main(" in p.read_text(encoding="utf-8"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_takes_fast(example: Path) -> None:
    """README: every example has ``--fast`` (the test suite runs them so): its own flag or ``example_parser``'s."""
    source = example.read_text(encoding="utf-8")
    assert '"--fast"' in source or "example_parser(" in source, f"{example.name} has no --fast flag"
    assert "--fast" in source.split('"""')[1], f"{example.name}'s docstring does not show --fast"
