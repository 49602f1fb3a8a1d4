"""``MPTPrecision(chunked_step=...)``: the masters stepped a chunk of parameters at a time equal one whole step's.

Bitwise comparisons here are between two runs in one process on one CPU that do the same arithmetic in the same
order: each torch optimizer in :data:`CHUNKABLE` updates a parameter from that parameter's tensors alone, so which
other parameters share its ``optimizer.step()`` call changes no operation; the fp32 gradients are made by the same
copy and unscale kernels; and the global clipping norm stacks the same per-tensor norms in the optimizer's parameter
order, as ``clip_grad_norm_`` does over the masters of a whole step.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import lightning as L
import pytest
import torch
from models import InjectInf, quiet_trainer, regression_data
from torch import nn

from lightning_mpt import Fp8Options, MasterOptions, MPTPrecision, SkipPolicy
from lightning_mpt.core.masters.chunked import ChunkedStep

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
}


class Tied(L.LightningModule):
    """Linear layers, a LayerNorm (fp32, its own master), a frozen layer and two tied weights, in two groups."""

    def __init__(self, optimizer: str = "adamw", clip: Optional[tuple[str, float]] = None) -> None:
        super().__init__()
        self.a = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.b = nn.Linear(24, 24)
        self.c = nn.Linear(24, 24, bias=False)
        self.c.weight = self.b.weight  # tied: one master
        self.frozen = nn.Linear(24, 24)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(24, 4)
        self.optimizer, self.clip = optimizer, clip
        self.stepped: list[int] = []  # fp32 gradient elements the optimizer saw at each optimizer.step() call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.a(x)))
        return self.head(self.frozen(self.c(torch.relu(self.b(h)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for n, p in self.named_parameters() if n.endswith("weight") and "norm" not in n]
        rest = [p for n, p in self.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
        optimizer = OPTIMIZERS[self.optimizer]([{"params": decay}, {"params": rest, "weight_decay": 0.0}])

        def count(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:  # after the step: the closure ran
            self.stepped.append(sum(p.numel() for g in opt.param_groups for p in g["params"] if p.grad is not None))

        optimizer.register_step_post_hook(count)
        return optimizer


def _fit(
    precision: str,
    chunk: Any,
    optimizer: str = "adamw",
    clip: Optional[tuple[str, float]] = None,
    callbacks: Optional[list[L.Callback]] = None,
    steps: int = 6,
) -> tuple[Tied, MPTPrecision]:
    torch.manual_seed(0)
    model = Tied(optimizer)
    plugin = MPTPrecision(precision, chunked_step=chunk)  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    if clip is not None:
        kwargs = {"gradient_clip_algorithm": clip[0], "gradient_clip_val": clip[1]}
    trainer = quiet_trainer(max_steps=steps, plugins=[plugin], callbacks=callbacks or [], **kwargs)
    trainer.fit(model, regression_data(n=96, batch_size=16))
    return model, plugin


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    ("precision", "optimizer", "clip"),
    [
        ("bf16", "adamw", None),
        ("bf16", "sgd", ("norm", 0.05)),
        ("bf16", "adagrad", ("value", 0.01)),
        ("fp16", "adamw", ("norm", 0.05)),
        ("fp16", "rmsprop", None),
    ],
)
def test_chunks_step_the_masters_of_a_whole_step(precision: str, optimizer: str, clip: Any) -> None:
    whole, _ = _fit(precision, False, optimizer, clip)
    chunked, plugin = _fit(precision, 600, optimizer, clip)
    assert isinstance(plugin._engine.masters.stepper, ChunkedStep)
    _assert_same_weights(whole, chunked)
    # the whole step steps every trainable tensor at once; the chunks of ~600 elements in two calls
    trainable = sum(p.numel() for p in {id(p): p for p in whole.parameters() if p.requires_grad}.values())
    assert set(whole.stepped) == {trainable}
    assert len(chunked.stepped) == 2 * len(whole.stepped)
    assert max(chunked.stepped) < trainable
    assert sum(chunked.stepped) == sum(whole.stepped)


def test_a_skipped_step_changes_nothing_and_the_run_goes_on_as_a_whole_one() -> None:
    inject = [InjectInf("b.weight", steps={2})]
    whole, p_whole = _fit("fp16", False, callbacks=inject)
    chunked, p_chunked = _fit("fp16", 300, callbacks=copy.deepcopy(inject))
    assert p_whole.skipped_steps == p_chunked.skipped_steps == 1
    assert p_chunked._engine.log.history[2].skipped
    _assert_same_weights(whole, chunked)


def test_an_optimizer_that_cannot_be_chunked_takes_the_whole_step() -> None:
    class Custom(torch.optim.AdamW):  # a subclass may read other parameters: not chunked
        pass

    OPTIMIZERS["custom"] = lambda p: Custom(p, lr=1e-2, weight_decay=0.1)
    try:
        whole, _ = _fit("bf16", False, "adamw")
        with pytest.warns(UserWarning, match="Custom is stepped whole, not in chunks") as warned:
            custom, _ = _fit("bf16", 300, "custom")
    finally:
        del OPTIMIZERS["custom"]
    assert len(custom.stepped) == len(whole.stepped)
    _assert_same_weights(whole, custom)
    assert sum("stepped whole" in str(w.message) for w in warned) == 1  # once, not at every step


class MasterGradients(L.Callback):
    """Elements of fp32 master gradients alive after each step."""

    def __init__(self) -> None:
        self.alive: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        masters = {id(m): m for m in trainer.precision_plugin.main_params(trainer.optimizers[0])}.values()
        self.alive.append(sum(m.grad.numel() for m in masters if m.grad is not None and m.dtype == torch.float32))


def test_the_step_holds_one_chunk_of_fp32_gradients() -> None:
    whole, chunked = MasterGradients(), MasterGradients()
    model, _ = _fit("bf16", False, callbacks=[whole])
    _fit("bf16", 600, callbacks=[chunked])
    trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    assert whole.alive == [trainable] * 6  # a whole step keeps them until the next forward
    assert chunked.alive == [48] * 6  # only the LayerNorm's own gradients, which are its parameters'
    assert max(model.stepped) == trainable


@pytest.mark.parametrize("value", [0, -1, 1.5, "yes"])
def test_bad_chunk_sizes_are_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="chunked_step"):
        MPTPrecision("bf16", chunked_step=value)


def test_the_plugins_name_their_memory_options() -> None:
    from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision

    for plugin in (MPTPrecision, FabricMPTPrecision):
        assert repr(plugin("bf16")).endswith("master_weights=True)")
        chosen = repr(plugin("bf16", chunked_step=2**18, master_remainders=True))
        assert chosen.endswith("master_weights=True, chunked_step=262144, master_remainders=True)")


def test_chunks_need_masters() -> None:
    with pytest.raises(ValueError, match="master_weights=True"):
        MPTPrecision("bf16", chunked_step=True, master_weights=False)


def test_gradient_histograms_show_the_true_gradients(tmp_path: Any) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger
    from tb_events import read_events

    from lightning_mpt.callbacks import GradientHistogramMonitor

    logged = {}
    for chunk in (False, 300):
        logger = TensorBoardLogger(tmp_path, name=str(chunk), version=0)
        torch.manual_seed(0)
        plugin = MPTPrecision("fp16", chunked_step=chunk)
        callbacks = [GradientHistogramMonitor(every_n_steps=1)]
        trainer = quiet_trainer(max_steps=3, plugins=[plugin], callbacks=callbacks, logger=logger)
        trainer.fit(Tied(), regression_data(n=96, batch_size=16))
        events = read_events(logger.log_dir)
        logged[chunk] = {
            tag: [(e.step, e.histogram_value.bucket, e.histogram_value.bucket_limit) for e in events.Histograms(tag)]
            for tag in events.Tags()["histograms"]
        }
    assert any(tag.startswith("mpt/grad/") for tag in logged[False])  # the true gradients' values
    assert logged[False] == logged[300]


class Unfreeze(L.Callback):
    """Unfreezes the frozen layer at step 3 (it is in the optimizer's groups already): its masters are made then."""

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 3 and not module.frozen.weight.requires_grad:
            module.frozen.requires_grad_(True)


def test_a_layer_unfrozen_during_fit_is_stepped_in_chunks_like_a_whole_step() -> None:
    whole, _ = _fit("bf16", False, callbacks=[Unfreeze()], steps=8)
    chunked, _ = _fit("bf16", 300, callbacks=[Unfreeze()], steps=8)
    torch.manual_seed(0)
    frozen = Tied().frozen.weight.bfloat16().float()  # what a layer never trained holds after fit
    assert not torch.equal(whole.frozen.weight, frozen)  # it trained once unfrozen
    _assert_same_weights(whole, chunked)


def test_lbfgs_takes_the_whole_step() -> None:
    OPTIMIZERS["lbfgs"] = lambda p: torch.optim.LBFGS([q for g in p for q in g["params"]], lr=0.1, max_iter=3)
    try:
        whole, _ = _fit("bf16", False, "lbfgs", steps=3)
        chunked, _ = _fit("bf16", 300, "lbfgs", steps=3)
    finally:
        del OPTIMIZERS["lbfgs"]
    assert len(chunked.stepped) == len(whole.stepped) == 3
    _assert_same_weights(whole, chunked)


class ClipsByValueThenNorm(Tied):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="value")
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


