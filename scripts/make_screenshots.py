"""Regenerate the images of docs/report.md from a real training run.

    python scripts/make_screenshots.py        # about 10 s on 2 quiet CPU cores

Needs matplotlib (``pip install -e .[plots]``) and Chromium (Debian: ``apt-get install -y chromium``). It

1. trains two small fp16 runs of the quickstart classifier (examples/quickstart.py) with its loss weighted by 2^-12
   (as a small auxiliary-loss weight or a mean over many tokens would) into a temporary log directory: ``dynamic``,
   the dynamic scaler started at 2^36 so it probes down, growing every 25 steps, with an inf injected into one
   gradient at two steps; and ``unscaled``, a static scale of 1, where fp16 flushes the small gradients;
2. runs ``lightning-mpt report`` on it: the PNGs go to docs/img/report/, the text to docs/img/report.txt;
3. starts TensorBoard on it and takes a screenshot of the Custom Scalars "Mixed precision" dashboard with headless
   Chromium, at the address ``make demo`` prints (``dashboard_url()``) in a fresh profile: docs/img/dashboard.png,
   the dashboard as it opens.

``serve_tensorboard`` is also what tests/test_dashboard_server.py runs TensorBoard with.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
URL = re.compile(r"http://127\.0\.0\.1:\d+/")
LOSS_WEIGHT = 2.0**-12


# ------------------------------------------------------------------------------------------------- TensorBoard
def tensorboard_executable() -> str:
    """The ``tensorboard`` of this Python environment (next to the interpreter), else the one on PATH."""
    local = Path(sys.executable).parent / "tensorboard"
    found = str(local) if local.exists() else shutil.which("tensorboard")
    if found is None:
        raise FileNotFoundError(
            "no `tensorboard` executable next to the Python interpreter or on PATH; it is a "
            "dependency of lightning-mpt: pip install tensorboard"
        )
    return found


@contextlib.contextmanager
def serve_tensorboard(logdir: Path, timeout: float = 60.0) -> Iterator[str]:
    """Run ``tensorboard --logdir LOGDIR`` on 127.0.0.1 and yield its base URL; stop it (and its data server) on
    exit. TensorBoard picks a free port itself (``--port 0``) and prints the URL, so two servers never collide.
    It runs in the log directory's parent, so its page shows the directory's name, not a temporary path."""
    logdir = Path(logdir).resolve()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [tensorboard_executable(), "--logdir", logdir.name, "--host", "127.0.0.1", "--port", "0"],
            cwd=logdir.parent,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: _stop ends it and its data server together
        )
        try:
            deadline = time.monotonic() + timeout
            while True:
                log.seek(0)
                output = log.read()
                found = URL.search(output)
                if found:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tensorboard did not start (exit code {proc.poll()}):\n{output[-2000:]}")
                time.sleep(0.2)
            yield found.group(0)
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the process group we started (TensorBoard and the data server it spawned), then reap it."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def get_json(url: str, path: str, **query: str) -> Any:
    """GET ``url + path?query`` and decode its JSON."""
    full = url.rstrip("/") + path + ("?" + urllib.parse.urlencode(query) if query else "")
    if not full.startswith("http://"):
        raise ValueError(f"get_json: expected the local TensorBoard's http:// address, got {full!r}")
    with urllib.request.urlopen(full, timeout=10) as response:  # noqa: S310  (the scheme is checked above)
        return json.load(response)


def wait_for(fetch: Callable[[], Any], done: Callable[[Any], bool], timeout: float = 60.0) -> Any:
    """Call ``fetch`` until ``done`` accepts its result (TensorBoard loads event files in the background)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):  # not listening yet, or a half-loaded answer
            last = fetch()
            if done(last):
                return last
        time.sleep(0.3)
    raise TimeoutError(f"TensorBoard did not answer as expected within {timeout:g} s; last answer: {str(last)[:500]}")


