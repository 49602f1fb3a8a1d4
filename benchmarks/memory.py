"""Bytes per parameter at the optimizer step and at the step's peak, for every precision and optimizer, side by side.

    python benchmarks/memory.py --batch 1        # every mode, benchmark transformer (3.45M parameters), ~5 min on CPU
    python benchmarks/memory.py --fast           # a 1-layer transformer, a few seconds (what the tests run)
    python benchmarks/memory.py --loss           # and the held-out loss against "32-true" over seeds (minutes)
    python benchmarks/memory.py --modes 32-true mpt-bf16 "mpt-bf16 + torchao AdamW8bit"

The modes are the table :data:`MODES`: a precision (Lightning's own or an ``MPTPrecision``) and an optimizer. Add a
mode by adding a row. A mode whose package is missing (torchao, torch-optimi, bitsandbytes) is left out with a note.

**At the step** is what :class:`MemoryProbe` (``examples/memory_breakdown.py``) counts at ``on_before_optimizer_step``
of a late step, when the optimizer's state exists: the module's weights and gradients, the plugin's fp32 masters and
their gradients, and the optimizer's state, each storage once. A tensor subclass counts by the tensors inside it
(torchao's 8-bit state shows as fp32 and holds one byte per value plus fp32 block scales).

**The peak** is the most bytes held at any moment from the end of that step's backward (``on_after_backward``) to
the end of its optimizer step (``on_train_batch_end``): the precision plugin's work (copy to fp32, unscale, refresh of
the half weights) and the optimizer's, temporaries included. :class:`StepPeak` counts the step's starting state as
above, then replays the CPU allocator's own events (``torch.profiler`` with ``profile_memory=True``, turned on at
the start of the step before, so that what the step frees, allocated by the backward or by the step before, is known
to it): every allocation in the window adds its
bytes, the free of a block allocated in the window or of a tensor of the starting state subtracts them. Frees of
other tensors (the batch's logits) are left out, so the peak is not understated by what the step did not hold. On
CUDA the window's ``torch.cuda.max_memory_allocated`` is reported as well.

torchao steps each parameter through ``torch.compile``. On a CPU that costs minutes of compilation per model, so
this script runs its step eagerly unless ``--compile`` is given (the same arithmetic in unfused ops: the peak then
includes the fp32 temporaries of the largest parameter, which compiled code fuses away).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
from common import GPT, GPT_SIZES, GPTConfig, gpt_data  # noqa: E402
from memory_breakdown import MemoryProbe  # noqa: E402
from tensor_bytes import master_tensors, nbytes, parts, storage  # noqa: E402

from lightning_mpt import MPTPrecision  # noqa: E402

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}  # every optimizer: the same AdamW

OPTIMIZERS: dict[str, tuple[str, Callable[[Any, dict[str, Any]], torch.optim.Optimizer]]] = {
    # name: (the module it needs, factory(params, hyper-parameters))
    "AdamW": ("torch", lambda p, h: torch.optim.AdamW(p, **h)),
    "torchao AdamW8bit": ("torchao.optim", lambda p, h: importlib.import_module("torchao.optim").AdamW8bit(p, **h)),
    "torchao AdamW4bit": ("torchao.optim", lambda p, h: importlib.import_module("torchao.optim").AdamW4bit(p, **h)),
    # one fp32 scale per 2048 values instead of 256: 0.004 bytes per parameter of scales instead of 0.03
    "torchao AdamW8bit block 2048": (
        "torchao.optim",
        lambda p, h: importlib.import_module("torchao.optim").AdamW8bit(p, **h, block_size=2048),
    ),
    "torchao _AdamW bf16 SR": (
        "torchao.optim",
        lambda p, h: importlib.import_module("torchao.optim")._AdamW(p, **h, bf16_stochastic_round=True),
    ),
    "bnb AdamW8bit": ("bitsandbytes", lambda p, h: importlib.import_module("bitsandbytes").optim.AdamW8bit(p, **h)),
    "optimi AdamW": ("optimi", lambda p, h: importlib.import_module("optimi").AdamW(p, **h, kahan_sum=False)),
    "optimi AdamW Kahan": ("optimi", lambda p, h: importlib.import_module("optimi").AdamW(p, **h, kahan_sum=True)),
}


@dataclass(frozen=True)
class Mode:
    """One row: a precision and an optimizer.

    Args:
        name: the row's name.
        trainer: the Trainer's precision keyword arguments (``precision=...`` or ``plugins=[...]``), made fresh.
        optimizer: a key of :data:`OPTIMIZERS`.
        half_cpu: runs in fp16 arithmetic, which CPUs do slowly (left out of ``--loss`` on a CPU).

    Example::

        Mode("mpt-bf16 + my optimizer", lambda: {"plugins": [MPTPrecision("bf16")]}, "my optimizer")
    """

    name: str
    trainer: Callable[[], dict[str, Any]]
    optimizer: str = "AdamW"
    half_cpu: bool = False


def _fp16_amp() -> Any:
    from lightning.pytorch.plugins import MixedPrecision

    return MixedPrecision("16-mixed", "cuda" if torch.cuda.is_available() else "cpu")


def _mpt(**kwargs: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {"plugins": [MPTPrecision(**kwargs)]}


# the defaults: bf16 keeps its masters as 16-bit remainders, stepped in chunks of 2**24 elements; fp16 keeps 4-byte
# masters and takes the whole step. The other rows turn options on or off against them.
OLD_BF16 = {"master_remainders": False, "chunked_step": False}  # 4-byte masters, the whole step (before 0.4)
MODES: list[Mode] = [
    Mode("32-true", lambda: {"precision": "32-true"}),
    Mode("bf16-mixed", lambda: {"precision": "bf16-mixed"}),
    # fp16 autocast and torch's GradScaler on any device (Lightning maps "16-mixed" to bf16 on a CPU)
    Mode("16-mixed", lambda: {"plugins": [_fp16_amp()]}, half_cpu=True),
    Mode("bf16-true", lambda: {"precision": "bf16-true"}),
    Mode("mpt-fp16", _mpt(precision="fp16"), half_cpu=True),
    Mode("mpt-bf16", _mpt(precision="bf16")),
    Mode("mpt-bf16 chunked_step=2**18", _mpt(precision="bf16", chunked_step=2**18)),
    Mode("mpt-bf16 master_remainders=False", _mpt(precision="bf16", master_remainders=False)),
    Mode("mpt-bf16 4-byte masters, whole step", _mpt(precision="bf16", **OLD_BF16)),
    Mode("mpt-bf16 master_weights=False", _mpt(precision="bf16", master_weights=False)),
    Mode("mpt-bf16 accumulate_fp32", _mpt(precision="bf16", accumulate_fp32=True)),
    Mode("mpt-fp16 chunked_step=True", _mpt(precision="fp16", chunked_step=True), half_cpu=True),
    Mode("mpt-fp16 chunked_step=2**18", _mpt(precision="fp16", chunked_step=2**18), half_cpu=True),
    Mode("bf16-true + optimi AdamW Kahan", lambda: {"precision": "bf16-true"}, "optimi AdamW Kahan"),
    # optimi's AdamW in fp32: the reference that separates its algorithm from Kahan summation in the held-out loss
    Mode("32-true + optimi AdamW", lambda: {"precision": "32-true"}, "optimi AdamW"),
    Mode("bf16-true + torchao _AdamW bf16 SR", lambda: {"precision": "bf16-true"}, "torchao _AdamW bf16 SR"),
    Mode("mpt-bf16 + torchao AdamW8bit", _mpt(precision="bf16"), "torchao AdamW8bit"),
    Mode("mpt-bf16 + torchao AdamW4bit", _mpt(precision="bf16"), "torchao AdamW4bit"),
    Mode(
        "mpt-bf16 chunked_step=2**18 + torchao AdamW8bit block 2048",
        _mpt(precision="bf16", chunked_step=2**18),
        "torchao AdamW8bit block 2048",
    ),
    Mode("mpt-bf16 4-byte masters + torchao AdamW8bit", _mpt(precision="bf16", **OLD_BF16), "torchao AdamW8bit"),
    Mode("mpt-bf16 + bnb AdamW8bit", _mpt(precision="bf16"), "bnb AdamW8bit"),
    Mode("mpt-bf16 + optimi AdamW", _mpt(precision="bf16"), "optimi AdamW"),
]
FAST = GPTConfig(layers=1, d_model=64, heads=2, vocab=128, seq=16, batch=4)  # 2-D weights >= 4096: quantized state


def available(mode: Mode) -> Optional[str]:
    """``None`` when ``mode`` can run here, else why not (its optimizer's package does not import).

    Args:
        mode: a row of :data:`MODES`.

    Example::

        assert available(MODES[0]) is None
    """
    module = OPTIMIZERS[mode.optimizer][0]
    try:
        importlib.import_module(module)
    except Exception as err:  # ImportError, or a package built for another torch
        return f"{module}: {type(err).__name__}: {err}"
    return None


class LM(GPT):
    """The benchmark transformer with a mode's optimizer and a warm-up + cosine schedule to ``final`` of the peak LR.

    Args:
        config: its size.
        optimizer: a key of :data:`OPTIMIZERS`.
        steps: the schedule's length.
        lr: the peak learning rate.
        final: the schedule's last LR as a fraction of ``lr``.

    Example::

        model = LM(GPT_SIZES["tiny"], "AdamW", steps=10)
    """

    def __init__(self, config: GPTConfig, optimizer: str, steps: int, lr: float = 1e-3, final: float = 0.01) -> None:
        super().__init__(config)
        self.optimizer_name, self.steps, self.lr, self.final = optimizer, steps, lr, final

    def configure_optimizers(self) -> Any:
        optimizer = OPTIMIZERS[self.optimizer_name][1](self.parameters(), {**HYPER, "lr": self.lr})
        warmup = max(1, self.steps // 20)

        def factor(step: int) -> float:  # linear warm-up, then cosine from 1 to ``final``
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, self.steps - warmup))
            return self.final + (1 - self.final) * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch  # the loss in fp32 whatever the precision: a bf16 loss is rounded to 2^-6 near 3 nats (0.5%)
        logits = self(x).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("val_loss", loss, on_epoch=True, batch_size=batch[0].shape[0])
        return loss


class StepPeak(L.Callback):
    """The most bytes held during one optimizer step (``at_step``): its starting state plus what it allocates.

    After the step ``result`` holds ``start`` (bytes of the step's state at ``on_after_backward``), ``peak`` and
    ``end`` (at ``on_train_batch_end``), and on CUDA ``cuda_peak``. The module docstring gives the method.

    Args:
        at_step: the ``trainer.global_step`` of the step to measure (a late one: the optimizer's state exists).

    Example::

        peak = StepPeak(at_step=2)
        L.Trainer(max_steps=3, callbacks=[peak]).fit(model, data)
        print(peak.result["peak"] / peak.result["params"])
    """

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.result: dict[str, int] = {}
        self._profiler: Optional[torch.profiler.profile] = None
        self._window: Optional[torch.profiler.record_function] = None
        self._start: dict[int, int] = {}  # storage addresses of the state at the window's start

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # a step early: the profiler reports the free of a block only if it saw its allocation, and the step frees
        # what the previous one allocated (the 16-bit remainders of MPTPrecision(master_remainders=True))
        if trainer.global_step == max(self.at_step - 1, 0) and self._profiler is None:
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            self._profiler.__enter__()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profiler is None or self._window is not None or trainer.global_step != self.at_step:
            return
        tensors = state_tensors(trainer, pl_module)
        self._start = {storage(part): 0 for t in tensors for part in parts(t)}  # what a free in the window may be
        self.result = {"params": sum(p.numel() for p in pl_module.parameters()), "start": nbytes(tensors, set())}
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._window = torch.profiler.record_function("memory.step_window")
        self._window.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._profiler is None or self._window is None:
            return
        self._window.__exit__(None, None, None)
        self._profiler.__exit__(None, None, None)
        peak, end = window_peak(self._profiler, dict(self._start))
        self.result.update(peak=self.result["start"] + peak, end=self.result["start"] + end)
        if torch.cuda.is_available():
            self.result["cuda_peak"] = torch.cuda.max_memory_allocated()
        self._profiler = self._window = None


def state_tensors(trainer: L.Trainer, module: L.LightningModule) -> list[Tensor]:
    """The tensors a step starts from: weights, gradients, the plugin's masters and theirs, the optimizers' state."""
    params = list(module.parameters())
    ids = {id(p) for p in params}
    masters = [
        m for opt in trainer.optimizers for m in master_tensors(trainer.precision_plugin, opt) if id(m) not in ids
    ]
    state = [v for opt in trainer.optimizers for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    grads = [t.grad for t in params + masters if t.grad is not None]
    return params + masters + grads + state


def _walk(events: list[Any]) -> Iterator[Any]:
    for e in events:
        yield e
        yield from _walk(e.children)


def window_peak(profiler: torch.profiler.profile, start: dict[int, int]) -> tuple[int, int]:
    """The largest and the last change of the bytes held, relative to the window's start, from the CPU allocator's
    events inside the ``memory.step_window`` range of ``profiler``; ``start``: storage address -> bytes of the
    window's starting state (their frees count)."""
    from torch._C._profiler import _EventType  # the profiler's event tree: private, stable since torch 2.0

    tree = list(_walk(profiler.profiler.kineto_results.experimental_event_tree()))  # type: ignore[union-attr]
    window = next(e for e in tree if e.name == "memory.step_window")
    begin, finish = window.start_time_ns, window.end_time_ns
    allocs = sorted(
        (e for e in tree if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"),
        key=lambda e: e.start_time_ns,
    )
    inside: set[int] = set()
    held = peak = 0
    for e in allocs:
        ptr, size = e.extra_fields.ptr, e.extra_fields.alloc_size
        if not begin <= e.start_time_ns <= finish:
            continue
        if size > 0:
            inside.add(ptr)
            held += size
        elif ptr in inside:
            inside.discard(ptr)
            held += size
        elif ptr in start:  # a tensor of the starting state, freed (the half gradients); other frees were not counted
            del start[ptr]
            held += size
        peak = max(peak, held)
    return peak, held


@contextlib.contextmanager
def torchao_stance(compile_steps: bool) -> Iterator[None]:
    """torchao's compiled step, or the same ops eagerly (``compile_steps=False``)."""
    if compile_steps:
        yield
    else:
        with torch.compiler.set_stance("force_eager"):
            yield


def measure(mode: Mode, config: GPTConfig, steps: int, accelerator: str, compile_steps: bool) -> dict[str, int]:
    """Train ``mode`` for ``steps`` steps; bytes at the last step (:class:`MemoryProbe`) and its peak
    (:class:`StepPeak`)."""
    L.seed_everything(0, verbose=False)
    probe, peak = MemoryProbe(at_step=steps - 1), StepPeak(at_step=steps - 1)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe, peak],
        **mode.trainer(),
    )
    with torchao_stance(compile_steps):
        trainer.fit(LM(config, mode.optimizer, steps), gpt_data(config, steps))
    return {**probe.result, **{f"peak_{k}": v for k, v in peak.result.items() if k != "params"}}


KINDS = ("weights", "masters", "grads", "master_grads", "optimizer_state")


def format_table(results: dict[str, dict[str, int]]) -> str:
    """Markdown: bytes per parameter of each kind at the step, their total, and the step's peak."""
    cuda = all("peak_cuda_peak" in r for r in results.values())
    head = (
        "| mode | weights | fp32 masters | grads | master grads | optimizer state | at the step B/param "
        "| peak of the step B/param |" + (" CUDA peak MiB |" if cuda else "")
    )
    lines = [head, "|---|" + "--:|" * (head.count("|") - 2)]
    for name, r in results.items():
        n = r["params"]
        kinds = [r[k] / n for k in KINDS]
        cells = [f"{v:.2f}" for v in kinds] + [f"{sum(kinds):.2f}", f"{r['peak_peak'] / n:.2f}"]
        cells += [f"{r['peak_cuda_peak'] / 2**20:.1f}"] if cuda else []
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Measure every available mode; print the memory table (and with ``--loss`` the held-out loss table)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fast", action="store_true", help="a 1-layer transformer, 3 steps: a few seconds")
    p.add_argument("--size", choices=list(GPT_SIZES), default="small", help="the benchmark transformer's size")
    p.add_argument("--steps", type=int, default=3, help="steps per memory run; the last one is measured")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="batch size (default: the size's); bytes per parameter of "
        "the step do not depend on it, the time does (a CPU without bf16 arithmetic: try 1)",
    )
    p.add_argument("--modes", nargs="+", default=None, help="rows of MODES (default: all)")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--compile", action="store_true", help="torchao's step compiled, as it ships (minutes on a CPU)")
    p.add_argument("--loss", action="store_true", help="also the held-out loss against 32-true (heldout_loss.py)")
    p.add_argument("--seeds", type=int, default=3, help="--loss: seeds per mode")
    p.add_argument("--loss-steps", type=int, default=300, help="--loss: training steps per run")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared CPU)")
    args = p.parse_args(argv)
    by_name = {m.name: m for m in MODES}
    unknown = set(args.modes or []) - by_name.keys()
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; the table has {list(by_name)}")
    modes = [by_name[n] for n in args.modes] if args.modes else MODES
    missing = {m.name: why for m in modes if (why := available(m)) is not None}
    modes = [m for m in modes if m.name not in missing]
    config = FAST if args.fast else GPT_SIZES[args.size]
    config = dataclasses.replace(config, batch=args.batch or config.batch)
    torch.set_num_threads(args.threads)
    results = {m.name: measure(m, config, args.steps, args.accelerator, args.compile) for m in modes}
    n = next(iter(results.values()))["params"]
    print(f"memory: transformer {config}, {n} parameters, AdamW hyper-parameters {HYPER}, step {args.steps}")
    print(format_table(results))
    for name, why in missing.items():
        print(f"left out: {name} ({why})")
    out: dict[str, Any] = {"memory": results, "missing": missing}
    if args.loss:
        import heldout_loss

        loss_modes = [m for m in modes if not (m.half_cpu and args.accelerator == "cpu")]
        out["loss"] = heldout_loss.run(loss_modes, args, LM, torchao_stance)
        print(heldout_loss.format_table(out["loss"], args))
    return out


if __name__ == "__main__":
    main()
