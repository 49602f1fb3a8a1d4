"""The package's layers and the direction of their imports (docs/architecture.md).

- ``core/``: torch only; nothing from Lightning, nothing of ours above it.
- ``diagnostics/``: torch, torchmetrics and TensorBoard; nothing from Lightning, nothing of ours above it (it may use
  ``core/``).
- The two front-ends never import each other: the Trainer's (``precision.py``, ``callbacks/``, ``_averaging.py``,
  ``_retries.py``) and Fabric's (``fabric/``). What both need lives below them (``_plugin.py``, ``core/``,
  ``diagnostics/``).

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
    "lightning_mpt.report_events",
    "lightning_mpt.report_plots",
    "lightning_mpt.report_advice",
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
    "report.py": ("lightning", *TRAINER, *FABRIC),
    "report_events.py": ("lightning", *TRAINER, *FABRIC),
    "report_plots.py": ("lightning", *TRAINER, *FABRIC),
    "report_advice.py": ("lightning", *TRAINER, *FABRIC),
    "cli.py": ("lightning", *TRAINER, *FABRIC),
}


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