# -------------------------------------------------------------------------------------------------- the runs
def train(logdir: Path, steps: int) -> None:
    """The two runs of the docs under ``logdir/dynamic`` and ``logdir/unscaled``."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_mpt import DynamicLossScaler, MPTPrecision
    from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor

    sys.path.insert(0, str(ROOT / "examples"))
    from quickstart import Classifier, synthetic

    class WeightedLoss(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch, batch_idx) * LOSS_WEIGHT

    class InjectInf(L.Callback):
        """An inf in one gradient at chosen steps: what a bad batch does."""

        def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            if trainer.global_step in (steps // 3, 2 * steps // 3):
                module.net[3].weight.grad.view(-1)[0] = math.inf

    configs = {
        "dynamic": (DynamicLossScaler(init_scale=2.0**36, growth_interval=25, max_scale=2.0**40), [InjectInf()]),
        "unscaled": (1.0, []),
    }
    for name, (scaler, extra) in configs.items():
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            plugins=[MPTPrecision("fp16", scaler=scaler)],
            callbacks=[
                *extra,
                LossScaleMonitor(),
                GradientHistogramMonitor(every_n_steps=steps // 4),
                UnderflowMonitor(every_n_steps=5, reference_every_n_steps=10),
            ],
            logger=L.pytorch.loggers.TensorBoardLogger(str(logdir), name=name, version=""),
            log_every_n_steps=5,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            limit_val_batches=0,
        )
        trainer.fit(WeightedLoss(), DataLoader(synthetic(32 * steps, 32, 8, 0), batch_size=32, shuffle=True))
        print(f"trained {name}: {trainer.precision_plugin.skipped_steps} skipped of {steps} steps")


# ----------------------------------------------------------------------------------------------- the pictures
def write_report(logdir: Path, out: Path) -> None:
    """``lightning-mpt report LOGDIR --out out/report``; its text goes to out/report.txt (docs/report.md shows it)."""
    from lightning_mpt.cli import main as cli

    shutil.rmtree(out / "report", ignore_errors=True)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = cli(["report", str(logdir), "--out", str(out / "report")])
    if code:
        raise RuntimeError(f"lightning-mpt report failed with exit code {code}")
    # paths relative to the log directory, so the text does not show this machine's temporary folder
    (out / "report.txt").write_text(text.getvalue().replace(str(logdir), "runs").replace(str(out), "docs/img"))
    print(text.getvalue())


def screenshot(logdir: Path, path: Path, steps: int, chromium: str, size: str, budget_ms: int) -> None:
    """Screenshot the "Mixed precision" dashboard once TensorBoard serves every run's whole scale series."""
    from lightning_mpt.diagnostics import tags

    with serve_tensorboard(logdir) as url:
        for run in ("dynamic", "unscaled"):
            wait_for(
                lambda run=run: get_json(url, "/data/plugin/scalars/scalars", run=run, tag=tags.LOSS_SCALE),
                lambda points: len(points) == steps,
            )
        with tempfile.TemporaryDirectory() as profile:
            command = [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={size}",
                # virtual time runs the page's timers (data fetches, chart animation) before the picture is taken
                f"--virtual-time-budget={budget_ms}",
                f"--screenshot={path}",
                opened_at(url),
            ]
            subprocess.run(command, check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _shrink(path)


def opened_at(url: str) -> str:
    """The dashboard's address that ``make demo`` and the README print, on the server at ``url``: what a user sees."""
    from lightning_mpt.diagnostics.dashboard import dashboard_url

    parsed = urllib.parse.urlsplit(url)
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"expected TensorBoard's address with a host and a port, got {url!r}")
    return dashboard_url(parsed.hostname, parsed.port)


def _shrink(path: Path) -> None:
    """Re-encode a screenshot with a 256-colour palette: the flat colours of a dashboard survive it, size drops ~4x."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(256)
    small.save(path, optimize=True)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the images go (default: docs/img)")
    p.add_argument("--logdir", type=Path, help="train into this folder and keep it (default: a temporary one)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    p.add_argument("--window-size", default="1300,1700")
    p.add_argument("--budget-ms", type=int, default=20000, help="Chromium's virtual-time budget")
    args = p.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        logdir = args.logdir or Path(stack.enter_context(tempfile.TemporaryDirectory())) / "runs"
        train(logdir, args.steps)
        write_report(logdir, args.out)
        screenshot(logdir, args.out / "dashboard.png", args.steps, args.chromium, args.window_size, args.budget_ms)
    for image in sorted(args.out.rglob("*.png")):
        print(f"{image.relative_to(args.out)}: {image.stat().st_size // 1024} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
