"""Optimizers that keep their own low-precision state step the fp32 masters exactly and keep that state's format.

Each claimed optimizer trains a tiny real model through a real ``Trainer`` under ``MPTPrecision`` and is checked for:

(a) its state keeps its own format: torchao's 8-bit and 4-bit states stay ``OptimState8bit``/``OptimState4bit``
    (int8/uint8 codes and fp32 block scales), bitsandbytes' stay ``uint8`` codes with fp32 block maxima, and
    torch-optimi's AdamW has no Kahan buffer (its Kahan summation applies to low-precision parameters only, and the
    masters are fp32);
(b) after every optimizer step the masters equal, bitwise, an independent replay: the same optimizer applied by hand
    to fp32 copies of the initial weights with the gradients recorded at each backward, unscaled in fp32 (the math
    and its order are the optimizer's own in both, so equal means bitwise); the replay's state equals the run's, code
    for code;
(c) resuming from the ``ModelCheckpoint`` file of the first epoch gives the uninterrupted run, bitwise (weights and
    optimizer state).

torchao steps each parameter through ``torch.compile``; compiling for every shape costs about a minute on a CPU, so
these tests run torchao's step eagerly (``torch.compiler.set_stance("force_eager")``: the same ops, not fused).
``LIGHTNING_MPT_TEST_COMPILE=1`` runs them compiled, as torchao ships; ``examples/memory_breakdown.py`` does too.

A package that is not installed skips its cases (``pip install -e .[dev]`` installs all three).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from models import quiet_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision

COMPILE = os.environ.get("LIGHTNING_MPT_TEST_COMPILE", "0") == "1"
QUANTIZED_MIN = 4096  # torchao and bitsandbytes quantize the state of tensors with at least this many elements


def optional(module: str) -> Any:
    """Import ``module`` or skip: an absent package, or one that fails to import on this torch (the floor's)."""
    try:
        return importlib.import_module(module)
    except Exception as err:  # torchao on an old torch fails with AttributeError as well as ImportError
        pytest.skip(f"{module} is not usable here: {type(err).__name__}: {err}")


# ---------------------------------------------------------------------------------------------------- the cases


def torchao_adamw(bits: int) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        optim = optional("torchao.optim")
        cls = optim.AdamW8bit if bits == 8 else optim.AdamW4bit
        return cls(params, lr=1e-2, weight_decay=0.1)

    return make


def torchao_state(optimizer: torch.optim.Optimizer, master: Tensor, state: dict[str, Any]) -> None:
    subclass = type(optimizer).__name__.replace("AdamW", "OptimState")  # AdamW8bit -> OptimState8bit
    for key in ("exp_avg", "exp_avg_sq"):
        v = state[key]
        if master.numel() >= QUANTIZED_MIN:
            assert type(v).__name__ == subclass, (key, type(v))
            assert v.codes.dtype == torch.uint8
            assert v.scale.dtype == torch.float32
            assert v.codes.numel() * v.codes.element_size() <= master.numel()  # 1 byte (8-bit) or half (4-bit)
        else:  # small tensors: torchao keeps a plain state, fp32 like the master it steps
            assert type(v) is Tensor
            assert v.dtype == torch.float32


def bnb_8bit(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        return getattr(optional("bitsandbytes").optim, name)(params, lr=1e-2)

    return make


def bnb_state(optimizer: torch.optim.Optimizer, master: Tensor, state: dict[str, Any]) -> None:
    quantized = master.numel() >= QUANTIZED_MIN
    for key in ("state1", "state2"):
        assert state[key].dtype == (torch.uint8 if quantized else torch.float32), key
    if quantized:
        assert state["absmax1"].dtype == state["absmax2"].dtype == torch.float32


def optimi_adamw(kahan: Optional[bool]) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        return optional("optimi").AdamW(params, lr=1e-2, weight_decay=1e-2, kahan_sum=kahan)

    return make


def optimi_state(optimizer: torch.optim.Optimizer, master: Tensor, state: dict[str, Any]) -> None:
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # Kahan summation compensates the rounding of low-precision parameters; on fp32 masters optimi allocates nothing
    assert state.get("kahan_comp") is None


@dataclass(frozen=True)
class Case:
    make: Callable[[Any], torch.optim.Optimizer]
    check_state: Callable[[torch.optim.Optimizer, Tensor, dict[str, Any]], None]
    reference: Optional[Callable[[Any], torch.optim.Optimizer]] = None  # default: ``make``
    compiled: bool = False  # steps through torch.compile (eager unless LIGHTNING_MPT_TEST_COMPILE=1)
    plugins: tuple[Any, ...] = field(default_factory=tuple)


class SubclassCheckpointIO(TorchCheckpointIO):
    """Loads checkpoints without Lightning's callable ``map_location``, which torch cannot apply to tensor subclasses
    such as torchao's optimizer states (the workaround docs/guarantees.md gives)."""

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        return super().load_checkpoint(path, map_location=None, weights_only=weights_only)


CASES = {
    "torchao-AdamW8bit": Case(torchao_adamw(8), torchao_state, compiled=True, plugins=(SubclassCheckpointIO(),)),
    "torchao-AdamW4bit": Case(torchao_adamw(4), torchao_state, compiled=True, plugins=(SubclassCheckpointIO(),)),
    "bnb-Adam8bit": Case(bnb_8bit("Adam8bit"), bnb_state),
    "bnb-AdamW8bit": Case(bnb_8bit("AdamW8bit"), bnb_state),
    "optimi-AdamW": Case(optimi_adamw(None), optimi_state),
    # Kahan on: the same steps as without it, bitwise, since the masters are fp32
    "optimi-AdamW-kahan": Case(optimi_adamw(True), optimi_state, reference=optimi_adamw(False)),
}
RUNS = [(name, "bf16") for name in CASES] + [(name, "fp16") for name in ("torchao-AdamW8bit", "bnb-Adam8bit")]


# ---------------------------------------------------------------------------------------------------- model, replay

EPOCHS, BATCHES, WIDTH = 2, 4, 64


class Net(L.LightningModule):
    """Linear(64, 128) -> LayerNorm -> ReLU -> Linear(128, 64): two weights large enough for quantized state, small
    biases and fp32 LayerNorm parameters that keep a plain one; a per-step LR schedule."""

    def __init__(self, make: Callable[[Any], torch.optim.Optimizer]) -> None:
        super().__init__()
        self.make = make
        self.net = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.LayerNorm(2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = self.make(self.parameters())
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * 16, WIDTH, generator=g)
    y = torch.tanh(x @ torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)


def flat(v: Any) -> dict[str, Any]:
    """A state value as plain parts: a tensor subclass (torchao's) by its inner tensors, codes and scales."""
    if isinstance(v, Tensor) and type(v) is not Tensor and hasattr(v, "__tensor_flatten__"):
        names, _ = v.__tensor_flatten__()
        return {n: getattr(v, n) for n in names}
    return {"": v}


def assert_state_equal(a: dict[str, Any], b: dict[str, Any], where: Any) -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        pa, pb = flat(a[key]), flat(b[key])
        assert type(a[key]) is type(b[key]), (where, key)
        assert pa.keys() == pb.keys(), (where, key)
        for part in pa:
            x, y = pa[part], pb[part]
            assert torch.equal(x, y) if isinstance(x, Tensor) else x == y, (where, key, part)


class Replay(L.Callback):
    """Records each backward's gradients and, after every optimizer step, steps its own optimizer (the case's
    reference) over fp32 copies of the initial weights and compares masters and state with the run's."""

    def __init__(self, case: Case, model: Net) -> None:
        self.case = case
        self.copies = {id(p): nn.Parameter(p.detach().clone()) for p in model.parameters()}
        self.replica = (case.reference or case.make)(list(self.copies.values()))
        self.grads: dict[int, Tensor] = {}
        self.scale = 1.0
        self.steps = 0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(lambda *_: self.check(trainer, module))

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.scale = trainer.precision_plugin.backward_scale
        self.grads = {id(p): p.grad.detach().clone() for p in module.parameters() if p.grad is not None}

    def check(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        plugin, optimizer = trainer.precision_plugin, trainer.optimizers[0]
        inv_scale = torch.tensor(1.0 / self.scale, dtype=torch.float32)
        for p in module.parameters():
            self.copies[id(p)].grad = self.grads[id(p)].float() * inv_scale  # the plugin's fused unscale: one multiply
        for group, replica_group in zip(optimizer.param_groups, self.replica.param_groups):
            lr = group["lr"]  # torchao keeps it as a tensor the scheduler fills
            replica_group["lr"] = lr.clone() if isinstance(lr, Tensor) else lr
        self.replica.step()
        for name, p in module.named_parameters():
            master, copy = plugin.master_of(p), self.copies[id(p)]
            assert master.dtype == torch.float32, name
            assert torch.equal(master, copy), (name, self.steps)  # (b)
            state = optimizer.state[master]  # the optimizer holds the masters during its step
            self.case.check_state(optimizer, master, state)  # (a)
            assert_state_equal(state, self.replica.state[copy], (name, self.steps))
        self.steps += 1


@contextlib.contextmanager
def stance(case: Case) -> Iterator[None]:
    if case.compiled and not COMPILE:
        with torch.compiler.set_stance("force_eager"):
            yield
    else:
        yield


def fit(case: Case, precision: str, root: Path, ckpt: Optional[Path] = None, replay: bool = True) -> tuple[Net, Any]:
    torch.manual_seed(0)
    model = Net(case.make)
    callbacks: list[L.Callback] = [ModelCheckpoint(dirpath=root, save_top_k=-1, filename="{epoch}")]
    check = Replay(case, model) if replay else None
    callbacks += [check] if check is not None else []
    trainer = quiet_trainer(
        max_epochs=EPOCHS,
        plugins=[MPTPrecision(precision), *case.plugins],  # type: ignore[arg-type]
        callbacks=callbacks,
        enable_checkpointing=True,
    )
    with stance(case):
        trainer.fit(model, data(), ckpt_path=ckpt)
    if check is not None:
        plugin = trainer.precision_plugin
        assert check.steps == sum(not r.skipped for r in plugin.history) >= EPOCHS * BATCHES - 2
    return model, trainer


def final_state(trainer: L.Trainer, model: Net) -> dict[str, dict[str, Any]]:
    optimizer = trainer.optimizers[0]
    return {name: optimizer.state[p] for name, p in model.named_parameters()}


@pytest.mark.parametrize(("name", "precision"), RUNS, ids=[f"{n}-{p}" for n, p in RUNS])
def test_low_precision_state_steps_the_masters_exactly_and_resumes_bitwise(
    tmp_path: Path, name: str, precision: str
) -> None:
    case = CASES[name]
    model, trainer = fit(case, precision, tmp_path / "straight")  # (a) and (b) at every step
    assert all(p.dtype == torch.float32 for p in model.parameters())  # after fit: the masters, fp32

    resumed, resumed_trainer = fit(case, precision, tmp_path / "resumed", tmp_path / "straight" / "epoch=0.ckpt", False)
    assert resumed_trainer.global_step == trainer.global_step == EPOCHS * BATCHES
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):  # (c)
        assert torch.equal(a, b), n
    straight_state, resumed_state = final_state(trainer, model), final_state(resumed_trainer, resumed)
    for n in straight_state:
        assert_state_equal(straight_state[n], resumed_state[n], n)


@pytest.mark.xfail(
    raises=RuntimeError,
    strict=True,
    reason="upstream: Lightning's TorchCheckpointIO loads with a callable map_location, which torch cannot apply to "
    "tensor subclasses such as torchao's optimizer states (under any precision); SubclassCheckpointIO works around it",
)
def test_torchao_state_resumes_through_lightnings_default_checkpoint_io(tmp_path: Path) -> None:
    case = Case(torchao_adamw(8), torchao_state, compiled=True)
    fit(case, "bf16", tmp_path / "straight", replay=False)
    fit(case, "bf16", tmp_path / "resumed", tmp_path / "straight" / "epoch=0.ckpt", replay=False)


def test_torchao_low_bit_adam_steps_in_chunks_as_one_whole_step() -> None:
    """torchao's AdamW8bit updates each parameter from that parameter's own state and its group's hyper-parameters,
    so stepping a chunk at a time (the masters stored as 16-bit remainders: 8 bytes per parameter at the step) changes
    no operation: the weights and the 8-bit state equal the whole step's, bitwise. Both runs round the half weights
    alike (ties away from zero), so their forwards are the same too."""
    optional("torchao.optim")
    runs = []
    for chunk in (2 * WIDTH * WIDTH, False):  # a chunk holds one weight: four optimizer.step() calls per step
        torch.manual_seed(0)
        model = Net(torchao_adamw(8))
        calls = []
        trainer = quiet_trainer(
            max_epochs=1, plugins=[MPTPrecision("bf16", master_remainders=True, chunked_step=chunk)]
        )
        model.on_train_start = lambda: trainer.optimizers[0].register_step_post_hook(lambda *_: calls.append(1))
        with torch.compiler.set_stance("force_eager"):
            trainer.fit(model, data())
        runs.append((model, final_state(trainer, model), len(calls)))
    (chunked, chunked_state, chunked_calls), (whole, whole_state, whole_calls) = runs
    assert whole_calls == BATCHES
    assert chunked_calls > BATCHES
    for (name, a), b in zip(chunked.named_parameters(), whole.parameters()):
        assert torch.equal(a, b), name
    for name in whole_state:
        assert_state_equal(chunked_state[name], whole_state[name], name)
    torchao_state(trainer.optimizers[0], chunked.net[0].weight, chunked_state["net.0.weight"])


class Forwards(L.Callback):
    """The half weights each forward sees, and the masters they were rounded from (and the last step's masters)."""

    def __init__(self) -> None:
        self.halves: list[dict[str, Tensor]] = []
        self.masters: list[dict[str, Tensor]] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.halves.append({n: p.detach().clone() for n, p in module.named_parameters()})
        self.on_train_end(trainer, module)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        plugin = trainer.precision_plugin
        self.masters.append({n: plugin.master_of(p).detach().clone() for n, p in module.named_parameters()})


def ties(master: Tensor) -> Tensor:
    """Where rounding ``master`` to bf16 ties away from zero differs from torch's ties to even: low 16 bits of 0x8000
    under an even top half."""
    bits = master.view(torch.int32)
    return ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) & 1 == 0)


