"""Partition of an unchanged model into pipeline stages (pure logic, one process)."""

import copy

import pytest
import torch
from torch import nn

from lightning_parallel.models.gpt import GPT
from lightning_parallel.pipeline.errors import (
    PipelineConfigError,
    PipelineIncompatibleModel,
)
from lightning_parallel.pipeline.microbatch import split_batch
from lightning_parallel.pipeline.order import trace_run_order
from lightning_parallel.pipeline.partition import (
    balance,
    find_blocks,
    plan_stages,
    shared_parameters,
)
from lightning_parallel.pipeline.stage_modules import (
    StageExit,
    StageRuntime,
    apply_stage_plan,
)


def gpt(n_layer=4):
    torch.manual_seed(0)
    return GPT(n_layer=n_layer, n_embd=32, n_head=2, block_size=16)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, bias=None):
        return torch.tanh(self.lin(x)) if bias is None else (torch.tanh(self.lin(x) + bias), bias * 2)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.emb(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


class Scaled(Plain):
    """Computes between blocks: cannot be split at a block boundary."""

    def forward(self, x):
        x = self.emb(x)
        for blk in self.blocks:
            x = blk(x) * 0.9
        return self.head(x)


class CrossState(Plain):
    """Passes a second tensor from block to block (T5's position bias)."""

    def forward(self, x):
        x, bias = self.emb(x), torch.zeros(8)
        for blk in self.blocks:
            x, bias = blk(x, bias)
        return self.head(x)


class HeadFirst(Plain):
    """Uses a module registered after the blocks before them."""

    def forward(self, x):
        x = self.emb(x)
        _ = self.head(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


def run_stage(model, stage, ranks=2, received=None, x=None):
    """Run ``model`` as pipeline stage ``stage`` of ``ranks`` in this process."""
    plan = plan_stages(model, ranks)
    runtime = StageRuntime()
    apply_stage_plan(model, plan, stage, runtime)
    runtime.begin(plan.stage_blocks[stage], stage < ranks - 1, received, 0)
    try:
        return model(torch.randn(3, 4) if x is None else x)
    finally:
        runtime.end()


def trace(model, x=None):
    x = torch.randn(3, 4) if x is None else x
    return trace_run_order(model, find_blocks(model)[0], lambda: model(x))


def test_finds_the_largest_list_of_repeated_blocks():
    assert find_blocks(gpt())[0] == "transformer.h"
    assert find_blocks(Plain())[0] == "blocks"


def test_model_without_block_list_is_a_clear_error():
    with pytest.raises(PipelineIncompatibleModel, match="no nn.ModuleList"):
        plan_stages(NoBlocks(), 2)
    with pytest.raises(PipelineConfigError, match="not a submodule"):
        plan_stages(gpt(), 2, blocks="transformer.blocks")


def test_pre_and_post_modules_follow_registration_around_the_blocks():
    plan = plan_stages(gpt(), 2)
    assert plan.pre == ("transformer.wte", "transformer.wpe")
    assert plan.post == ("transformer.ln_f", "lm_head")


@pytest.mark.parametrize("costs,parts,expected", [
    ([1] * 8, 2, [4, 4]), ([1] * 8, 4, [2, 2, 2, 2]), ([5, 1, 1, 1, 1, 5], 2, [3, 3]), ([1, 1, 1, 1, 4], 2, [4, 1]),
])
def test_balance_minimises_the_largest_stage(costs, parts, expected):
    assert balance(costs, parts) == expected


def test_balance_counts_what_the_end_stages_carry_besides_blocks():
    assert balance([1] * 6, 2, first_extra=2) == [2, 4]


@pytest.mark.parametrize("ranks,virtual", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2)])
def test_every_block_is_assigned_exactly_once_in_contiguous_stages(ranks, virtual):
    plan = plan_stages(gpt(8), ranks, virtual)
    assert [i for r in plan.stage_blocks for i in r] == list(range(8))
    assert len(plan.stage_blocks) == ranks * virtual and all(len(r) >= 1 for r in plan.stage_blocks)


def test_more_stages_than_blocks_is_a_clear_error():
    with pytest.raises(PipelineConfigError, match="only 4 blocks; use at most 4 stages"):
        plan_stages(gpt(4), 8)


def test_layout_from_config_is_used_and_checked():
    assert [len(r) for r in plan_stages(gpt(4), 2, layout=[1, 3]).stage_blocks] == [1, 3]
    with pytest.raises(PipelineConfigError, match="summing to the model's 4 blocks"):
        plan_stages(gpt(4), 2, layout=[1, 2])


