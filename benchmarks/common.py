"""Benchmark models, their data, and the step timer that the benchmark scripts share.

Two models, one per regime (``WORKLOADS``):

* ``transformer``: a GPT-2-style decoder-only language model (pre-norm blocks, causal attention through
  ``scaled_dot_product_attention``, GELU MLP, LM head tied to the token embedding, **no dropout** unless asked
  for, as in pretraining). Compute-bound. Sizes (``GPT_SIZES``): ``tiny`` (tests and dry runs), ``small`` (the CPU
  default, 3.4M parameters) and ``gpt2`` (GPT-2 small, 124M parameters, for a GPU).
* ``deep_mlp``: 200 ``Linear(32, 32)`` + ReLU blocks, 0.21M parameters: bound by per-op and per-parameter overhead.

:func:`time_steps` trains a fresh model under one precision and returns a :class:`StepTimer`: per-step times after
a warm-up, the time of the whole timed window (on CUDA the only honest number: the device runs asynchronously), the
steps skipped for non-finite gradients while timing, and on CUDA the peak allocated memory of the timed steps.

``TransformerClassifier`` (with dropout 0.1) is the model that ``callback_overhead.py`` measured the numbers of
docs/diagnostics.md with; it is the ``classifier`` workload and not part of the speed benchmarks.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import record_function
from torch.utils.data import DataLoader, TensorDataset

# ----------------------------------------------------------------------------------------------- the transformer


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    d_model: int
    heads: int
    vocab: int
    seq: int
    batch: int


GPT_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(layers=2, d_model=32, heads=2, vocab=128, seq=16, batch=4),
    "small": GPTConfig(layers=4, d_model=256, heads=4, vocab=1024, seq=128, batch=16),
    # GPT-2 small: 12 x 768, 12 heads, context 1024; the vocabulary 50257 padded to a multiple of 64 (as nanoGPT
    # does; TensorCoreCheck asks for it), 124M parameters. 16 x 1024 tokens per step keep an H100/H200 busy.
    "gpt2": GPTConfig(layers=12, d_model=768, heads=12, vocab=50304, seq=1024, batch=16),
}


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.resid_dropout = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    """Pre-norm transformer block, as GPT-2."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * d_model, d_model),
            _dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Profiled(L.LightningModule):
    """Labels the forward and the backward for ``torch.profiler`` (``model.forward``, ``model.backward``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with record_function("model.forward"):
            return self.loss(batch)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        with record_function("model.backward"):
            super().backward(loss, *args, **kwargs)

    def loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class GPT(Profiled):
    """A GPT-2-style language model; ``GPT(GPT_SIZES["gpt2"])`` is GPT-2 small (124M parameters).

    Example::

        model = GPT(GPT_SIZES["tiny"])
        x = torch.randint(0, 128, (2, 16))
        assert model(x).shape == (2, 16, 128)
    """

    def __init__(self, config: GPTConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.d_model)
        self.wpe = nn.Embedding(config.seq, config.d_model)
        self.drop = _dropout(dropout)
        self.blocks = nn.ModuleList(Block(config.d_model, config.heads, dropout) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim > 1:
                std = 0.02 / math.sqrt(2 * config.layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def gpt_data(config: GPTConfig, batches: int, seed: int = 0) -> DataLoader:
    """``batches`` batches of random token sequences and their next tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab, (batches * config.batch, config.seq + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=config.batch)


