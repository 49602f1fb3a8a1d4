"""Tiny real models and a quiet Trainer factory shared by the tests (no mocks: real Lightning, real torch)."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# MPTPrecision's options for the whole step with 4-byte masters: fp16's default, and bf16's before 0.4 (its default
# now keeps 16-bit remainders stepped in chunks). For tests of what only the whole step holds (the masters' fp32
# gradients at the hooks, their buffers)
WHOLE_STEP = {"master_remainders": False, "chunked_step": False}


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """A CPU Trainer without progress bar, summary, logger or checkpoints unless asked for."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def regression_data(n: int = 64, d_in: int = 16, d_out: int = 4, seed: int = 0, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / d_in**0.5
    y = x @ w + 0.01 * torch.randn(n, d_out, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def classification_images(
    n: int = 32, classes: int = 4, size: int = 8, seed: int = 0, batch_size: int = 8
) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, 3, size, size, generator=g) + y.view(-1, 1, 1, 1).float() * 0.5
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def token_data(n: int = 32, seq: int = 8, vocab: int = 16, seed: int = 0, batch_size: int = 8) -> DataLoader:
    """Copy task: the target is the source sequence shifted by one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, vocab, (n, seq), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, 1, dims=1)), batch_size=batch_size, shuffle=False)


class TinyMLP(L.LightningModule):
    """Linear -> LayerNorm -> ReLU -> Linear regression model."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4, lr: float = 1e-2, optimizer: str = "adam"):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class NoNormMLP(TinyMLP):
    """TinyMLP without its LayerNorm: every parameter is half under MPTPrecision."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class SmallCNN(L.LightningModule):
    """Conv -> BatchNorm -> ReLU -> pool -> Linear classifier."""

    def __init__(self, classes: int = 4, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2)
        )
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def small_transformer(d_model: int, dim_feedforward: int) -> nn.Transformer:
    """One encoder and one decoder layer, 2 heads, no dropout (deterministic), batch first."""
    return nn.Transformer(
        d_model=d_model,
        nhead=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=dim_feedforward,
        dropout=0.0,
        batch_first=True,
    )


class TinyTransformer(L.LightningModule):
    """Embedding + ``nn.Transformer`` (LayerNorm, softmax attention) on a sequence copy task."""

    def __init__(self, vocab: int = 16, d_model: int = 16, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, d_model)
        self.transformer = small_transformer(d_model, dim_feedforward=32)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.out(self.transformer(self.embed(src), self.embed(tgt)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        src, tgt = batch
        logits = self(src, tgt)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), src.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class Net(nn.Module):
    """Embedding + ``nn.Transformer`` (1 encoder, 1 decoder layer, LayerNorms) + head; predicts the source from its
    shift. A plain module, for FSDP2 (the LightningModule of tests/fsdp_worker.py holds one; Fabric loops use it)."""

    def __init__(self, vocab: int = 16, d_model: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.transformer = small_transformer(d_model, dim_feedforward=64)
        self.out = nn.Linear(d_model, vocab)

    def blocks(self) -> list[nn.Module]:
        """The transformer layers: what FSDP2 shards one by one."""
        return [*self.transformer.encoder.layers, *self.transformer.decoder.layers]

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        return self.out(self.transformer(self.embed(src), self.embed(torch.roll(src, 1, dims=1))))


class InjectInf(L.Callback):
    """Writes a non-finite value into one parameter's stored gradient after the backward of chosen batches or steps.

    ``batches`` are batch indices within the epoch; ``steps`` are optimizer-step indices (``trainer.global_step``
    during the step); either may be a set (the value written is ``value``, inf by default) or a dict mapping each
    index to the value to write there. ``rank`` limits the injection to one process.
    """

    def __init__(
        self,
        param_name: str,
        batches: Optional[Union[set[int], dict[int, float]]] = None,
        steps: Optional[Union[set[int], dict[int, float]]] = None,
        rank: Optional[int] = None,
        value: float = math.inf,
    ) -> None:
        self.param_name, self.rank = param_name, rank
        self.batches = batches if isinstance(batches, dict) else dict.fromkeys(batches or (), value)
        self.steps = steps if isinstance(steps, dict) else dict.fromkeys(steps or (), value)
        self.injected: list[int] = []  # batch indices where a value was written

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        value = self.batches.get(batch_idx, self.steps.get(trainer.global_step))
        if value is not None:
            grad = dict(module.named_parameters())[self.param_name].grad
            grad.view(-1)[0] = value
            self.injected.append(batch_idx)


def check_fp32_accumulation(grad: Callable[..., torch.Tensor]) -> None:
    """Summing 64 micro-batch gradients of ``Linear(16, 1, bias=False)`` rounds in fp16 and is exact in fp32.

    ``grad(x, **plugin_kwargs)`` runs one backward per row of ``x`` with the loss ``model(row).mean() * 2**-10``,
    averaged over the 64 micro-batches, through ``MPTPrecision("fp16", scaler=2.0**10, **plugin_kwargs)``, and
    returns the unscaled gradient that the step would see (as float64). fp16's default sums in fp32 from the second
    backward on, as ``accumulate_fp32=True`` does from the first; half weights without masters sum in fp16.
    """
    g = torch.Generator().manual_seed(0)
    x = 1 + torch.randint(0, 1024, (64, 16), generator=g) / 1024  # exact in fp16: only the summation rounds
    exact = (x.double().sum(0) * 2.0**-10 / 64).unsqueeze(0)  # the gradient in fp64
    error = lambda got: ((got - exact).norm() / exact.norm()).item()
    default, fp32 = error(grad(x)), error(grad(x, accumulate_fp32=True))
    half = error(grad(x, master_weights=False))
    assert fp32 == 0.0  # every micro-batch gradient is exact in fp16, and their sum exact in fp32
    assert default == 0.0
    assert half > 1e-4  # the fp16 running sum rounds at every addition


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_workers(worker: Path, out: Path, *args: str, timeout: float = 300) -> Path:
    """Run the 2-process script ``worker`` with ``out`` and ``args`` until both ranks wrote ``out/done-rank<r>``
    (:func:`run_until_written`); fail the test with the log's tail otherwise. Returns ``out``."""
    import pytest

    out.mkdir(parents=True, exist_ok=True)
    done = [out / "done-rank0", out / "done-rank1"]
    code = run_until_written([sys.executable, str(worker), str(out), *args], done, out / "log.txt", timeout=timeout)
    if not all(f.exists() for f in done):
        pytest.fail(f"workers did not finish (exit {code}):\n{(out / 'log.txt').read_text()[-4000:]}")
    return out


