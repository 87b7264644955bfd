"""Zero-bubble pipelines: the backward split computes nothing twice, and zb_h1, zbv and dualpipev
train like one device.

Tolerances. The split backward runs the very operations of one backward (each node's input-side
outputs in B, its weight-side outputs in W) in the same order per parameter, so on a stack of
linear layers, with or without bf16 autocast, its gradients equal the unsplit ones exactly; where a
weight is used twice the contributions may be summed in another order (float64 there, 1e-12).
Pipeline parity reuses test_pp_training's tolerances and
their justification (float32, AdamW turning rounding noise of near-zero gradients into updates):
loss 1e-5, parameters 1e-4; a missing or doubled weight gradient moves parameters by about the
learning rate (3e-3) per step.
"""

import warnings
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from lightning_parallel import ParallelStrategy
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline import PipelineEngine
from lightning_parallel.pipeline.backward_split import backward_input
from lightning_parallel.strategy.clipping import clip_grads_by_global_norm
from tests.helpers.parity import assert_params_close, fit_and_record
from tests.helpers.processes import make_mesh, run_distributed
from tests.pipeline.test_pp_training import (
    LOSS_TOL,
    PARAM_TOL,
    assert_matches,
    batches,
    gpt,
    single_device,
    small_gpt,
    token_data,
)

MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm}


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in MATMULS
        return func(*args, **(kwargs or {}))


def linear_stack(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8)).to(dtype)


def stage_output(model, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 8, generator=g, dtype=dtype, requires_grad=True)
    return x, model(x), torch.randn(4, 3, 8, generator=g, dtype=dtype)


def grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_split_backward_performs_each_matmul_of_one_backward_once():
    model = linear_stack()
    x, y, g = stage_output(model)
    with CountMatmuls() as whole:
        y.backward(g)
    expected, expected_input = grads(model), x.grad

    model = linear_stack()
    x, y, g = stage_output(model)
    with CountMatmuls() as input_pass:
        grad, weight_pass = backward_input([y], [g], x)
    assert all(p.grad is None for p in model.parameters())  # B leaves the weights alone
    with CountMatmuls() as weight_pass_count:
        weight_pass()
    # 3 layers: one backward does 3 input-gradient and 3 weight-gradient matmuls, the split as many
    assert whole.count == 6 and (input_pass.count, weight_pass_count.count) == (3, 3)
    assert torch.equal(grad, expected_input)
    assert all(torch.equal(grads(model)[n], expected[n]) for n in expected)


def test_weight_pass_accumulates_through_accumulate_grad_and_fires_its_hooks_once():
    model = linear_stack()
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    passes = []
    for seed in (1, 2):  # two micro-batches accumulate into the same .grad
        x, y, g = stage_output(model, seed=seed)
        passes.append(backward_input([y], [g], x)[1])
    assert fired == []
    for weight_pass in passes:
        weight_pass()
    names = [n for n, _ in model.named_parameters()]
    assert sorted(fired) == sorted(names * 2)

    reference = linear_stack()
    for seed in (1, 2):
        x, y, g = stage_output(reference, seed=seed)
        y.backward(g)
    assert all(torch.equal(grads(model)[n], grads(reference)[n]) for n in names)


class SharedWeights(nn.Module):
    """A weight used twice along the input path, one used by no input, one unused, a weights-only term."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.rand(8))
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        h = self.a(h) * self.scale  # self.a again
        return h + self.b.weight.sum(0)  # a term that depends on weights only


def test_split_backward_handles_shared_unused_and_weight_only_parameters():
    def run(split):
        model = SharedWeights().double()
        x, y, g = stage_output(model, torch.float64)
        if split:
            grad, weight_pass = backward_input([y], [g], x)
            weight_pass()
        else:
            y.backward(g)
            grad = x.grad
        return grad, grads(model)

    (grad, split), (expected_grad, expected) = run(True), run(False)
    assert expected["unused.weight"] is None and split["unused.weight"] is None
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    for name, value in expected.items():
        if value is not None:
            torch.testing.assert_close(split[name], value, rtol=0, atol=1e-12, msg=name)


class CountedCollective(torch.autograd.Function):
    """Identity forward, counted backward: stands in for the all-reduce of a tensor-parallel ``f``."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        CountedCollective.calls += 1
        return grad