# ----------------------------------------------------------------------------------------------- the deep MLP
class DeepMLP(Profiled):
    """``depth`` Linear(width, width) + ReLU blocks: tiny matmuls, many parameters, overhead-bound."""

    def __init__(self, depth: int = 200, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


def mlp_data(n: int, width: int = 32, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


# ------------------------------------------------------------------------------------------- callback_overhead's model
class TransformerClassifier(L.LightningModule):
    """A post-norm transformer encoder classifier with dropout: the model of ``callback_overhead.py``."""

    def __init__(
        self,
        vocab: int = 1000,
        d_model: int = 256,
        layers: int = 4,
        heads: int = 4,
        classes: int = 10,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(self.embed(x))).mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def transformer_data(n: int, seq: int = 128, vocab: int = 1000, classes: int = 10, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


# ----------------------------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """A model factory and its data: ``model()`` builds a fresh model, ``data(steps)`` a loader of ``steps`` batches."""

    name: str
    model: Callable[[], L.LightningModule]
    data: Callable[[int], DataLoader]
    description: str


def get_workload(name: str, size: str = "small", dropout: float = 0.0) -> Workload:
    """The benchmark model ``name`` (``transformer``, ``deep_mlp`` or ``classifier``); ``size`` and ``dropout``
    apply to the transformer."""
    if name == "transformer":
        c = GPT_SIZES[size]
        drop = f", dropout {dropout:g}" if dropout else ", no dropout"
        return Workload(
            name,
            lambda: GPT(c, dropout),
            lambda steps: gpt_data(c, steps),
            f"GPT-style LM, size {size}: {c.layers} layers, d_model {c.d_model}, {c.heads} heads, vocab {c.vocab}, "
            f"sequence {c.seq}, batch {c.batch}, tied embeddings{drop}, AdamW",
        )
    if name == "deep_mlp":
        return Workload(
            name, DeepMLP, lambda steps: mlp_data(16 * steps), "200 x (Linear(32, 32) + ReLU), batch 16, AdamW"
        )
    if name == "classifier":
        return Workload(
            name,
            TransformerClassifier,
            lambda steps: transformer_data(16 * steps),
            "4-layer transformer encoder classifier, d_model 256, dropout 0.1, AdamW",
        )
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


WORKLOADS = ("transformer", "deep_mlp")  # the speed benchmarks' models ("classifier" is callback_overhead.py's)


# ----------------------------------------------------------------------------------------------- timing
class StepTimer(L.Callback):
    """Times the training batches (forward, backward, optimizer step) from batch ``warmup`` on.

    * ``times``: wall seconds of each timed batch, hook to hook. On CPU their median is the step time (robust to
      the other processes of a shared machine).
    * ``window``: seconds from the start of the first timed batch to the end of the last, with one device sync at
      each end and none in between. On CUDA ``window / len(times)`` is the step time: a sync per step would hide
      how much of the host's work overlaps the device's (and favour precisions that sync anyway).
    * ``skipped``: optimizer steps skipped for non-finite gradients while timing (``MPTPrecision``'s counter, or
      the backoffs of a ``GradScaler``); a skipped step is cheaper than a real one.
    * ``peak_bytes``: on CUDA, ``torch.cuda.max_memory_allocated`` over the timed batches.
    """

    def __init__(self, warmup: int = 5, steps: Optional[int] = None) -> None:
        self.warmup = warmup
        self.steps = steps  # the index of the last batch is steps - 1; None: the window closes at train end
        self.times: list[float] = []
        self.window = 0.0
        self.skipped = 0
        self.peak_bytes: Optional[int] = None
        self._t0 = 0.0
        self._w0: Optional[float] = None
        self._skips0: Optional[float] = None
        self._cuda = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._cuda = trainer.strategy.root_device.type == "cuda"

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.warmup:
            if self._cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self._skips0 = _skip_counter(trainer)
            self._w0 = time.perf_counter()
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx < self.warmup:
            return
        self.times.append(time.perf_counter() - self._t0)
        if self.steps is not None and batch_idx == self.steps - 1:
            self._close(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._w0 is not None:  # the window did not close at the expected last batch
            self._close(trainer)

    def _close(self, trainer: L.Trainer) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        assert self._w0 is not None
        self.window = time.perf_counter() - self._w0
        self._w0 = None
        if self._cuda:
            self.peak_bytes = torch.cuda.max_memory_allocated()
        end = _skip_counter(trainer)
        if self._skips0 is not None and end is not None:
            self.skipped = int(round(end - self._skips0))

    @property
    def median(self) -> float:
        """Median seconds per timed step."""
        return statistics.median(self.times)

    @property
    def seconds_per_step(self) -> float:
        """The step time: the window's mean on CUDA, the median of the steps elsewhere."""
        if self._cuda and self.window > 0:
            return self.window / len(self.times)
        return self.median


def _skip_counter(trainer: L.Trainer) -> Optional[float]:
    """A number that grows by one per skipped step: ``MPTPrecision.skipped_steps``, or for a ``GradScaler`` the
    count of its backoffs, ``-log2(scale)`` (every skip halves the scale; growth needs 2000 clean steps)."""
    plugin = trainer.precision_plugin
    if hasattr(plugin, "skipped_steps"):
        return float(plugin.skipped_steps)
    scaler = getattr(plugin, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() and getattr(scaler, "_scale", None) is not None:
        return -math.log2(scaler.get_scale())  # one host sync, at the edges of the window only
    return None


def resolve_accelerator(accelerator: str) -> str:
    """``"cpu"`` or ``"gpu"``: ``"auto"`` picks the GPU when CUDA is available; ``"cuda"`` means ``"gpu"``."""
    if accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda":
        return "gpu"
    if accelerator == "gpu" and not torch.cuda.is_available():
        raise SystemExit("--accelerator gpu: torch.cuda.is_available() is False on this machine")
    return accelerator


def device_of(accelerator: str) -> torch.device:
    return torch.device("cuda" if resolve_accelerator(accelerator) == "gpu" else "cpu")


def time_steps(
    workload: Union[str, Workload],
    steps: int,
    precision: Optional[str] = None,
    plugin: Optional[Any] = None,
    callbacks: Optional[list[L.Callback]] = None,
    accelerator: str = "auto",
    seed: int = 0,
    warmup: int = 5,
    **trainer_kwargs: Any,
) -> StepTimer:
    """Train a fresh ``workload`` for ``steps`` optimizer steps with a Lightning precision string or a plugin;
    return the :class:`StepTimer` (median seconds per timed step in ``.median``; ``.seconds_per_step``)."""
    wl = workload if isinstance(workload, Workload) else get_workload(workload)
    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed the warm-up ({warmup})")
    L.seed_everything(seed, verbose=False)
    timer = StepTimer(warmup, steps)
    kwargs: dict[str, Any] = {
        "accelerator": accelerator,
        "devices": 1,
        "max_steps": steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": [timer, *(callbacks or [])],
    }
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    else:
        kwargs["precision"] = precision
    kwargs.update(trainer_kwargs)
    # build the model on the device it trains on: GPT-2's 124M parameters initialise in milliseconds there
    with torch.device(device_of(accelerator)):
        model = wl.model()
    trainer = L.Trainer(**kwargs)
    trainer.fit(model, wl.data(steps))
    del trainer, model
    release_memory()
    return timer


def release_memory() -> None:
    """Free what the last run left (Trainer, model and optimizer form reference cycles)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def machine(accelerator: str) -> str:
    """CPU model, cores, torch threads, torch and Lightning versions, and the GPU when one is used."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    threads = torch.get_num_threads()
    parts = []
    if resolve_accelerator(accelerator) == "gpu":
        parts.append(f"GPU {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
    parts.append(f"{cpu}, {os.cpu_count()} cores ({threads} torch thread{'s' if threads > 1 else ''})")
    parts.append(f"torch {torch.__version__}, lightning {L.__version__}")
    return ", ".join(parts)
