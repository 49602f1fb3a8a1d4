"""The framework-free core on its own, in plain torch loops (no Lightning): the decision and ``StepLog`` (guard,
counters, state), and ``MixedPrecisionEngine`` (masters, scale, step or skip)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_mpt import DynamicLossScaler, NonFiniteGradientError
from lightning_mpt.core.engine import MixedPrecisionEngine
from lightning_mpt.core.masters.copies import CopyMasters
from lightning_mpt.core.steps import StepLog

# ------------------------------------------------------------------------------------------ the decision and StepLog


def test_the_decision_reads_the_flags_and_the_edit_flags_in_one_go():
    engine = MixedPrecisionEngine(CopyMasters(torch.float16), DynamicLossScaler(init_scale=8.0))
    engine.scale_loss(torch.tensor(1.0))
    assert engine._sync(torch.tensor(0.0), torch.tensor([1.0, 0.0])) == (False, True, [1.0, 0.0])
    engine.scale_loss(torch.tensor(math.nan))
    assert engine._sync(torch.tensor(2.0), None) == (True, False, [])
    assert engine._sync(None, None) == (False, True, [])  # nothing to read: no sync at all
    assert engine.log.steps == 0
    assert not engine.log.history


def test_a_skip_backs_off_and_counts_per_optimizer():
    log = StepLog(DynamicLossScaler(init_scale=8.0, growth_interval=100), max_consecutive_skips=2)
    record = log.skipped(optimizer=1, scale=8.0, loss_finite=True)  # 1 of 2: no error yet
    assert record.skipped
    assert record.scale == 8.0
    assert record.optimizer == 1
    assert log.scaler.scale == 4.0
    assert log.skipped_steps == 1
    assert log.consecutive == {1: 1}
    log.taken(optimizer=0, scale=4.0, loss_finite=True)  # another optimizer's clean step: optimizer 1's count stays
    with pytest.raises(NonFiniteGradientError, match=r"2 optimizer steps in a row were skipped \(optimizer 1\)"):
        log.skipped(optimizer=1, scale=4.0, loss_finite=True)


def test_guard_at_the_minimum_scale_names_the_culprits_lazily():
    log = StepLog(DynamicLossScaler(init_scale=2.0, min_scale=2.0), max_consecutive_skips=50)
    with pytest.raises(NonFiniteGradientError, match=r"minimum loss scale \(2\)") as err:
        log.skipped(0, 2.0, True, ["a", "b", "c"], torch.tensor([False, True, False]))
    assert "non-finite gradients: b\n" in str(err.value)
    assert log.history[-1].nonfinite_params == ["b"]


def test_a_static_scale_has_no_floor_to_reach():
    log = StepLog(DynamicLossScaler.static(4.0), max_consecutive_skips=3)
    for _ in range(2):
        log.skipped(0, 4.0, True)
    assert log.scaler.scale == 4.0


def test_state_round_trip_and_the_old_single_counter_format():
    log = StepLog(DynamicLossScaler(init_scale=16.0), max_consecutive_skips=5)
    log.skipped(optimizer=2, scale=16.0, loss_finite=True)
    other = StepLog(DynamicLossScaler(), max_consecutive_skips=5)
    assert other.load_state_dict(log.state_dict()) is None
    assert other.scaler.scale == 8.0
    assert other.consecutive == {0: 0, 1: 0, 2: 1}
    assert other.steps == 1
    other.load_state_dict({
        "scaler": log.scaler.state_dict(),
        "skipped_steps": 3,
        "consecutive_skips": 2,
        "steps": 7,
    })
    assert other.consecutive == {0: 2}
    assert other.skipped_steps == 3
    assert "without a loss scaler" in StepLog(DynamicLossScaler(), 5).load_state_dict({"scaler": None})


# ---------------------------------------------------------------------------------------------------- the engine


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))


def batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(n)]


def loop(engine: MixedPrecisionEngine, model: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype, inject=()):
    """A plain torch training loop on the engine; returns the fp32 master gradients each step was taken with."""
    stepped = []
    for i, (x, y) in enumerate(batches()):
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        engine.scale_loss(loss).backward()
        if i in inject:
            model[0].weight.grad.view(-1)[0] = math.inf
        pending = engine.decide(opt)
        if not pending.skipped:
            stepped.append([engine.masters.master_of(p).grad.clone() for p in model.parameters()])
        engine.step(opt, pending)
        opt.zero_grad()
    return stepped


def test_bf16_loop_tracks_fp32():
    ref = mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in batches():
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    model = mlp()
    engine = MixedPrecisionEngine(CopyMasters(torch.bfloat16))
    engine.convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loop(engine, model, opt, torch.bfloat16)
    engine.restore()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, r, rtol=0, atol=3e-2)


def test_fp16_static_scale_masters_equal_an_fp32_replay_and_skips_change_nothing():
    model = mlp()
    start = [p.detach().clone() for p in model.parameters()]
    engine = MixedPrecisionEngine(CopyMasters(torch.float16), DynamicLossScaler.static(256.0))
    engine.convert(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    stepped = loop(engine, model, opt, torch.float16, inject={2})
    assert [r.skipped for r in engine.log.history] == [False, False, True, False, False, False]
    assert len(stepped) == 5
    assert opt.state[model[0].weight]["step"].item() == 5
    replica = [nn.Parameter(t) for t in start]
    ref = torch.optim.Adam(replica, lr=1e-2)
    for grads in stepped:
        for p, g in zip(replica, grads):
            p.grad = g
        ref.step()
    for p, r in zip(model.parameters(), replica):
        assert torch.equal(engine.masters.master_of(p), r)


def test_step_in_closure_runs_lbfgs_on_the_masters():
    model = mlp()
    engine = MixedPrecisionEngine(CopyMasters(torch.bfloat16))
    engine.convert(model)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = batches(1)[0]
    evaluations = []

    def closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        engine.scale_loss(loss).backward()
        evaluations.append(loss.item())
        return loss

    for _ in range(3):
        engine.step_in_closure(opt, closure, after=lambda: None)
    assert len(evaluations) > 3
    assert evaluations[-1] < 0.8 * evaluations[0]
    assert engine.log.steps == 3
    assert all(m.dtype == torch.float32 for _, _, m in engine.masters.named_masters())


def test_an_edit_flagged_per_range_of_weights_is_found_in_its_own_weight():
    # on a CPU the edit check flags a range of 2**24 elements at once; a model larger than that gives one flag per
    # range, fewer than its weights: the edited weight must be found by comparing each, not by position
    from lightning_mpt.core.masters._edits import edited_pairs

    masters = [torch.full((3,), float(i)) for i in range(3)]
    halves = [m.half() for m in masters]
    halves[2][0] = 7.0
    pairs = list(zip(halves, masters))
    assert edited_pairs(pairs, [0.0, 1.0]) == [pairs[2]]
    assert edited_pairs(pairs, [0.0, 0.0]) == []


# ------------------------------------------------------------------------------------------ the gradients' buffer


def _engine_step(engine: MixedPrecisionEngine, model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    engine.release_gradients(drop=True)
    loss = model(torch.randn(4, 8, dtype=torch.float16)).float().pow(2).mean()
    engine.scale_loss(loss).backward()
    engine.step(opt, engine.decide(opt))
    opt.zero_grad()


def _kept_buffers(engine: MixedPrecisionEngine) -> list[tuple[str, int]]:
    """The dtype and the bytes of each buffer the engine keeps (not the buffers: holding one keeps it from reuse)."""
    layouts = engine.masters.groups.layouts.values.values()  # type: ignore[attr-defined]
    return sorted(
        (str(kept.flat.dtype), kept.flat.untyped_storage().nbytes())
        for layout in layouts
        if layout is not None
        for kept in layout._kept.values()
    )


def test_the_step_gradients_buffer_is_reused_and_holds_no_memory_between_steps():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    engine = MixedPrecisionEngine(CopyMasters(torch.float16), DynamicLossScaler(init_scale=8.0))
    engine.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(3):
        _engine_step(engine, model, opt, step)
        seen.append(id(engine.masters.master_of(model[0].weight).grad))  # the step keeps it until the release
        engine.release_gradients(drop=True)
        # the fp32 gradients' buffer, and the edit check's scratch of rounded masters: no memory between steps
        assert _kept_buffers(engine) == [("torch.float32", 0)]
        assert [edits.scratch.untyped_storage().nbytes() for _, edits, _ in engine.masters.edits.flat()] == [0]
    assert seen[0] == seen[1] == seen[2]  # the same views, step after step


def test_a_gradient_user_code_keeps_is_never_reused_nor_freed():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    engine = MixedPrecisionEngine(CopyMasters(torch.float16), DynamicLossScaler(init_scale=8.0))
    engine.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _engine_step(engine, model, opt, 0)
    kept = engine.masters.master_of(model[0].weight).grad  # the tensor itself
    kept_copy = kept.clone()
    _engine_step(engine, model, opt, 1)
    part = engine.masters.master_of(model[1].weight).grad.view(-1)[:5]  # a view made from the gradient
    part_copy = part.clone()
    for seed in (2, 3):
        _engine_step(engine, model, opt, seed)
    engine.release_gradients(drop=True)
    assert torch.equal(kept, kept_copy)
    assert torch.equal(part, part_copy)


def test_a_weight_whose_data_user_code_made_fp32_is_checked_and_its_value_adopted():
    """The CPU edit check stacks the weights of one shape: one of them fp32 now (``p.data = p.data.float()``, as
    code written for fp32 may do) makes the stack fp32, which may flag the others, never miss an edit; the exact
    comparison that follows adopts only the real edit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # two weights of one shape, two biases of another
    engine = MixedPrecisionEngine(CopyMasters(torch.float16), DynamicLossScaler(init_scale=8.0))
    edited: list[list[str]] = []
    engine.on_edits = edited.append
    engine.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _engine_step(engine, model, opt, 0)
    engine.release_gradients(drop=True)
    weight = model[1].weight
    with torch.no_grad():
        weight.data = weight.data.float() * 2  # an fp32 tensor of new values
    expected = weight.detach().clone()
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.float16):  # the layers' weights now differ in dtype
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    engine.scale_loss(loss).backward()
    pending = engine.decide(opt)
    assert edited == [["1.weight"]]  # only the weight whose values changed, though its whole shape group was flagged
    assert torch.equal(engine.masters.master_of(weight), expected)  # its master took the new values before the step
    engine.step(opt, pending)