def remainder_run_against_plain(
    make: Callable[[Any], torch.optim.Optimizer], chunked: bool, init: Callable[[Net], None]
) -> tuple[Forwards, Forwards]:
    runs = []
    for remainders in (False, True):
        torch.manual_seed(0)
        model = Net(make)
        with torch.no_grad():
            init(model)
        forwards = Forwards()
        plugin = MPTPrecision("bf16", master_remainders=remainders, chunked_step=chunked and 2 * WIDTH * WIDTH)
        trainer = quiet_trainer(max_epochs=EPOCHS, plugins=[plugin], callbacks=[forwards])
        with torch.compiler.set_stance("force_eager"):
            trainer.fit(model, data())
        runs.append(forwards)
    return runs[0], runs[1]


def untie(model: Net) -> None:
    """Move every initial weight that is a tie one fp32 step away from it."""
    for p in model.parameters():
        bits = p.view(torch.int32)
        bits[(bits & 0xFFFF) == 0x8000] += 1


def plant_tie(model: Net) -> None:
    """Set one weight to a tie: (1 + 2**-8) / 32 lies halfway between two bf16 values, the lower one even."""
    model.net[0].weight[0, 0] = (1 + 2.0**-8) / 32


@pytest.mark.parametrize("init", [untie, plant_tie])
@pytest.mark.parametrize(
    ("make", "chunked"),
    [(lambda params: torch.optim.AdamW(params, lr=1e-2), False), (torchao_adamw(8), False), (torchao_adamw(8), True)],
    ids=["torch-AdamW", "torchao-AdamW8bit", "torchao-AdamW8bit-chunked"],
)
def test_master_remainders_change_a_run_through_ties_only(
    make: Callable[[Any], torch.optim.Optimizer], chunked: bool, init: Callable[[Net], None]
) -> None:
    """``master_remainders=True`` rounds the half weights ties away from zero, torch's cast ties to even: the two
    differ exactly where a master's low 16 bits are 0x8000 under an even top half. Whatever the optimizer, a remainder
    run's masters equal a plain run's, bitwise, up to the first forward whose half weights differ (to the end when
    there is none), and those weights differ exactly at such ties; from then on the forwards differ, and so can the
    trajectories. torch's default ``nn.Linear`` initialisation (``uniform_``, 24 random bits) makes about 15 weights
    in 65,536 ties, against 1 for values with random low bits: one run moves them off, the other plants one."""
    plain, remainders = remainder_run_against_plain(make, chunked, init)
    steps = len(plain.halves)
    differ = [{n: plain.halves[s][n] != remainders.halves[s][n] for n in plain.halves[s]} for s in range(steps)]
    first = next((s for s in range(steps) if any(d.any() for d in differ[s].values())), None)
    for s in range(steps + 1 if first is None else first + 1):  # the same masters until then
        for n in plain.masters[s]:
            assert torch.equal(plain.masters[s][n], remainders.masters[s][n]), (n, s)
    if init is plant_tie:
        assert first == 0
    if first is not None:
        for n, master in plain.masters[first].items():
            half = plain.halves[first][n].dtype == torch.bfloat16  # LayerNorm's parameters are fp32 in both runs
            assert torch.equal(differ[first][n], ties(master) if half else torch.zeros_like(differ[first][n])), n
