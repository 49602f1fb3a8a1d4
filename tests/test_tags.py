"""The tags live in one module, and private symbols of other libraries are reached through one seam.

Both are checked on the source (with ``ast``), so that a tag spelled out in a writer or a reader, or a new
``torch._something`` in the diagnostics, fails here and not in a user's log or after a library upgrade.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_mpt.diagnostics import tags

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_mpt"
# the diagnostics and the report: the files whose private-symbol uses go through lightning_mpt/_compat.py
DIAGNOSTICS = (
    sorted(PACKAGE.glob("callbacks/*.py"))
    + sorted(PACKAGE.glob("diagnostics/*.py"))
    + sorted(PACKAGE.glob("report/*.py"))
    + [PACKAGE / name for name in ("cli.py", "core/numerics.py")]
)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.add(id(first.value))
    return found


def tag_literals(path: Path) -> list[str]:
    """String constants (f-string parts included) that spell a tag, docstrings aside."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    return [
        f"{path.name}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in skip
        and tags.PREFIX in node.value
    ]


def private_uses(path: Path) -> list[str]:
    """``x._name`` on anything but ``self``/``cls``, and imports of ``_``-prefixed names or modules of other
    packages."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("lightning_mpt"):
            parts = node.module.split(".") + [a.name for a in node.names]
            if any(p.startswith("_") and not p.startswith("__") for p in parts):
                found.append(
                    f"{path.name}:{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}"
                )
    return found


def test_no_tag_literals_outside_the_tags_module() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "tags.py" for hit in tag_literals(path)]
    assert not found, "tags are spelled only in lightning_mpt/diagnostics/tags.py:\n" + "\n".join(found)


def test_the_scan_finds_a_tag_literal(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('"""Docs may say mpt/loss_scale."""\nTAG = "mpt/loss_scale"\nf"{TAG}/mpt/x"\n')
    assert sorted(tag_literals(sample)) == ["sample.py:2: 'mpt/loss_scale'", "sample.py:3: '/mpt/x'"]


def test_private_symbols_only_through_compat() -> None:
    found = [hit for path in DIAGNOSTICS for hit in private_uses(path)]
    assert not found, "use lightning_mpt/_compat.py for private symbols of other libraries:\n" + "\n".join(found)


def test_the_scan_finds_private_symbols(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nfrom torch.nn.modules.conv import _ConvNd\nclass A:\n    def f(self, w, t):\n"
        "        self._ok = torch._foreach_norm([t], 2)\n        return w._get_file_writer(), t._version\n"
    )
    assert sorted(private_uses(sample)) == [
        "sample.py:2: from torch.nn.modules.conv import _ConvNd",
        "sample.py:5: torch._foreach_norm",
        "sample.py:6: t._version",
        "sample.py:6: w._get_file_writer",
    ]


@pytest.mark.parametrize(
    "tag",
    [
        tags.LOSS_SCALE,
        tags.SKIPPED_STEPS,
        tags.OVERFLOW,
        tags.GRAD_ZERO,
        tags.GRAD_SUBNORMAL,
        tags.GRAD_UNDERFLOW,
        tags.UPDATE_UNDERFLOW,
        tags.GRAD_HIST,
        tags.GRAD_EXPONENT,
    ],
)
def test_design_tags_keep_their_names(tag: str) -> None:
    """docs/concepts.md#tensorboard-tags fixes these names; the module is the only place that spells them."""
    assert tag in {
        "mpt/loss_scale",
        "mpt/skipped_steps",
        "mpt/overflow",
        "mpt/grad_zero_fraction",
        "mpt/grad_subnormal_fraction",
        "mpt/grad_underflow_fraction",
        "mpt/update_underflow_fraction",
        "mpt/grad",
        "mpt/grad_exponent",
    }
    assert tags.CATEGORY == "Mixed precision"


def test_records_are_under_their_prefix() -> None:
    assert set(tags.RECORD_FIELDS) == {tags.RUN_RECORD, tags.SKIP_RECORD, tags.STOP_RECORD, tags.SUMMARY_RECORD}
    assert all(t.startswith(tags.RECORDS + "/") and fields[0] == "schema" for t, fields in tags.RECORD_FIELDS.items())