def test_a_collective_in_the_backward_runs_once_across_both_passes():
    model = linear_stack()
    model[2].register_forward_pre_hook(lambda m, args: (CountedCollective.apply(args[0]),))  # on the input path
    CountedCollective.calls = 0
    x, y, g = stage_output(model)
    _, weight_pass = backward_input([y], [g], x)
    assert CountedCollective.calls == 1
    weight_pass()
    assert CountedCollective.calls == 1


def test_split_backward_under_autocast_and_activation_checkpointing():
    for mode in ("bf16", "checkpoint"):
        results = []
        for split in (True, False):
            model = linear_stack()
            x, _, g = stage_output(model)
            with torch.autocast("cpu", torch.bfloat16, enabled=mode == "bf16"):
                y = checkpoint(model, x, use_reentrant=False) if mode == "checkpoint" else model(x)
            if split:
                grad, weight_pass = backward_input([y], [g.to(y.dtype)], x)
                assert weight_pass.recomputed == (mode == "checkpoint")  # the engine stops splitting then
                weight_pass()
            else:
                y.backward(g.to(y.dtype))
                grad = x.grad
            results.append((grad, grads(model)))
        (grad, split), (expected_grad, expected) = results
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
        for name, value in expected.items():
            torch.testing.assert_close(split[name], value, rtol=0, atol=0, msg=f"{mode} {name}")


# ---- pipelines -----------------------------------------------------------------------------------
ACCUMULATE, CLIP = 2, 0.05


def single_device_accumulating(make_model, data):
    """One device, two batches per optimizer step, gradients clipped by their norm."""
    model = make_model()
    opt = model.configure_optimizers()
    losses = []
    for i, batch in enumerate(data):
        loss = model.training_step(batch, i)
        (loss / ACCUMULATE).backward()
        if (i + 1) % ACCUMULATE == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def pipeline_accumulating(mesh, make_model, data, micro_batches, schedule, virtual):
    """What the strategy does with accumulate_grad_batches=2 and gradient_clip_val: accumulate the
    scaled steps, sum tied gradients, clip by the norm of the whole model, step."""
    model = make_model()
    engine = PipelineEngine(model, mesh, ParallelOptions(micro_batches=micro_batches, schedule=schedule,
                                                         virtual_stages=virtual))
    engine.partition(data[0])
    opt = model.configure_optimizers()
    losses = []
    for i, batch in enumerate(data):
        losses.append(engine.training_step(batch, i, loss_scale=1 / ACCUMULATE).item())
        if (i + 1) % ACCUMULATE == 0:
            engine.sync_tied_grads()
            clip_grads_by_global_norm([p for p in model.parameters()], CLIP, mesh, engine.is_counted_once)
            opt.step()
            opt.zero_grad()
    assert engine.split_backward  # the weight passes did the weight gradients (no fallback to whole backwards)
    return losses, {k: v.numpy().copy() for k, v in model.state_dict().items()}