def test_clipping_by_norm_after_clipping_by_value_is_refused() -> None:
    """The norm of value-clipped gradients needs them all at once, which chunks never hold: a clear error, not the
    coefficient of the unclipped norms applied before the clamp (4x off in a hand-computed case)."""
    trainer = quiet_trainer(max_steps=2, plugins=[MPTPrecision("bf16", chunked_step=64)])
    with pytest.raises(ValueError, match="Clip by norm first, then by value"):
        trainer.fit(ClipsByValueThenNorm(), regression_data(n=32, d_out=4))


def test_the_masters_options_in_one_object_or_as_single_arguments() -> None:
    from lightning_mpt import MasterOptions
    from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision

    for plugin in (MPTPrecision, FabricMPTPrecision):
        grouped = plugin("bf16", masters=MasterOptions(remainders=False, chunk=2**20))
        single = plugin("bf16", master_remainders=False, chunked_step=2**20)
        assert grouped.options == single.options == MasterOptions(True, False, 2**20, False)
        assert plugin("bf16").options == MasterOptions(True, True, True, False)  # bf16's default
        assert plugin("fp16").options == MasterOptions(True, False, False, False)  # fp16's
        with pytest.raises(ValueError, match="give these options once, in MasterOptions"):
            plugin("bf16", masters=MasterOptions(), chunked_step=True)
        with pytest.raises(TypeError, match="expected a lightning_mpt.MasterOptions"):
            plugin("bf16", masters={"chunk": 4})
        with pytest.raises(ValueError, match="needs precision='bf16'"):
            plugin("fp16", masters=MasterOptions(remainders=True))


