"""The ``lightning-mpt`` command.

``lightning-mpt report LOGDIR [--out DIR] [--json]`` summarises the ``mpt/`` tags of the runs under LOGDIR (see
:mod:`lightning_mpt.report`), writes PNG plots to ``--out`` (default ``LOGDIR/report``) when matplotlib is
installed, and ends with the command and the address that open the "Mixed precision" dashboard. This module is the
top of the report's layers: it imports :mod:`lightning_mpt.report`, which never imports it.

Example:
    ```python
    from lightning_mpt.cli import main

    exit_code = main(["report", "runs", "--json", "--no-plots"])
    ```
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path
from typing import Optional

from lightning_mpt.diagnostics.dashboard import dashboard_url
from lightning_mpt.report import ReportError, build_report, format_text

PROG = "lightning-mpt"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Mixed-precision diagnostics for lightning-mpt runs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report = commands.add_parser(
        "report",
        help="summarise the loss scale, skipped steps and underflow of the runs under a log directory",
        description="Read the TensorBoard event files under LOGDIR (every folder holding event files is a run; several "
        "runs are compared side by side), print a summary and write PNG plots.",
    )
    report.add_argument("logdir", metavar="LOGDIR", type=Path, help="a TensorBoard log directory (e.g. runs/)")
    report.add_argument("--out", type=Path, help="folder for the PNG plots (default: LOGDIR/report)")
    report.add_argument("--json", action="store_true", help="print the summary as JSON (notes go to stderr)")
    report.add_argument("--no-plots", action="store_true", help="write no plots")
    report.add_argument("--top", type=int, default=5, help="entries per list in the text report (default: 5)")
    report.add_argument(
        "--width",
        type=int,
        help="characters per line the table fits (default: the terminal's width, 100 when it has none)",
    )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Run the command line ``argv`` (``sys.argv[1:]`` by default); return the exit status (0 ok, 1 error, 2 usage)."""
    args = _parser().parse_args(argv)
    try:
        report = build_report(args.logdir)
    except ReportError as e:
        print(f"{PROG} report: error: {e}", file=sys.stderr)
        return 1
    width = args.width or shutil.get_terminal_size((100, 24)).columns
    print(report.to_json() if args.json else format_text(report, top=args.top, width=width))
    notes = sys.stderr if args.json else sys.stdout  # --json keeps stdout parseable
    if not args.no_plots:
        try:
            from lightning_mpt.report.plots import write_plots

            paths = write_plots(report, args.out or args.logdir / "report")
        except ImportError as e:
            if (e.name or "").partition(".")[0] not in ("matplotlib", "numpy"):
                raise
            print("plots skipped: matplotlib is not installed (pip install 'lightning-mpt[plots]')", file=notes)
        else:
            print("\nplots:" if paths else "\nplots: no data to plot", file=notes)
            for path in paths:
                print(f"  {path}", file=notes)
    if not args.json:
        logdir = shlex.quote(str(args.logdir))
        print(f"\nthe Mixed precision dashboard (smoothing off):\n  tensorboard --logdir {logdir}")
        print(f"  then open {dashboard_url()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
