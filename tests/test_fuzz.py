"""Differential fuzz test: Hypothesis draws a Lightning training setup, a real ``Trainer`` runs it under
``MPTPrecision``, and every optimizer step is checked against an independent fp32 replay.

The space: SGD (plain, momentum + weight decay), Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, each default,
foreach or fused where the CPU supports it; automatic optimization with ``accumulate_grad_batches`` 1-4, or manual
optimization with one or two optimizers, each step maybe followed by a second one without a backward (with or without
``zero_grad`` between them); clipping none, by norm or by value; two parameter groups; frozen and unused parameters;
tied weights; a per-step LR scheduler; overflows injected into random micro-batches; fp16 with a dynamic or a static
scale, or bf16 (its masters maybe stored as 16-bit remainders); checkpoint and resume at a random epoch boundary.

The replay is the test's own: it records each micro-batch's half gradients as ``on_after_backward`` sees them (the
scaled values the plugin will read), unscales them by multiplying by ``1/scale`` in fp32, clips them with torch's
own functions, and steps the same torch optimizer over fp32 copies of the initial weights. A step taken again with no
backward in between steps the replay again with the gradients it used last (as under "32-true"), or with none after
``zero_grad``. Parameters frozen when the model is converted have no master: they hold the replay's values rounded to
the half format. Invariants:

(i) after every optimizer step, the masters equal the replay, bitwise;
(ii) the half weights equal the rounded masters (with 16-bit remainders: rounded with ties away from zero);
(iii) a skipped step changes nothing (weights, masters, optimizer state), and LR schedulers step as under Lightning's
     "16-mixed" (skipped steps included);
(iv) after fit the module is fp32 and equals the replay;
(v) every value of a checkpoint's ``state_dict`` is fp32 and equals its master;
(vi) resume from a checkpoint equals the uninterrupted run, bitwise.

``FUZZ_EXAMPLES`` sets the number of examples (150 in the suite, derandomized so CI is reproducible; ``make fuzz``
runs 2000 with fresh randomness). A quarter as many run again on torch < 2.13's path (the hooks see half copies of
the fp32 master gradients), which this torch takes when its feature flag says so."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import InjectInf, quiet_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import DynamicLossScaler, MPTPrecision, _compat
from lightning_mpt.core.masters.remainders import split

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
RANDOM = os.environ.get("FUZZ_RANDOM", "0") == "1"
EPOCHS, BATCHES, VOCAB, DIM = 3, 4, 12, 8
CHUNK = 100  # elements per chunk of a chunked step: the embedding, the head and each (weight, bias) apart

OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict[str, Any], tuple[str, ...]]] = {
    # name: (class, hyper-parameters, variants the CPU supports)
    "sgd": (torch.optim.SGD, {"lr": 0.1}, ("default", "foreach", "fused")),
    "sgd_momentum": (
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2},
        ("default", "foreach", "fused"),
    ),
    "adam": (torch.optim.Adam, {"lr": 1e-2}, ("default", "foreach", "fused")),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, ("default", "foreach", "fused")),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}, ("default", "foreach", "fused")),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5}, ("default", "foreach")),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}, ("default", "foreach")),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}, ("default", "foreach")),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}, ("default", "foreach")),
}


@dataclass(frozen=True)
class Setup:
    optimizer: str
    variant: str
    mode: str  # "auto", "manual1", "manual2"
    accumulate: int
    clip: Optional[tuple[str, float]]
    groups: bool
    frozen: bool
    unused: bool
    tied: bool
    scheduler: bool
    overflows: frozenset[int]  # batch indices (within each epoch) whose gradients get an inf
    resume_epoch: Optional[int]  # resume from the checkpoint written at the end of this epoch
    precision: str  # "fp16-dynamic", "fp16-static", "bf16"
    seed: int
    again: Optional[str] = None  # manual optimization: after each step, "step" again, or "zero_grad" then step again
    chunked: bool = False  # MPTPrecision(chunked_step=...): the masters stepped a few tensors at a time
    remainders: bool = False  # bf16: MPTPrecision(master_remainders=True), the masters stored as 16-bit remainders

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        cls, hyper, _ = OPTIMIZERS[self.optimizer]
        extra = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[self.variant]
        return cls(params, **hyper, **extra)

    @property
    def plugin_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float16

    def plugin(self) -> MPTPrecision:
        chunk = CHUNK if self.chunked else False
        if self.precision == "bf16":
            return MPTPrecision("bf16", chunked_step=chunk, master_remainders=self.remainders)
        if self.precision == "fp16-static":
            return MPTPrecision("fp16", scaler=2.0**6, chunked_step=chunk)
        scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
        return MPTPrecision("fp16", scaler=scaler, chunked_step=chunk)


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    name = draw(st.sampled_from(sorted(OPTIMIZERS)))
    mode = draw(st.sampled_from(["auto", "manual1", "manual2"]))
    return Setup(
        optimizer=name,
        variant=draw(st.sampled_from(OPTIMIZERS[name][2])),
        mode=mode,
        accumulate=draw(st.integers(1, 4)) if mode == "auto" else 1,
        clip=draw(st.sampled_from([None, ("norm", 0.5), ("norm", 1e-3), ("value", 0.02)])),
        groups=draw(st.booleans()) and mode != "manual2",
        frozen=draw(st.booleans()),
        unused=draw(st.booleans()),
        tied=draw(st.booleans()),
        scheduler=draw(st.booleans()),
        overflows=frozenset(draw(st.sets(st.integers(0, BATCHES - 1), max_size=2))),
        resume_epoch=draw(st.sampled_from([None, None, 0, 1])),
        precision=draw(st.sampled_from(["fp16-dynamic", "fp16-static", "bf16"])),
        seed=draw(st.integers(0, 2**16)),
        again=draw(st.sampled_from([None, "step", "zero_grad"])) if mode != "auto" else None,
        chunked=draw(st.booleans()),
        remainders=draw(st.booleans()),
    )


class FuzzModel(L.LightningModule):
    """A tiny language model: embedding, a linear mix plus a (maybe frozen) side branch, LayerNorm, output head
    (maybe tied to the embedding), and maybe an unused layer."""

    def __init__(self, setup: Setup) -> None:
        super().__init__()
        self.setup_ = setup
        self.automatic_optimization = setup.mode == "auto"
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.side = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if setup.tied:
            self.head.weight = self.emb.weight
        if setup.frozen:
            self.side.requires_grad_(False)
        self.unused = nn.Linear(DIM, DIM) if setup.unused else None

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        h = self.emb(x)
        h = self.norm(torch.relu(self.mix(h) + self.side(h)))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> Optional[Tensor]:
        if self.automatic_optimization:
            return self.loss(batch)
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        schedulers = self.lr_schedulers()
        schedulers = [] if schedulers is None else schedulers if isinstance(schedulers, list) else [schedulers]
        for opt in optimizers:
            opt.zero_grad()
            self.manual_backward(self.loss(batch))
            if self.setup_.clip is not None:
                algorithm, value = self.setup_.clip
                self.clip_gradients(opt, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
            opt.step()
            if self.setup_.again == "zero_grad":
                opt.zero_grad()
            if self.setup_.again is not None:
                opt.step()
        for scheduler in schedulers:
            scheduler.step()
        return None

    def param_sets(self) -> list[list[nn.Parameter]]:
        """The parameters of each optimizer (one set, or two disjoint sets for two optimizers)."""
        first = [self.emb.weight, self.mix.weight, self.mix.bias]
        rest = [p for p in self.parameters() if all(p is not q for q in first)]
        return [first, rest] if self.setup_.mode == "manual2" else [first + rest]

    def configure_optimizers(self) -> Any:
        optimizers = [self.setup_.make_optimizer(param_groups(self.setup_, ps)) for ps in self.param_sets()]
        if not self.setup_.scheduler:
            return optimizers
        schedulers = [
            {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9), "interval": "step"}
            for opt in optimizers
        ]
        return optimizers, schedulers


def param_groups(setup: Setup, params: list[Any]) -> Any:
    if not setup.groups:
        return params
    lr = OPTIMIZERS[setup.optimizer][1]["lr"]
    return [{"params": params[:3]}, {"params": params[3:], "lr": lr / 2}]


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCHES * 4, 5), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, 1, dims=1)), batch_size=4, shuffle=False)


class Replay(L.Callback):
    """Records the half gradients of each backward and checks every optimizer step against the fp32 replay."""

    def __init__(self, setup: Setup, model: FuzzModel) -> None:
        self.setup = setup
        # the replay's own fp32 copies of the initial weights, shared like the module's (tied weights: one copy)
        copies: dict[int, nn.Parameter] = {}
        for p in model.parameters():
            copies[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        self.copy_of = copies
        self.replicas = [
            setup.make_optimizer(param_groups(setup, [copies[id(p)] for p in ps])) for ps in model.param_sets()
        ]
        self.grads: dict[int, Tensor] = {}  # id(param) -> half gradient after the latest backward
        self.scale = 1.0
        self.steps_checked = 0
        self.backwards = 0
        self.backwards_at_step: dict[int, int] = {}  # optimizer index -> backwards counted at its latest step
        self.replayed: dict[int, bool] = {}  # optimizer index -> its step was replayed (a chunked step: once)
        self.repeat: dict[int, bool] = {}  # optimizer index -> its latest step came with no backward since the last
        self.attempts: dict[int, int] = {}  # optimizer index -> its step attempts (skipped included, repeats not)
        # per step attempt: (optimizer index, its earlier attempts (repeats not counted), the lrs in force)
        self.lrs_seen: list[tuple[int, int, list[float]]] = []
        self.before: dict[int, Any] = {}  # optimizer index -> snapshot before its step
        self.history_len = 0
        self.epoch_masters: dict[int, dict[str, Tensor]] = {}

    # -------------------------------------------------------------- recording
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for i, opt in enumerate(trainer.optimizers):
            opt.register_step_post_hook(lambda opt, args, kwargs, i=i: self.check_step(trainer, module, i))

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.scale = trainer.precision_plugin.backward_scale
        self.grads = {id(p): p.grad.detach().clone() for p in module.parameters() if p.grad is not None}
        self.backwards += 1

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        index = trainer.optimizers.index(optimizer)
        repeat = self.repeat[index] = self.backwards_at_step.get(index) == self.backwards
        self.backwards_at_step[index] = self.backwards
        if not repeat:
            self.attempts[index] = self.attempts.get(index, 0) + 1
        self.lrs_seen.append((index, self.attempts[index] - 1, [g["lr"] for g in optimizer.param_groups]))
        self.before[index] = snapshot(trainer, module, optimizer)
        self.replayed[index] = False

    # -------------------------------------------------------------- (i) masters equal the replay
    def check_step(self, trainer: L.Trainer, module: L.LightningModule, index: int) -> None:
        plugin = trainer.precision_plugin
        optimizer, replica = trainer.optimizers[index], self.replicas[index]
        params = [p for ps in [module.param_sets()[index]] for p in ps]
        if self.replayed.get(index, False):  # a later chunk of a chunked step: its masters against the replay
            self.compare(plugin, optimizer, params)
            return
        self.replayed[index] = True
        copies = [self.copy_of[id(p)] for p in params]
        if self.repeat[index]:  # the gradients of the last step again, or none where zero_grad dropped them
            for p, copy in zip(params, copies):
                if p.grad is None:
                    copy.grad = None
            self.replay_step(plugin, optimizer, replica, params)
            return
        inv_scale = torch.tensor(1.0 / self.scale, dtype=torch.float32)
        for p in params:
            copy, g = self.copy_of[id(p)], self.grads.get(id(p))
            copy.grad = None if g is None else g.float() * inv_scale
        if self.setup.clip is not None:
            algorithm, value = self.setup.clip
            if algorithm == "norm":
                # the plugin clips with this function over the same tensors in the optimizer's order: the same sum
                torch.nn.utils.clip_grad_norm_(copies, value)
            else:
                torch.nn.utils.clip_grad_value_(copies, value)
        self.replay_step(plugin, optimizer, replica, params)

    def replay_step(self, plugin: Any, optimizer: Any, replica: Any, params: list[nn.Parameter]) -> None:
        for group, replica_group in zip(optimizer.param_groups, replica.param_groups):
            replica_group["lr"] = group["lr"]
        replica.step()  # the same torch optimizer over the same gradients: elementwise, so bitwise
        self.compare(plugin, optimizer, params)
        self.steps_checked += 1

    def compare(self, plugin: Any, optimizer: Any, params: list[nn.Parameter]) -> None:
        """The masters that ``optimizer`` has just stepped (all, or a chunk's) equal the replay."""
        stepped = {id(t) for g in optimizer.param_groups for t in g["params"]}
        for p in params:
            if id(plugin.master_of(p)) in stepped or not p.requires_grad:
                assert torch.equal(plugin.master_of(p).float(), self.expected(p)), (self.setup, self.steps_checked)

    def expected(self, p: Tensor) -> Tensor:
        """The replay's value of ``p``; rounded to the half format for a parameter frozen at conversion, which has no
        master."""
        copy = self.copy_of[id(p)].detach()
        return copy if p.requires_grad else copy.to(self.setup.plugin_dtype).float()

    # -------------------------------------------------------------- (ii), (iii)
    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        for _, param, master in plugin.named_masters():
            # remainders round ties away from zero (the one rounding that 16 bits can store exactly), torch to even
            rounded = split(master)[0] if self.setup.remainders and self.setup.precision == "bf16" else master
            assert torch.equal(param, rounded.to(param.dtype)), self.setup  # (ii)
        records = list(plugin.history)[self.history_len :]
        self.history_len = len(plugin.history)
        for record in records:
            if record.skipped:  # (iii) a skipped step changed nothing
                optimizer = trainer.optimizers[record.optimizer]
                assert_same(self.before[record.optimizer], snapshot(trainer, module, optimizer), self.setup)

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        plugin = trainer.precision_plugin
        self.epoch_masters[trainer.current_epoch] = {
            n: plugin.master_of(p).detach().clone().float()
            for n, p in module.state_dict(keep_vars=True).items()
            if isinstance(p, nn.Parameter)
        }


def snapshot(trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> dict[str, Any]:
    """Weights, masters and state of ``optimizer``'s parameters."""
    plugin = trainer.precision_plugin
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {
        "params": [p.detach().clone() for p in params],
        "masters": [plugin.master_of(p).detach().clone() for p in params],
        "state": [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
            for g in optimizer.param_groups
            for p in g["params"]
            if p in optimizer.state
        ],
    }


def assert_same(a: dict[str, Any], b: dict[str, Any], setup: Setup) -> None:
    for x, y in zip(a["params"] + a["masters"], b["params"] + b["masters"]):
        assert torch.equal(x, y), setup
    assert len(a["state"]) == len(b["state"]), setup
    for sa, sb in zip(a["state"], b["state"]):
        for k in sa:
            assert torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k], (setup, k)


def train(
    setup: Setup, root: Path, ckpt_path: Optional[Path] = None, extra: tuple[L.Callback, ...] = ()
) -> tuple[FuzzModel, Replay, L.Trainer]:
    """Fit ``setup``; the replay checks every step of a run from the start (not of a resumed one)."""
    torch.manual_seed(setup.seed)
    model = FuzzModel(setup)
    replay = Replay(setup, model)
    callbacks: list[L.Callback] = [*extra, InjectInf("emb.weight", set(setup.overflows))]
    if ckpt_path is None:
        callbacks.append(replay)
    kwargs: dict[str, Any] = {}
    if setup.mode == "auto":
        kwargs["accumulate_grad_batches"] = setup.accumulate
        if setup.clip is not None:
            kwargs["gradient_clip_algorithm"], kwargs["gradient_clip_val"] = setup.clip
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    trainer = quiet_trainer(
        max_epochs=EPOCHS, plugins=[setup.plugin()], callbacks=[*callbacks, ckpt], enable_checkpointing=True, **kwargs
    )
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return model, replay, trainer


def check(setup: Setup, extra: tuple[L.Callback, ...] = ()) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, replay, trainer = train(setup, root / "straight", extra=extra)
        plugin = trainer.precision_plugin
        assert replay.steps_checked == sum(not r.skipped for r in plugin.history), setup
        # (iii) LR schedulers step at every optimizer step, skipped ones included (as under "16-mixed")
        if setup.scheduler:
            for index, k, lrs in replay.lrs_seen:
                base = [g["initial_lr"] for g in trainer.optimizers[index].param_groups]
                assert lrs == pytest.approx([b * 0.9**k for b in base], rel=1e-6), setup
        # (iv) after fit: an fp32 module equal to the replay
        for p in model.parameters():
            assert p.dtype == torch.float32, setup
            assert torch.equal(p.detach(), replay.expected(p)), setup
        # (v) checkpoints hold the masters, in fp32
        for epoch, masters in replay.epoch_masters.items():
            saved = torch.load(root / "straight" / f"epoch={epoch}.ckpt", weights_only=False)["state_dict"]
            for name, master in masters.items():
                assert saved[name].dtype == torch.float32, (setup, name)
                assert torch.equal(saved[name], master), (setup, name)
        # (vi) resume at an epoch boundary: bitwise the uninterrupted run
        if setup.resume_epoch is not None:
            resumed, _, _ = train(
                setup, root / "resumed", ckpt_path=root / "straight" / f"epoch={setup.resume_epoch}.ckpt"
            )
            for a, b in zip(model.parameters(), resumed.parameters()):
                assert torch.equal(a, b), setup


def fuzz_settings(examples: int) -> settings:
    """Hypothesis' settings for ``examples`` drawn setups: derandomized unless ``FUZZ_RANDOM=1``, no deadline."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not RANDOM,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


@fuzz_settings(EXAMPLES)
@given(setups())
def test_every_step_matches_an_independent_fp32_replay(setup: Setup) -> None:
    check(setup)


@contextmanager
def as_before_torch_2_13() -> Iterator[None]:
    """Run the plugin as it runs on torch < 2.13, where a half parameter cannot hold an fp32 gradient: its ``.grad``
    shows a half copy of the master gradient during a step (``lightning_mpt/core/masters/_shown.py``). The plugin's
    one switch is the feature flag ``_compat.GRAD_DTYPE``, read at each conversion and step."""
    before = _compat.GRAD_DTYPE
    _compat.GRAD_DTYPE = False
    try:
        yield
    finally:
        _compat.GRAD_DTYPE = before


@fuzz_settings(max(1, EXAMPLES // 4))
@given(setups())
def test_every_step_matches_the_replay_on_torch_before_2_13(setup: Setup) -> None:
    """The same invariants on torch < 2.13's path (most GPU users' torch), which this torch runs when told to: the
    hooks see half copies of the fp32 master gradients, kept in step with them by version counters."""
    with as_before_torch_2_13():
        check(setup)


@pytest.mark.parametrize(
    "setup",
    [
        # examples worth keeping whatever Hypothesis draws: each combines features that interact
        Setup(
            "adagrad",
            "fused",
            "auto",
            3,
            ("norm", 1e-3),
            True,
            True,
            True,
            True,
            True,
            frozenset({1}),
            0,
            "fp16-dynamic",
            1,
        ),
        Setup(
            "adamw",
            "foreach",
            "manual2",
            1,
            ("value", 0.02),
            False,
            True,
            False,
            True,
            True,
            frozenset({0, 3}),
            1,
            "fp16-static",
            2,
        ),
        Setup(
            "sgd_momentum",
            "default",
            "manual1",
            1,
            ("norm", 0.5),
            False,
            False,
            True,
            True,
            True,
            frozenset({2}),
            0,
            "bf16",
            3,
        ),
        Setup(
            "radam",
            "foreach",
            "auto",
            4,
            None,
            True,
            False,
            False,
            False,
            True,
            frozenset({0, 1}),
            1,
            "fp16-dynamic",
            4,
        ),
        # 16-bit remainders: chunked with resume, tied weights and a frozen branch; and the whole step, with a step
        # taken again after zero_grad
        Setup(
            "adamw",
            "fused",
            "auto",
            2,
            ("norm", 0.5),
            True,
            True,
            True,
            True,
            True,
            frozenset({1}),
            1,
            "bf16",
            5,
            chunked=True,
            remainders=True,
        ),
        Setup(
            "adam",
            "foreach",
            "manual1",
            1,
            ("value", 0.02),
            False,
            True,
            True,
            False,
            False,
            frozenset({3}),
            0,
            "bf16",
            6,
            again="zero_grad",
            remainders=True,
        ),
        # a skipped step's masters stay awake until the next backward, which must not write the half weights that
        # the second optimizer's forward holds (found by this test's random draws)
        Setup(
            "adagrad",
            "default",
            "manual2",
            1,
            None,
            False,
            False,
            False,
            False,
            False,
            frozenset({0}),
            None,
            "bf16",
            0,
            remainders=True,
        ),
    ],
    ids=[
        "adagrad-accumulate-clip-all",
        "adamw-two-optimizers",
        "sgd-manual-bf16",
        "radam-accumulate-4",
        "remainders-chunked-resume",
        "remainders-whole-again",
        "remainders-manual2-skip",
    ],
)
def test_chosen_setups(setup: Setup) -> None:
    check(setup)


def test_the_fuzz_test_can_fail() -> None:
    """The replay is sensitive: a master nudged by one fp32 ulp after a step is caught."""
    setup = Setup("sgd", "default", "auto", 1, None, False, False, False, False, False, frozenset(), None, "bf16", 0)

    class Nudge(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step == 2:
                master = trainer.precision_plugin.master_of(module.mix.weight)
                master.data.view(-1)[0] = torch.nextafter(master.view(-1)[0], torch.tensor(math.inf))

    with pytest.raises(AssertionError):
        check(setup, extra=(Nudge(),))