def test_stage_keeps_only_its_parameters_and_the_block_names():
    full = gpt()
    names = set(full.state_dict())
    counts = []
    for stage in range(2):
        model = gpt()
        apply_stage_plan(model, plan_stages(model, 2), stage, StageRuntime())
        assert len(model.transformer.h) == 4
        assert set(model.state_dict()) <= names
        opt_params = {id(p) for g in model.configure_optimizers().param_groups for p in g["params"]}
        assert opt_params == {id(p) for p in model.parameters()}
        counts.append(sum(p.numel() for p in model.parameters()))
    tied = full.lm_head.weight.numel()
    assert sum(counts) == sum(p.numel() for p in full.parameters()) + tied  # the tied weight lives on both ends
    assert max(counts) < 0.6 * sum(counts)


def test_tied_embedding_and_head_are_shared_by_first_and_last_rank():
    model = gpt()
    assert shared_parameters(model, plan_stages(model, 4)) == [("transformer.wte.weight", (0, 3))]


def test_stage_output_is_the_hidden_state_of_its_last_block():
    with pytest.raises(StageExit) as exit_:
        run_stage(Plain(), 0)
    assert exit_.value.hidden.shape == (3, 8)


def test_last_stage_computes_the_model_output_from_the_received_hidden_state():
    assert run_stage(Plain(), 1, received=torch.randn(3, 8)).shape == (3, 2)