def test_the_flat_edit_check_flags_each_edited_weight_and_gives_its_scratch_back():
    """The edit check of 4-byte masters over flat weights: nothing edited is known from one comparison (a CPU); an edit
    gives a flag per weight (what a GPU computes always), an empty weight never flagged; the scratch of rounded masters
    holds no memory after the check."""
    from lightning_mpt.core.masters._edits import FlatEdits
    from lightning_mpt.core.masters._halves import HalfWeights

    torch.manual_seed(0)
    masters = [torch.randn(4, 4), torch.randn(3), torch.randn(4, 4), torch.zeros(0)]
    params = [nn.Parameter(m.half()) for m in masters]
    halves = HalfWeights(params, chunk=16)  # three chunks: the comparison runs a chunk at a time
    check = FlatEdits(halves)
    master_of = dict(zip(params, masters))
    aligned = [master_of[p] for p in halves.params]
    assert len(halves.layout.chunks) == 3
    flags, expected = check.flags(aligned)
    assert flags is None
    assert torch.equal(expected, halves.fingerprints(upper=True))  # the masters rounded: what the weights are
    params[2].data[1, 1] += 1
    params[1].data[0] = -params[1].data[0]
    flags, again = check.flags(aligned)
    edited = dict(zip(halves.params, flags.tolist()))
    assert [edited[p] for p in params] == [False, True, True, False]
    assert torch.equal(again, expected)  # of the masters, whatever the weights hold
    assert check.scratch.untyped_storage().nbytes() == 0