GROUPED_MISTAKES = [  # (given in its object, the same as single arguments, the error, what it says)
    ({"masters": MasterOptions(chunk=0)}, {"chunked_step": 0}, ValueError, "(masters.chunk=0): expected True"),
    ({"masters": MasterOptions(enabled="yes")}, {"master_weights": "yes"}, TypeError, "(masters.enabled='yes'): "),
    ({"masters": MasterOptions(remainders=1)}, {"master_remainders": 1}, TypeError, "(masters.remainders=1): "),
    ({"masters": MasterOptions(accumulate_fp32=1)}, {"accumulate_fp32": 1}, TypeError, "(masters.accumulate_fp32=1): "),
    (
        {"masters": MasterOptions(enabled=False, chunk=True)},
        {"master_weights": False, "chunked_step": True},
        ValueError,
        "(masters.chunk=...) steps fp32 masters in chunks: it needs masters.enabled=True.",
    ),
    ({"skips": SkipPolicy(max_consecutive=0)}, {"max_consecutive_skips": 0}, ValueError, "(skips.max_consecutive=0): "),
    ({"skips": SkipPolicy(retries=-1)}, {"overflow_retries": -1}, ValueError, "(skips.retries=-1): expected an int"),
    (
        {"skips": SkipPolicy(advance_schedulers="no")},
        {"skipped_steps_advance_schedulers": "no"},
        TypeError,
        "(skips.advance_schedulers='no'): expected a bool",
    ),
    ({"fp8": Fp8Options(emulate="x")}, {"fp8": True, "fp8_emulate": "x"}, TypeError, "(fp8.emulate='x'): expected"),
    ({"fp8": Fp8Options(filter=3)}, {"fp8": True, "fp8_filter": 3}, TypeError, "(fp8.filter=3): expected None"),
]


@pytest.mark.parametrize(
    ("given", "single", "error", "message"), GROUPED_MISTAKES, ids=[m[3].split(")")[0][1:] for m in GROUPED_MISTAKES]
)
def test_an_option_given_in_its_object_is_named_as_written(
    given: dict[str, Any], single: dict[str, Any], error: type, message: str
) -> None:
    """A wrong field of ``MasterOptions``, ``SkipPolicy`` or ``Fp8Options`` is named as the user wrote it
    (``masters.chunk=0``), not as the single argument that stands for it (``chunked_step=0``, which names the same
    mistake made as a single argument), in both plugins."""
    from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision

    for plugin in (MPTPrecision, FabricMPTPrecision):
        if plugin is FabricMPTPrecision and "skips" in given and given["skips"].retries:
            continue  # retries are the Trainer's: Fabric refuses any number, with a message of its own
        with pytest.raises(error) as grouped:
            plugin("bf16", **given)
        assert "MPTPrecision" + message in str(grouped.value), str(grouped.value)
        with pytest.raises(error) as alone:
            plugin("bf16", **single)
        said = str(alone.value)
        assert not any(f"{group}." in said for group in ("masters", "skips", "fp8")), said
        assert f"{list(single)[-1]}=" in said, said


def test_an_option_refused_under_fsdp2_is_named_as_written() -> None:
    """Fabric's ``sharded=True`` refuses the options FSDP2 cannot take (no masters, chunks), naming each as the user
    gave it: a field of ``MasterOptions`` or a single argument."""
    from lightning_mpt import MasterOptions
    from lightning_mpt.fabric import MPTPrecision as FabricMPTPrecision

    refused = "is not supported under FSDP2"
    with pytest.raises(ValueError, match=rf"\(masters.chunk=...\) {refused}.*Leave masters.chunk unset"):
        FabricMPTPrecision("bf16", sharded=True, masters=MasterOptions(chunk=4))
    with pytest.raises(ValueError, match=rf"\(chunked_step=...\) {refused}.*Leave chunked_step unset"):
        FabricMPTPrecision("bf16", sharded=True, chunked_step=4)
    with pytest.raises(ValueError, match=rf"\(sharded=True, masters.enabled=False\) {refused}"):
        FabricMPTPrecision("bf16", sharded=True, masters=MasterOptions(enabled=False))
    with pytest.raises(ValueError, match=rf"\(sharded=True, master_weights=False\) {refused}"):
        FabricMPTPrecision("bf16", sharded=True, master_weights=False)