def test_operation_between_blocks_is_carried_across_the_boundary():
    """A stage ends at the next block's input, so the caller's op between the stages' blocks is included."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    full = Scaled()
    expected = full(x)
    with pytest.raises(StageExit) as exit_:
        run_stage(copy.deepcopy(full), 0, x=x)
    h = full.emb(x)
    for blk in full.blocks[:2]:
        h = blk(h) * 0.9
    assert torch.equal(exit_.value.hidden, h)  # the input of block 2, after the caller's scale
    assert torch.equal(run_stage(copy.deepcopy(full), 1, received=exit_.value.hidden, x=x), expected)


def test_state_other_than_the_hidden_state_between_blocks_is_refused():
    with pytest.raises(PipelineIncompatibleModel, match="other than the hidden state"):
        run_stage(CrossState(), 0)


def test_module_used_out_of_registration_order_is_refused_without_a_trace():
    with pytest.raises(PipelineIncompatibleModel, match="registered after the block list but runs before"):
        run_stage(HeadFirst(), 1, received=torch.randn(3, 8))


# ---- micro-batches ---------------------------------------------------------------------------


def test_batch_of_tensors_tuples_and_dicts_splits_along_dim0():
    batch = {"ids": torch.arange(8).view(8, 1), "pair": (torch.zeros(8), torch.ones(8, 2)), "flag": "train"}
    micro, weights = split_batch(batch, 4)
    assert [m["ids"].flatten().tolist() for m in micro] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(m["pair"][1].shape == (2, 2) and m["flag"] == "train" for m in micro)
    assert weights == [0.25] * 4


def test_uneven_micro_batches_are_weighted_by_their_share_of_the_batch():
    losses = torch.rand(10)
    micro, weights = split_batch(losses, 4)
    assert [len(m) for m in micro] == [3, 3, 2, 2]
    # sum of weight x micro-batch mean equals the full batch mean
    assert sum(w * m.mean() for w, m in zip(weights, micro)) == pytest.approx(losses.mean().item(), rel=1e-6)


def test_batch_smaller_than_micro_batch_count_runs_one_micro_batch_per_sample():
    micro, weights = split_batch(torch.arange(3), 4)
    assert [m.tolist() for m in micro] == [[0], [1], [2]]
    assert weights == pytest.approx([1 / 3] * 3)


def test_17_samples_in_4_micro_batches_keep_the_exact_batch_mean():
    losses = torch.rand(17, dtype=torch.float64)
    micro, weights = split_batch(losses, 4)
    assert [len(m) for m in micro] == [5, 4, 4, 4]
    assert sum(w * m.mean() for w, m in zip(weights, micro)).item() == pytest.approx(losses.mean().item(), rel=1e-12)


# ---- the order trace: where modules run, and what may cross a stage boundary -------------------------


class HeadRegisteredFirst(nn.Module):
    """Registers the head before the blocks (as LitGPT's GPT does) but runs it after them."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 2)
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        x = self.emb(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class Residual(Plain):
    """The caller adds the residual: ``h = h + block(h)``."""

    def forward(self, x):
        x = self.emb(x)
        for blk in self.blocks:
            x = x + blk(x)
        return self.head(x)


class LongSkip(Plain):
    """U-Net style: the output of block 0 is added again after block 2."""

    def forward(self, x):
        x = self.emb(x)
        skip = None
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i == 0:
                skip = x
            if i == 2:
                x = x + skip
        return self.head(x)


class EmbeddingToEveryBlock(Plain):
    """Passes the embedding output to every block (an ``x0`` residual)."""

    def forward(self, x):
        x0 = x = self.emb(x)
        for blk in self.blocks:
            x = blk(x) + 0 * blk.lin(x0)
        return self.head(x)


class MixesHiddenStates(Plain):
    """Uses every block's output after the loop (``output_hidden_states`` fed to the head)."""

    def forward(self, x):
        x = self.emb(x)
        states = []
        for blk in self.blocks:
            x = blk(x)
            states.append(x)
        return self.head(sum(states))


class ReadsBlockAttribute(Plain):
    """Reads a configuration attribute of each block, as Hugging Face's ``decoder_layer.attention_type``."""

    def __init__(self):
        super().__init__()
        for i, blk in enumerate(self.blocks):
            blk.attention_type = "sliding" if i % 2 else "full"
            blk.lin.layer_idx = i

    def forward(self, x):
        x = self.emb(x)
        for blk in self.blocks:
            scale = {"full": 1.0, "sliding": 0.5}[blk.attention_type] + 0 * blk.lin.layer_idx
            x = blk(x * scale)
        return self.head(x)


def test_modules_go_to_the_stage_where_they_run_not_where_they_are_registered():
    order = trace(HeadRegisteredFirst())
    assert order.pre == ("emb",) and order.post == ("head", "norm")
    plan = plan_stages(HeadRegisteredFirst(), 2, order=order)
    assert plan.module_stages()["head"] == 1 and plan.module_stages()["emb"] == 0


def test_stages_cut_by_run_order_reproduce_the_full_forward():
    torch.manual_seed(0)
    x, full = torch.randn(3, 4), HeadRegisteredFirst()
    order = trace(full, x)
    outputs = []
    received = None
    for stage in range(2):
        model, runtime = copy.deepcopy(full), StageRuntime()
        plan = plan_stages(model, 2, order=order)
        apply_stage_plan(model, plan, stage, runtime)
        runtime.begin(plan.stage_blocks[stage], stage == 0, received, 0)
        try:
            outputs.append(model(x))
        except StageExit as exit_:
            received = exit_.hidden
        finally:
            runtime.end()
    assert torch.equal(outputs[0], full(x))


def test_caller_side_residual_and_scaling_pass_the_trace():
    assert trace(Residual()).post == ("head",)
    assert trace(Scaled()).post == ("head",)


@pytest.mark.parametrize("model,message", [
    (LongSkip, "the hidden-state input of block 3 depends on the output of block 0"),
    (EmbeddingToEveryBlock, "depends on the output of a module that runs before the blocks"),
    (CrossState, "block 1 receives an output of block 0 other than the hidden state"),
    (MixesHiddenStates, "the step's result depends on the output of block"),
    (HeadFirst, "head holds parameters and runs both before and after the blocks"),
], ids=["unet-skip", "x0-residual", "cross-block-state", "hidden-states-after-loop", "module-on-both-sides"])
def test_what_cannot_cross_a_stage_boundary_is_refused_by_the_trace(model, message):
    with pytest.raises(PipelineIncompatibleModel, match=message):
        trace(model())


class NormedDropout(Plain):
    """Draws random numbers and updates batch-norm statistics in its forward."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        x = torch.nn.functional.dropout(self.emb(x), 0.5)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def test_trace_leaves_no_hooks_random_state_or_buffer_changes():
    model = NormedDropout()
    x = torch.randn(3, 4)
    before_rng, before_stats = torch.get_rng_state(), model.norm.running_mean.clone()
    trace_run_order(model, "blocks", lambda: model(x))
    assert torch.equal(torch.get_rng_state(), before_rng)
    assert torch.equal(model.norm.running_mean, before_stats)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    model(x)
    assert not torch.equal(model.norm.running_mean, before_stats)  # the check can fail


def test_skip_blocks_keep_the_attributes_the_caller_reads():
    torch.manual_seed(0)
    x, full = torch.randn(3, 4), ReadsBlockAttribute()
    with pytest.raises(StageExit) as exit_:
        run_stage(copy.deepcopy(full), 0, x=x)
    assert torch.allclose(run_stage(copy.deepcopy(full), 1, received=exit_.value.hidden, x=x), full(x), atol=1e-6)


class TripleBlock(Block):
    def forward(self, x):
        return torch.tanh(self.lin(x)), None, None


class UnpacksThree(Plain):
    """The caller unpacks three values from every block (RWKV's ``hidden, state, attentions``)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(TripleBlock() for _ in range(4))

    def forward(self, x):
        x = self.emb(x)
        for blk in self.blocks:
            x, _state, _attentions = blk(x)
        return self.head(x)


def test_skip_blocks_return_a_tuple_as_long_as_the_real_blocks():
    torch.manual_seed(0)
    x, full = torch.randn(3, 4), UnpacksThree()
    with pytest.raises(StageExit) as exit_:
        run_stage(copy.deepcopy(full), 0, x=x)
    model, runtime = copy.deepcopy(full), StageRuntime()
    plan = plan_stages(model, 2)
    apply_stage_plan(model, plan, 1, runtime)
    runtime.begin(plan.stage_blocks[1], False, exit_.value.hidden, 3)  # the convention stage 0 sends: a 3-tuple
    try:
        assert torch.equal(model(x), full(x))
    finally:
        runtime.end()


class CountsMetaRuns(nn.Linear):
    """A head whose forward counts its calls (the placeholder runs a meta copy, which shares the class)."""

    calls = 0

    def forward(self, x, scale=1.0):
        type(self).calls += 1
        return super().forward(x) * scale


class HeadWithArgument(Plain):
    def __init__(self):
        super().__init__()
        self.head = CountsMetaRuns(8, 2)

    def forward(self, x, scale=1.0):
        x = self.emb(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x, scale=scale)


def call_after_blocks(runtime, module, *args, **kwargs):
    """Call ``module`` as the forward of a stage would after its blocks."""
    runtime.begin(range(0, 2), False, None, 0)
    runtime.blocks_started = True
    try:
        return module(*args, **kwargs)
    finally:
        runtime.end()


def test_placeholder_runs_its_meta_copy_once_per_argument_signature():
    model = HeadWithArgument()
    plan = plan_stages(model, 2)
    runtime = StageRuntime()
    apply_stage_plan(model, plan, 0, runtime)  # stage 0: the head is a placeholder
    head = model.head
    CountsMetaRuns.calls = 0
    outputs = []
    for x, scale in [(torch.randn(3, 4), 1.0), (torch.randn(3, 4), 1.0), (torch.randn(5, 4), 1.0),
                     (torch.randn(5, 4), 2.0), (torch.randn(5, 4), 2.0)]:
        outputs.append(call_after_blocks(runtime, head, torch.randn(x.shape[0], 8), scale=scale))
    assert CountsMetaRuns.calls == 3  # (3 rows, 1.0), (5 rows, 1.0), (5 rows, 2.0)
    assert [tuple(o.shape) for o in outputs] == [(3, 2), (3, 2), (5, 2), (5, 2), (5, 2)]
    assert all(not o.any() and o.device.type == "cpu" for o in outputs)  # real zeros, never the cached meta tensor
    outputs[0].add_(1)  # writable, and not shared with the next call
    assert not call_after_blocks(runtime, head, torch.randn(3, 8), scale=1.0).any()


def test_per_sample_lists_split_with_the_tensors_and_scalars_go_whole():
    x = torch.arange(8).view(8, 1)
    batch = {"x": x, "names": [f"s{i}" for i in range(8)], "seqs": [torch.arange(2 + i) for i in range(8)],
             "scale": torch.tensor(2.0), "table": torch.ones(3, 4), "flag": True, "pair": [x, x + 1]}
    micro, weights = split_batch(batch, 4)
    assert weights == [0.25] * 4
    for k, mb in enumerate(micro):
        rows = list(range(2 * k, 2 * k + 2))
        assert mb["x"].flatten().tolist() == rows
        assert mb["names"] == [f"s{i}" for i in rows]  # one string per sample, with its sample
        assert [len(s) for s in mb["seqs"]] == [2 + i for i in rows]  # variable-length tensors whole
        assert mb["scale"].item() == 2.0 and mb["table"].shape == (3, 4) and mb["flag"] is True
        assert [p.flatten().tolist() for p in mb["pair"]] == [rows, [i + 1 for i in rows]]  # columns split


def test_batch_size_is_the_leading_size_most_tensors_share():
    table, x, y = torch.zeros(5, 2), torch.zeros(8, 3), torch.zeros(8)
    micro, _ = split_batch({"table": table, "x": x, "y": y}, 2)
    assert [tuple(m["x"].shape) for m in micro] == [(4, 3), (4, 3)]
    assert all(m["table"] is table for m in micro)


def test_whole_batch_values_are_named_for_the_setup_warning():
    from lightning_parallel.pipeline.microbatch import whole_batch_values

    batch = {"x": torch.zeros(4, 2), "n": torch.tensor(8.0), "extra": [torch.zeros(4), torch.tensor(1)]}
    assert whole_batch_values(batch) == ["batch['n']", "batch['extra'][1]"]
    assert whole_batch_values((torch.zeros(4), torch.zeros(4))) == []