ZB_CONFIGS = [("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)]


def _zero_bubble_runs(rank, world):
    warnings.filterwarnings("ignore")
    mesh = make_mesh(rank, world, pp=world)
    # 2P micro-batches, the fewest dualpipev runs (of one and two samples at P = 4 and 2)
    return {cfg: pipeline_accumulating(mesh, gpt, batches(steps=4), 2 * world, *cfg) for cfg in ZB_CONFIGS}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages", [2, 4], ids=["pp2", "pp4"])
def test_zero_bubble_schedules_match_single_device_with_accumulation_and_clipping(stages):
    # the GPT ties its embedding and head: on two ranks for zb_h1, on rank 0 alone for the V shapes
    reference = single_device_accumulating(gpt, batches(steps=4))
    results = run_distributed(_zero_bubble_runs, stages, timeout=100)
    for cfg in ZB_CONFIGS:
        assert_matches(reference, [r[cfg] for r in results])


@pytest.mark.timeout(90)
def test_trainer_zbv_at_pp2_matches_single_device_with_accumulation_and_clipping(tmp_path):
    module, data = small_gpt(), token_data()
    flags = dict(accumulate_grad_batches=2, gradient_clip_val=CLIP)
    reference = fit_and_record(module, data, 8, str(tmp_path / "ref"), max_steps=3, **flags)[0]
    strategy = ParallelStrategy(pipeline_parallel=2, micro_batches=4, schedule="zbv", start_method="fork", timeout=60)
    records = fit_and_record(module, data, 8, str(tmp_path / "pp"), devices=2, strategy=strategy, max_steps=3,
                             use_distributed_sampler=False, **flags)
    assert strategy.options.chunks == 2  # implied by the V
    for record in records:
        assert record["losses"] == pytest.approx(reference["losses"], rel=LOSS_TOL, abs=LOSS_TOL)
        assert_params_close(record["params"], reference["params"], atol=PARAM_TOL)


@pytest.mark.timeout(90)
def test_trainer_zb_h1_pp2_x_tp2_matches_single_device_losses(tmp_path):
    # the tensor-parallel collectives of every backward run in its input-gradient pass only
    module, data = small_gpt(), token_data()
    reference = fit_and_record(module, data, 8, str(tmp_path / "ref"), max_steps=3)[0]
    strategy = ParallelStrategy(pipeline_parallel=2, tensor_parallel=2, micro_batches=4, schedule="zb_h1",
                                start_method="fork", timeout=60)
    records = fit_and_record(module, data, 8, str(tmp_path / "pp"), devices=4, strategy=strategy, max_steps=3,
                             use_distributed_sampler=False)
    for record in records:
        assert record["losses"] == pytest.approx(reference["losses"], rel=LOSS_TOL, abs=LOSS_TOL)


@pytest.mark.timeout(90)
def test_trainer_zb_h1_bf16_mixed_tracks_single_device(tmp_path):
    # as test_pp_training's bf16 test: step 1 agrees to bf16 rounding, later steps drift by the tied
    # gradient's two bf16-accumulated halves
    module, data = small_gpt(), token_data()
    reference = fit_and_record(module, data, 8, str(tmp_path / "ref"), max_steps=3, precision="bf16-mixed")[0]
    strategy = ParallelStrategy(pipeline_parallel=2, micro_batches=4, schedule="zb_h1", start_method="fork", timeout=60)
    records = fit_and_record(module, data, 8, str(tmp_path / "pp"), devices=2, strategy=strategy, max_steps=3,
                             precision="bf16-mixed", use_distributed_sampler=False)
    for record in records:
        assert record["losses"][0] == pytest.approx(reference["losses"][0], abs=1e-2)
        assert record["losses"] == pytest.approx(reference["losses"], abs=5e-2)


def _checkpointed_zb_h1(rank, world):
    from tests.pipeline.test_pp_checkpointing import checkpointed_gpt
    from tests.pipeline.test_pp_overlap import train_noting_split

    return train_noting_split(rank, world, checkpointed_gpt, "zb_h1")


@pytest.mark.timeout(60)
def test_zb_h1_with_activation_checkpointing_falls_back_to_whole_backwards_and_matches():
    from tests.pipeline.test_pp_checkpointing import checkpointed_gpt

    results = run_distributed(_checkpointed_zb_h1, 2)
    assert_matches(single_device(checkpointed_gpt, batches()), [r for r, _ in results])
    # stage 1's weight passes would recompute each checkpointed block again: its backwards became whole;
    # stage 0 has no input gradient, so its weight pass is its one whole backward, recomputing once
    assert [split for _, split in results] == [True, False]


# ---- the hook for overlapping the data-parallel reduction with the flush ---------------------------
FINAL_CONFIGS = [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)]


def _final_weight_contexts(rank, world):
    warnings.filterwarnings("ignore")
    mesh = make_mesh(rank, world, pp=world)
    found = {}
    for schedule, virtual in FINAL_CONFIGS:
        model = gpt()
        engine = PipelineEngine(model, mesh, ParallelOptions(micro_batches=4, schedule=schedule, virtual_stages=virtual))
        engine.partition()
        owners = engine.plan.module_stages()
        stages_of = {}  # local parameter -> the local stages whose modules use it
        for module_name, stage in owners.items():
            for p in model.get_submodule(module_name).parameters():
                stages_of.setdefault(p, set()).add(stage)
        events, inside = [], []

        @contextmanager
        def final(stage):
            events.append(("enter", stage))
            inside.append(stage)
            yield
            inside.pop()
            events.append(("exit", stage))

        engine.final_weight_context = final
        for p in stages_of:
            p.register_post_accumulate_grad_hook(lambda p: events.append(("grad", p, tuple(inside))))
        batch = batches(steps=1)[0]
        with torch.no_grad():  # evaluation on the same placement, as Lightning's predict loop runs it
            logits = engine.predict_step(batch[0], 0).numpy()  # the whole batch's logits, merged
        engine.training_step(batch, 0)
        entered = sorted(s for kind, s, *_ in events if kind == "enter")
        last_grad = {}
        for n, (kind, *rest) in enumerate(events):
            if kind == "grad":
                last_grad[rest[0]] = (n, rest[1])
        # the last accumulation into each parameter happens inside the context of one of its stages
        ok = all(set(within) & stages_of[p] for p, (_, within) in last_grad.items())
        found[(schedule, virtual)] = (entered, engine.plan.stages_of_rank(mesh.pp_rank), ok,
                                      len(last_grad) == len(stages_of), logits, len(engine.tied))
    return found


@pytest.mark.timeout(60)
def test_final_weight_context_wraps_each_local_stages_last_weight_gradient_once():
    for rank_found in run_distributed(_final_weight_contexts, 2):
        for config, (entered, local, last_inside, all_reached, logits, tied) in rank_found.items():
            assert entered == sorted(local), config  # once per local stage
            assert all_reached and last_inside, config
            # the GPT's tied embedding and head: two ranks that sum gradients, or one rank holding both ends of a V
            assert tied == (0 if config[0] in ("zbv", "dualpipev") else 1), config
            # every placement predicts what the looped one does (same blocks, same arithmetic)
            torch.testing.assert_close(torch.from_numpy(logits), torch.from_numpy(rank_found[("1f1b", 1)][4]),
                                       rtol=0, atol=0, msg=str(config))


@pytest.mark.timeout(90)
def test_zbv_checkpoint_consolidates_and_resumes_on_one_device_and_on_looped_stages(tmp_path):
    # the V puts stages 0 and 3 on rank 0: the checkpoint is put in order by stage, not by rank
    from tests.checkpoint.test_checkpoint import (
        assert_continues,
        consolidate_main,
        half_run,
    )
    from tests.checkpoint.test_checkpoint import train as train_and_record

    reference = train_and_record(tmp_path / "reference")[0]
    checkpoint = half_run(tmp_path / "zbv", devices=2, pp=2, schedule="zbv", micro_batches=4)
    plain = tmp_path / "plain.ckpt"
    consolidate_main([str(checkpoint), str(plain)])
    assert_continues(train_and_record(tmp_path / "one", ckpt_path=plain), reference)
    assert_continues(train_and_record(tmp_path / "1f1b", devices=2, pp=2, ckpt_path=checkpoint), reference)
