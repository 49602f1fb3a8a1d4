"""Print pip constraints that pin every ``>=`` dependency of pyproject.toml to its floor: what ``make test-floor``
installs, so that the declared floors are exactly the versions the suite is tested with.

    python scripts/floor_constraints.py > floor.txt && pip install -c floor.txt -e ".[dev]"
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def floors(pyproject: Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = []
    for dep in deps:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", dep)
        if match is None:
            raise SystemExit(f"floor_constraints: {dep!r} has no plain '>=' floor; give every dependency one")
        pins.append(f"{match[1]}=={match[2]}")
    return pins


if __name__ == "__main__":
    print("\n".join(floors(Path(__file__).resolve().parent.parent / "pyproject.toml")))