# ------------------------------------------------------------------------------------ the edit check's fingerprints


def _reporting_engine() -> tuple[MixedPrecisionEngine, nn.Module, list[list[str]]]:
    """Two fp16 layers converted by an engine with 4-byte masters, and the names of the edits it reports."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    engine = MixedPrecisionEngine(CopyMasters(torch.float16), DynamicLossScaler(init_scale=8.0))
    edited: list[list[str]] = []
    engine.on_edits = edited.append
    engine.convert(model)
    return engine, model, edited


def _fingerprinted_engine() -> tuple[MixedPrecisionEngine, nn.Module, list[list[str]]]:
    """An engine whose edit check knows the weights' fingerprints (two steps taken)."""
    engine, model, edited = _reporting_engine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for seed in range(2):
        _engine_step(engine, model, opt, seed)
        engine.release_gradients(drop=True)
    assert engine.masters.edits._expected is not None
    assert edited == []
    model.opt = opt  # type: ignore[assignment]
    return engine, model, edited


def test_the_edit_check_by_fingerprints_finds_an_in_place_permutation():
    """After a step the check compares the weights' fingerprints with those of the masters rounded: a permutation of a
    weight's rows in place (same values, same sum; no new data pointer) is still found and adopted before the step."""
    engine, model, edited = _fingerprinted_engine()
    weight = model[1].weight
    with torch.no_grad():
        weight.copy_(weight.flip(0))
    expected = weight.detach().float()
    _engine_step(engine, model, model.opt, 5)
    assert edited == [["1.weight"]]
    master = engine.masters.master_of(weight)
    # the step (SGD, lr 0.1) started from the edit (the weight unflipped is off by far more than a rounding)
    torch.testing.assert_close(master + 0.1 * master.grad, expected, rtol=0, atol=1e-6)


