"""The test harness's multi-process runner (``tests/models.py``): what it retries and what it does not."""

from __future__ import annotations

import sys
from pathlib import Path

from models import run_until_written

# aborts (a native crash: a signal) on its first run, writes its file on the second
CRASH_ONCE = """
import os, sys
from pathlib import Path
out = Path(sys.argv[1])
if not (out / "ran").exists():
    (out / "ran").write_text("")
    os.abort()
(out / "done").write_text("")
"""


def test_a_native_crash_before_the_files_is_run_once_more(tmp_path: Path):
    script = tmp_path / "crash_once.py"
    script.write_text(CRASH_ONCE)
    code = run_until_written([sys.executable, str(script), str(tmp_path)], [tmp_path / "done"], tmp_path / "log.txt")
    assert code == 0
    assert (tmp_path / "done").exists()
    assert (tmp_path / "log.crashed.txt").exists()  # the first attempt's log is kept


def test_an_exception_is_not_retried(tmp_path: Path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nopen(sys.argv[1] + '/tries', 'a').write('x')\nraise SystemExit('no')\n")
    code = run_until_written([sys.executable, str(script), str(tmp_path)], [tmp_path / "done"], tmp_path / "log.txt")
    assert code == 1
    assert (tmp_path / "tries").read_text() == "x"  # once
    assert not (tmp_path / "log.crashed.txt").exists()


def test_a_peer_that_died_of_memory_corruption_is_run_once_more(tmp_path: Path):
    """Rank 0 exits with 1 when gloo loses its peer; the peer's glibc message in the log says why."""
    script = tmp_path / "peer.py"
    script.write_text(
        "import sys\nfrom pathlib import Path\nout = Path(sys.argv[1])\n"
        "if not (out / 'ran').exists():\n"
        "    (out / 'ran').write_text('')\n"
        "    print('double free or corruption (fasttop)', flush=True)\n"
        "    raise SystemExit('RuntimeError: Connection closed by peer')\n"
        "(out / 'done').write_text('')\n"
    )
    code = run_until_written([sys.executable, str(script), str(tmp_path)], [tmp_path / "done"], tmp_path / "log.txt")
    assert code == 0
    assert (tmp_path / "done").exists()