def run_until_written(
    cmd: list[str],
    files: list[Path],
    log: Path,
    timeout: float = 240,
    grace: float = 20,
    env: Optional[dict[str, str]] = None,
    cwd: Optional[Path] = None,
) -> int:
    """Run a multi-process job until it has written ``files``; return its exit code (None-safe: -9 when killed).

    gloo sometimes aborts or hangs a process at exit after the work is done ("terminate called without an active
    exception"). So the job runs in its own session with its output in ``log`` (a hung worker must not hold a pipe
    open), gets ``grace`` seconds to exit once the files exist, and is then killed; the caller asserts on the files.

    A job that dies of a native crash before writing ``files`` (killed by a signal of its own, or a process's log
    says glibc or CPython found memory corrupted: torch's gloo on CPU once aborted mid-run with "double free or
    corruption" in a launch that passed three times in a row afterwards) runs once more, its first log kept beside
    ``log``; a crash that recurs fails the caller. A Python exception alone, or the timeout, is not retried.

    ``env`` is added to this process's environment (each run gets a free ``MASTER_PORT`` too); ``cwd``: where the job
    runs. A job that writes no file of its own passes a path it never writes: then it runs until it exits.
    """
    run = {"env": env or {}, "cwd": cwd}
    code, crashed = _run_once(cmd, files, log, timeout, grace, **run)
    if crashed:
        first = log.with_name(f"{log.stem}.crashed{log.suffix}")
        log.replace(first)
        print(f"run_until_written: {cmd[-1]} died of signal {-code}; once more (log: {first})", file=sys.stderr)
        code, _ = _run_once(cmd, files, log, timeout, grace, **run)
    return code


def _run_once(
    cmd: list[str], files: list[Path], log: Path, timeout: float, grace: float, env: dict[str, str], cwd: Optional[Path]
) -> tuple[int, bool]:
    """One run of :func:`run_until_written`: its exit code, and whether it died of a signal on its own before
    writing ``files``."""
    env = {**os.environ, **env, "MASTER_PORT": str(free_port())}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        deadline, written_at = time.monotonic() + timeout, None
        while proc.poll() is None and time.monotonic() < deadline:
            if written_at is None and all(f.exists() for f in files):
                written_at = time.monotonic()
            if written_at is not None and time.monotonic() - written_at > grace:
                break
            time.sleep(0.2)
        killed = proc.poll() is None
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # rank 0 dies of the signal, or sees its peer die of it (gloo: "Connection closed by peer") and exits with 1
    native = proc.returncode < 0 or any(m in log.read_text(errors="replace") for m in _NATIVE_CRASHES)
    crashed = not killed and proc.returncode != 0 and native and not all(f.exists() for f in files)
    return proc.returncode, crashed


#: what glibc and CPython print when a process dies of memory corruption or a fatal signal
_NATIVE_CRASHES = (
    "double free or corruption",
    "malloc(): ",
    "free(): invalid",
    "Segmentation fault",
    "Fatal Python error",
)
