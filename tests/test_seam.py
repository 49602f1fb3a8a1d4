"""No module of the package uses a private (``_``-prefixed) symbol of torch, Lightning, TensorBoard or torchmetrics
except ``lightning_mpt/_compat.py``, the one seam where each such use says why and from which versions."""

from __future__ import annotations

import ast
from pathlib import Path

from test_tags import PACKAGE, private_uses

SEAM = PACKAGE / "_compat.py"


def own_private_names() -> set[str]:
    """Every ``_``-prefixed name the package defines itself: attributes it assigns, functions, methods and classes,
    and its own modules (``_compat``, ``_args``): using those is not reaching into another library."""
    names = {p.stem for p in PACKAGE.rglob("_*.py")}
    for path in PACKAGE.rglob("*.py"):
        if path == SEAM:  # what the seam assigns is the foreign libraries' (``optimizer._opt_called``)
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {n for n in names if n.startswith("_")}


def foreign_private_uses(path: Path, own: set[str]) -> list[str]:
    found = []
    for hit in private_uses(path):
        used = hit.rsplit(".", 1)[-1].split(",")[0].strip() if " import " not in hit else hit
        if " import " in hit or used not in own:
            found.append(hit)
    return found


def test_private_symbols_of_other_libraries_only_in_the_seam() -> None:
    own = own_private_names()
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != SEAM for hit in foreign_private_uses(path, own)]
    assert not found, "go through lightning_mpt/_compat.py for private symbols of other libraries:\n" + "\n".join(found)


def test_the_scan_tells_own_private_names_from_foreign_ones(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(plugin, opt):\n    return plugin._engine, opt._opt_called, plugin._not_ours\n")
    own = {"_engine"}
    assert foreign_private_uses(sample, own) == ["sample.py:2: opt._opt_called", "sample.py:2: plugin._not_ours"]