def test_a_state_dict_loaded_between_steps_keeps_its_exact_masters():
    """Loading writes the masters exactly and the half weights rounded: not an edit. Counted as one, the masters would
    take the rounded values."""
    engine, model, edited = _fingerprinted_engine()
    state = {k: v + 1e-2 * torch.randn_like(v) for k, v in model.state_dict().items()}  # fp16 rounds them
    model.load_state_dict(state)
    loss = model(torch.randn(4, 8, dtype=torch.float16)).float().pow(2).mean()
    engine.scale_loss(loss).backward()
    decided = engine.decide(model.opt)
    assert edited == []
    assert all(torch.equal(engine.masters.master_of(p), state[n]) for n, p in model.named_parameters())
    engine.step(model.opt, decided)


def test_an_edit_of_another_optimizers_weights_survives_this_optimizers_step():
    """Each optimizer's step updates the fingerprints of the weights it wrote only: a weight of the second optimizer
    edited before the first one steps is still found at the second one's check (GANs: the critic clamped)."""
    engine, model, edited = _reporting_engine()
    opts = [torch.optim.SGD(model[i].parameters(), lr=0.1) for i in range(2)]
    for seed in range(3):
        if seed == 2:
            with torch.no_grad():
                model[1].weight.clamp_(-0.01, 0.01)  # the critic's clamp, before the generator's step
        for opt in opts:
            _engine_step(engine, model, opt, seed)
        engine.release_gradients(drop=True)
    assert edited == [["1.weight"]]  # missed when the first optimizer's write-back took every weight's fingerprint


def test_a_master_edited_at_full_precision_and_copied_into_its_weight_is_not_rounded():
    """The documented way to edit at full precision (docs/guarantees.md): the master, then its weight from it. The
    weight's fingerprint changed, but it holds its master rounded: not an edit, and the master keeps its bits."""
    engine, model, edited = _fingerprinted_engine()
    weight = model[0].weight
    master = engine.masters.master_of(weight)
    with torch.no_grad():
        master.mul_(1.0 + 1e-3)  # bits below fp16's resolution
        weight.copy_(master)
    exact = master.clone()
    loss = model(torch.randn(4, 8, dtype=torch.float16)).float().pow(2).mean()
    engine.scale_loss(loss).backward()
    decided = engine.decide(model.opt)
    assert edited == []
    assert torch.equal(engine.masters.master_of(weight), exact)
    engine.step(model.opt, decided)
    engine.release_gradients(drop=True)
    assert torch.equal(engine.masters.edits._expected, engine.masters.edits.flat()[0][0].fingerprints(upper=True))


def test_a_sign_flip_of_every_fourth_value_is_adopted():
    """Negating a hidden unit's outgoing weights (a column of index 3 mod 4, as many positive values as negative) is an
    edit the fingerprints must see: the values are the top ones of their words, where sign flips cancel in pairs in
    wrapping sums of words (found by a hostile probe: the master kept its old column, and the next write-back undid
    the edit)."""
    engine, model, edited = _fingerprinted_engine()
    weight = model[1].weight
    with torch.no_grad():
        weight[:, 3] = torch.tensor([1.0, -1.0] * 4, dtype=torch.float16) * weight[:, 3].abs().clamp_min(0.01)
    engine.masters.absorb_all_edits()  # now rounded exactly: the flip below is all that differs
    engine.masters.refresh()
    with torch.no_grad():
        weight[:, 3].neg_()
    expected = weight.detach().float()
    _engine_step(engine, model, model.opt, 6)
    assert edited[-1:] == [["1.weight"]]
    master = engine.masters.master_of(weight)
    torch.testing.assert_close(master + 0.1 * master.grad, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(4, 4), (8, 4), (4, 8), (16, 16), (64, 64), (128, 4), (12, 12), (128, 8)])
def test_the_edit_checks_fingerprint_sees_every_fourth_value_negated_or_rescaled(shape):
    """A column whose values are the top ones of their 8-byte words (index 3 mod 4) counts in a word's sums with a
    weight of 2**48: its sign flips (2**63 each) cancel in pairs there, and rescales by powers of two in 64s, whatever
    the words' weights. The edit check's third sum sees them (negating or rescaling a hidden unit's weights, balanced
    signs, was missed: the master kept its values and the next write-back undid the edit)."""
    from lightning_mpt.core.masters._halves import fingerprints

    torch.manual_seed(0)
    w = torch.rand(shape).add_(0.5).half()
    w[1::2] = -w[1::2]  # as many positive values as negative ones in every column
    before = fingerprints([w.view(1, -1).view(torch.int64)], upper=True)
    for factor in (-1.0, 2.0, 0.5):
        edited = w.clone()
        edited[:, 3] *= factor
        assert not torch.equal(fingerprints([edited.view(1, -1).view(torch.int64)], upper=True), before), factor


