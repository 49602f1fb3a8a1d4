"""The runs under a log directory: every folder that holds TensorBoard event files, each folder once.

The walk follows symbolic links, as TensorBoard does (a log directory may link runs kept elsewhere), but reads each
folder once, by its real path: a link back to a parent (``runs/a/up -> ..``) is not walked round and round, and
``latest -> version_1`` is not a second run. A folder reached both ways is named by its path without links. What
cannot be read (a folder that cannot be listed, a link to nothing) is named with what is wrong, never raised.

Example:
    ```python
    import os
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp())
    (root / "version_1").mkdir()
    (root / "version_1" / "events.out.tfevents.0.host").write_bytes(b"")
    os.symlink("version_1", root / "latest")        # the same run again
    os.symlink("..", root / "version_1" / "up")     # a loop
    os.symlink("missing", root / "gone")            # a link to nothing
    found = find_runs(root)
    assert list(found.runs) == ["version_1"]
    assert found.unreadable == {"gone": "a symbolic link to missing, which does not exist"}
    ```
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lightning_mpt.report.data import ReportError

__all__ = ["RunFolders", "find_runs", "is_event_file"]


def is_event_file(name: str) -> bool:
    """Whether a file of this name is a TensorBoard event file (TensorBoard's own test: ``tfevents`` in the name).

    Args:
        name: the file's name.

    Example:
        ```python
        assert is_event_file("events.out.tfevents.1700000000.host.1.0") and not is_event_file("hparams.yaml")
        ```
    """
    return "tfevents" in name


@dataclass
class RunFolders:
    """The run folders under a log directory and what could not be read there.

    Args:
        root: the log directory.
        runs: ``{name: folder}``, the name relative to ``root`` (``"."`` for ``root`` itself), in name order.
        unreadable: ``{path relative to root: what is wrong}`` for folders that cannot be listed and broken links.
    """

    root: Path
    runs: dict[str, Path] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)


def find_runs(logdir: str | os.PathLike[str]) -> RunFolders:
    """Every folder under ``logdir`` (``logdir`` included) that holds event files, each real folder once.

    Raises :class:`~lightning_mpt.report.data.ReportError` when ``logdir`` is missing or not a folder.

    Args:
        logdir: a TensorBoard log directory (a ``TensorBoardLogger``'s ``save_dir``, or one run's folder).

    Example:
        ```python
        found = find_runs("runs")
        print(list(found.runs), found.unreadable)     # ["demo/version_0"], {}
        ```
    """
    root = Path(logdir)
    if not root.exists():
        raise ReportError(
            f"{root}: no such directory; expected a TensorBoard log directory (a TensorBoardLogger's "
            "save_dir, or one run's version_N folder)."
        )
    if not root.is_dir():
        raise ReportError(f"{root}: not a directory; expected a TensorBoard log directory, not a file.")
    found = RunFolders(root)
    seen: set[str] = set()
    links: list[Path] = []
    _walk(root, found, seen, links)
    # the links last, so that a folder reached both ways is named by its real path; a link met while walking a link
    # is appended and walked in turn
    while links:
        _walk(links.pop(0), found, seen, links)
    found.runs = dict(sorted(found.runs.items()))
    found.unreadable = dict(sorted(found.unreadable.items()))
    return found


def _walk(top: Path, found: RunFolders, seen: set[str], links: list[Path]) -> None:
    """Walk ``top`` without following links (queued in ``links``), skipping real folders already ``seen``."""
    real = os.path.realpath(top)
    if real in seen:
        return
    seen.add(real)
    stack = [top]
    while stack:
        folder = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as error:  # PermissionError, a folder removed meanwhile, an I/O error
            found.unreadable[_name(found.root, folder)] = f"the folder cannot be listed ({_why(error)})"
            continue
        has_events = False
        for entry in entries:
            path = Path(entry.path)
            if entry.is_symlink():
                if not path.exists():
                    target = os.readlink(path)
                    found.unreadable[_name(found.root, path)] = f"a symbolic link to {target}, which does not exist"
                elif path.is_dir():
                    links.append(path)
                elif is_event_file(entry.name):
                    has_events = True
                continue
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:  # the entry vanished or cannot be examined: the file checks name it if it is an event file
                is_dir = False
            if is_dir:
                if os.path.realpath(path) not in seen:
                    seen.add(os.path.realpath(path))
                    stack.append(path)
            elif is_event_file(entry.name):
                has_events = True
        if has_events:
            found.runs.setdefault(_name(found.root, folder), folder)


def _name(root: Path, path: Path) -> str:
    relative = os.path.relpath(path, root)
    return Path(relative).as_posix()


def _why(error: OSError) -> str:
    return error.strerror.lower() if error.strerror else type(error).__name__
