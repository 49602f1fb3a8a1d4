"""The package's layers and the direction of their imports (docs/architecture.md).

- ``core/``: torch only; nothing from Lightning, nothing of ours above it.
- ``diagnostics/``: torch, torchmetrics and TensorBoard; nothing from Lightning, nothing of ours above it (it may use
  ``core/``).
- The two front-ends never import each other: the Trainer's (``precision.py``, ``callbacks/``, ``_averaging.py``,
  ``_retries.py``) and Fabric's (``fabric/``). What both need lives below them (``_plugin.py``, ``core/``,
  ``diagnostics/``).
- The report (``report/``, with ``cli.py`` on top) imports no front-end, and its modules import each other in one
  direction only: no import circle between them (:data:`REPORT_ORDER`).

Imports are read from the source (every ``import``, also inside functions and under ``TYPE_CHECKING``), so a lazy
import cannot hide a wrong direction. Docstrings are not code and are not read.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_mpt"

TRAINER = ("lightning_mpt.precision", "lightning_mpt.callbacks", "lightning_mpt._averaging", "lightning_mpt._retries")
FABRIC = ("lightning_mpt.fabric",)
BELOW_ADAPTERS = (
    "lightning_mpt._plugin",
    "lightning_mpt._fp8_plugin",
    "lightning_mpt._gradscaler",
    "lightning_mpt._pretrained",
    "lightning_mpt.report",
    "lightning_mpt.cli",
)

# layer (a path prefix under lightning_mpt/) -> module prefixes it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "core/": ("lightning", "lightning_mpt.diagnostics", *TRAINER, *FABRIC, *BELOW_ADAPTERS),
    "diagnostics/": ("lightning", *TRAINER, *FABRIC, *BELOW_ADAPTERS),
    "_plugin.py": ("lightning.pytorch", "lightning.fabric.fabric", *TRAINER, *FABRIC),
    "_fp8_plugin.py": ("lightning", *TRAINER, *FABRIC),
    "_gradscaler.py": ("lightning.pytorch", "lightning.fabric.fabric", *TRAINER, *FABRIC),
    "_pretrained.py": ("lightning", *TRAINER, *FABRIC),
    "precision.py": FABRIC,
    "callbacks/": FABRIC,
    "_averaging.py": FABRIC,
    "_retries.py": FABRIC,
    "fabric/": ("lightning.pytorch", *TRAINER),
    "report/": ("lightning", *TRAINER, *FABRIC, "lightning_mpt.cli"),
    "cli.py": ("lightning", *TRAINER, *FABRIC),
}

# the report's modules from the bottom up: each imports only modules before it in this list (the package's
# __init__ re-exports; the command, lightning_mpt/cli.py, is on top)
REPORT_ORDER = (
    "lightning_mpt.report.data",
    "lightning_mpt.report.folders",
    "lightning_mpt.report.records",
    "lightning_mpt.report.events",
    "lightning_mpt.report.skips",
    "lightning_mpt.report.fp8",
    "lightning_mpt.report.advice",
    "lightning_mpt.report.summary",
    "lightning_mpt.report.text",
    "lightning_mpt.report.plots",
    "lightning_mpt.report",
    "lightning_mpt.cli",
)


def imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path`` (a module of the package at ``root``), relative imports
    resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(("lightning_mpt", *path.relative_to(root).parent.parts))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            found.append((node.lineno, base))
    return found


def violations(path: Path, forbidden: tuple[str, ...], root: Path = PACKAGE) -> list[str]:
    return [
        f"{path.relative_to(root)}:{line}: imports {module}"
        for line, module in imports(path, root)
        if any(module == f or module.startswith(f + ".") for f in forbidden)
    ]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_point_down(layer: str) -> None:
    paths = sorted((PACKAGE / layer).rglob("*.py")) if layer.endswith("/") else [PACKAGE / layer]
    assert paths, f"no module in {layer}"
    found = [hit for path in paths for hit in violations(path, FORBIDDEN[layer])]
    assert not found, "an import against the layers (docs/architecture.md):\n" + "\n".join(found)


def test_the_check_finds_a_wrong_import(tmp_path: Path) -> None:
    """The scan sees imports inside functions, under ``TYPE_CHECKING`` and relative ones."""
    root = tmp_path / "lightning_mpt"
    module = root / "core" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning.pytorch import Trainer\n"
        "def f():\n    from ..fabric import MPTPrecision\n    import lightning_mpt.callbacks\n"
    )
    found = violations(module, FORBIDDEN["core/"], root)
    assert [hit.split(": ", 1)[1] for hit in found] == [
        "imports lightning.pytorch.Trainer",
        "imports lightning.pytorch",
        "imports lightning_mpt.fabric.MPTPrecision",
        "imports lightning_mpt.fabric",
        "imports lightning_mpt.callbacks",
    ]


# ------------------------------------------------------------------------------------------------ import circles
def module_graph(paths: list[Path], root: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules of paths it imports}`` for the modules at ``paths`` (under the package at ``root``); an
    imported name resolves to the longest module of ``paths`` it starts with (``a.b.f`` -> ``a.b``)."""
    names = {}
    for path in paths:
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        graph[name] = set()
        for _, module in imports(path, root):
            while module and module not in names:
                module = module.rpartition(".")[0]
            if module and module != name:
                graph[name].add(module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each group of modules that import each other, directly or through others (a
    strongly connected component of two or more), its modules sorted."""
    reach = {module: _reachable(graph, module) for module in graph}
    groups = {tuple(sorted(m for m in graph if m in reach[module] and module in reach[m])) for module in graph}
    return sorted(list(group) for group in groups if len(group) > 1)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for imported in graph[todo.pop()]:
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return seen


def report_modules(root: Path = PACKAGE) -> list[Path]:
    """The report's modules: the package ``report/``, any ``report*.py`` beside it, and the command ``cli.py``."""
    return [*sorted((root / "report").rglob("*.py")), *sorted(root.glob("report*.py")), root / "cli.py"]


def test_no_import_circle_in_the_report() -> None:
    found = circles(module_graph(report_modules()))
    assert not found, "modules of the report that import each other:\n" + "\n".join(", ".join(c) for c in found)


def test_the_report_imports_downwards() -> None:
    graph = module_graph(report_modules())
    assert sorted(graph) == sorted(REPORT_ORDER), "a module of the report is missing from REPORT_ORDER"
    upward = [
        f"{module} imports {imported}"
        for module, imports_of in graph.items()
        for imported in imports_of
        if REPORT_ORDER.index(imported) > REPORT_ORDER.index(module)
    ]
    assert not upward, "the report's modules import downwards only (REPORT_ORDER):\n" + "\n".join(upward)


def test_the_check_finds_an_import_circle(tmp_path: Path) -> None:
    """A circle through a run-time import inside a function and one through ``TYPE_CHECKING`` are both found."""
    root = tmp_path / "lightning_mpt"
    (root / "report").mkdir(parents=True)
    (root / "cli.py").write_text("from lightning_mpt.report import summary\n")
    (root / "report" / "__init__.py").write_text("")
    (root / "report" / "data.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .summary import S\n"
    )
    (root / "report" / "advice.py").write_text("def f():\n    from lightning_mpt.report.summary import summarize\n")
    (root / "report" / "summary.py").write_text("from lightning_mpt.report.advice import f\nfrom . import data\n")
    found = circles(module_graph(report_modules(root), root))
    assert found == [["lightning_mpt.report.advice", "lightning_mpt.report.data", "lightning_mpt.report.summary"]]