def _transposed_run(kind: str, assign: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Two steps, a square weight transposed (``assign``: ``p.data = p.data.t()``, else copied in place), one more
    step: the weight and its master."""
    from lightning_mpt.core.masters.remainders import RemainderMasters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    dtype = torch.float16 if kind == "copies" else torch.bfloat16
    masters = CopyMasters(dtype) if kind == "copies" else RemainderMasters(chunk=64)
    engine = MixedPrecisionEngine(masters, DynamicLossScaler(init_scale=8.0) if kind == "copies" else None)
    engine.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for seed in range(3):
        if seed == 2:
            weight = model[1].weight
            with torch.no_grad():
                if assign:
                    weight.data = weight.data.t()
                else:
                    weight.copy_(weight.t().clone())
        torch.manual_seed(seed)
        engine.release_gradients(drop=True)
        loss = model(torch.randn(4, 8, dtype=dtype)).float().pow(2).mean()
        engine.scale_loss(loss).backward()
        engine.step(opt, engine.decide(opt))
        opt.zero_grad()
    engine.release_gradients(drop=True)
    return model[1].weight.detach().float().clone(), engine.masters.master_of(model[1].weight).detach().clone()


@pytest.mark.parametrize("kind", ["copies", "remainders"])
def test_a_weight_given_its_own_memory_transposed_is_an_edit(kind):
    """``p.data = p.data.t()`` of a square weight keeps the data pointer of its view of the flat buffer: only the
    strides say it changed. It must train as the same transpose copied in place does, bitwise (the same arithmetic).
    Taken for the same view, it was never adopted: the master kept its values and the next write-back undid it, or
    (16-bit remainders) the transposed weight was joined with the remainders of the values before (found by a hostile
    probe)."""
    weight, master = _transposed_run(kind, assign=True)
    reference_weight, reference_master = _transposed_run(kind, assign=False)
    assert torch.equal(master, reference_master)
    assert torch.equal(weight, reference_weight)


def test_the_fingerprints_off_a_cpu_are_the_cpus():
    """Off a CPU the fingerprints weigh by products and sums, not integer matrix-vector products (a GPU may lack
    them): the same numbers, bitwise, since integer sums wrap the same in any order. This machine has no GPU: the path
    a GPU takes runs here on the CPU's tensors."""
    from lightning_mpt.core.masters._halves import PERIOD, fingerprints

    torch.manual_seed(0)
    runs = [
        torch.randn(3, 4 * (PERIOD + 5)).half().view(torch.int64),  # past a period: weighed a period at a time
        torch.randn(300, 256).bfloat16().view(torch.int64),  # more rows than a block of shifted words holds
        torch.zeros(2, 0, dtype=torch.int64),  # empty tensors
    ]
    for upper in (False, True):
        assert torch.equal(fingerprints(runs, upper, matmul=False), fingerprints(runs, upper, matmul=True))


def test_the_fingerprints_are_their_definitions_sums():
    """Each row's three sums as the docstring of ``fingerprints`` defines them, computed here word by word with
    Python's integers (wrapped to 64 bits at the end, as integer sums wrap the same in any order): across a period's
    end, across the blocks of rows the upper halves are shifted in, and for empty rows."""
    from lightning_mpt.core.masters._halves import PERIOD, _weights, fingerprints

    mixed = _weights(torch.device("cpu"))[1].tolist()

    def wrapped(x: int) -> int:
        x %= 2**64
        return x - 2**64 if x >= 2**63 else x

    def definition(row: list[int]) -> list[int]:
        return [
            wrapped(sum(row)),
            wrapped(sum(w * (1 + j % PERIOD) for j, w in enumerate(row))),
            wrapped(sum((w >> 32) * mixed[j % PERIOD] for j, w in enumerate(row))),
        ]

    torch.manual_seed(0)
    runs = [
        torch.randn(2, 4 * (PERIOD + 5)).half().view(torch.int64),
        torch.randn(300, 256).bfloat16().view(torch.int64),
        torch.zeros(2, 0, dtype=torch.int64),
        torch.randn(5, 4).half().view(torch.int64),
    ]
    expected = [definition(row) for words in runs for row in words.tolist()]
    assert fingerprints(runs, upper=True).tolist() == expected
    assert fingerprints(runs).tolist() == [e[:2] for e in expected]
