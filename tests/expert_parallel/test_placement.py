"""Expert parallelism without processes: which experts a rank owns, the groups carved from the data-parallel
ranks, and the refusals (an expert count or data-parallel size that does not divide, unsupported compositions,
a model without routed experts)."""

import pytest
import torch

from lightning_parallel.checkpoint.chunks import tp_chunks
from lightning_parallel.checkpoint.format import (
    ExpertRows,
    global_shape,
    local_shape,
    local_tensor,
)
from lightning_parallel.checks.launch import validate_launch
from lightning_parallel.errors import (
    ConfigurationError,
    IncompatibleModelError,
    LaunchError,
)
from lightning_parallel.expert_parallel import find_experts, owned_experts
from lightning_parallel.expert_parallel.placement import owner_of
from lightning_parallel.mesh import MeshError, ParallelMesh
from lightning_parallel.options import ParallelOptions
from lightning_parallel.tensor_parallel.shard import TPShard


def test_each_rank_owns_a_contiguous_run_of_whole_experts():
    shards = [owned_experts(8, 4, r) for r in range(4)]
    assert [list(s.ids) for s in shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [owner_of(e, 8, 4) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_expert_count_that_does_not_divide_is_refused_with_the_sizes_that_work():
    with pytest.raises(ConfigurationError, match=r"expert_parallel=3 does not divide the 8 experts.*\(1, 2, 4, 8\)"):
        owned_experts(8, 3, 0)


def test_ep_groups_are_runs_of_dp_replicas_and_expert_replicas_the_rest():
    mesh = ParallelMesh(8, tensor_parallel=2, expert_parallel=2)  # dp=4
    assert mesh.ep_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.edp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (mesh.coords(6).ep, mesh.coords(6).edp, mesh.coords(6).tp) == (1, 1, 0)
    assert mesh.edp_size == 2
    every = sorted(r for g in mesh.ep_groups() for r in g)
    assert every == list(range(8))
    # an expert-parallel group shares (pp, cp, tp) and lies inside one DP group
    dp_of = {r: tuple(g) for g in mesh.dp_groups() for r in g}
    for group in mesh.ep_groups() + mesh.edp_groups():
        assert len({dp_of[r] for r in group}) == 1


def test_ep_equal_to_dp_leaves_each_expert_on_one_rank():
    mesh = ParallelMesh(4, expert_parallel=4)
    assert mesh.ep_groups() == [[0, 1, 2, 3]] and mesh.edp_groups() == [[0], [1], [2], [3]]


def test_ep_that_does_not_divide_dp_is_refused():
    with pytest.raises(MeshError, match=r"expert_parallel=4 does not divide data_parallel=6.*\(1, 2, 3, 6\)"):
        ParallelMesh(6, expert_parallel=4)
    with pytest.raises(LaunchError, match="expert_parallel=4 does not divide data_parallel=2"):
        validate_launch(ParallelOptions(expert_parallel=4, tensor_parallel=2), 1, 4)


@pytest.mark.parametrize("other", [dict(pipeline_parallel=2), dict(context_parallel=2), dict(zero_stage=2),
                                   dict(zero_stage=3)])
def test_unsupported_compositions_are_refused(other):
    with pytest.raises(ConfigurationError, match="expert_parallel=2 with .* is not supported"):
        ParallelOptions(expert_parallel=2, **other)


def test_expert_parallel_counts_as_a_split_model():
    assert ParallelOptions(expert_parallel=2).is_model_split
    assert ParallelOptions(expert_parallel=2).mesh_sizes["expert_parallel"] == 2


def tiny_mixtral(experts: int = 4):
    from transformers import MixtralConfig, MixtralForCausalLM

    with torch.device("meta"):
        return MixtralForCausalLM(MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                                num_attention_heads=2, num_key_value_heads=1, num_local_experts=experts))


def test_experts_modules_are_found_and_checked_before_launch():
    assert sorted(find_experts(tiny_mixtral())) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    # 3 divides the experts but not the 4 data-parallel ranks: the fix is 2
    with pytest.raises(LaunchError, match="(?s)does not divide the 6 experts.*expert_parallel=2"):
        validate_launch(ParallelOptions(expert_parallel=4), 1, 4, model=tiny_mixtral(6))
    validate_launch(ParallelOptions(expert_parallel=2), 1, 4, model=tiny_mixtral(6))


def test_a_model_without_routed_experts_is_refused():
    with pytest.raises(LaunchError, match="no Mixture-of-Experts layer"):
        validate_launch(ParallelOptions(expert_parallel=2), 1, 2, model=torch.nn.Linear(4, 4))


def test_llama4_style_pre_routed_experts_are_refused():
    class PreRouted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 16))
            self.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 8))

        def forward(self, hidden_states):
            return hidden_states

    with pytest.raises(IncompatibleModelError, match="already routed"):
        find_experts(torch.nn.Sequential(PreRouted()))


def test_expert_rows_are_saved_at_their_global_ids():
    rows = ExpertRows(first=2, count=2, total=4)
    assert global_shape(torch.Size([2, 8, 6]), rows, 1) == (4, 8, 6)
    assert local_shape((4, 8, 6), rows, 1) == (2, 8, 6)
    [chunk] = tp_chunks((4, 8, 6), rows, 0, 1)
    assert (chunk.offsets, chunk.sizes) == ((2, 0, 0), (2, 8, 6))
    full = torch.arange(4 * 8 * 6).view(4, 8, 6)
    assert torch.equal(local_tensor(full, rows, 0, 1), full[2:4])
    # with TP: this TP rank's half of the intermediate features of experts 2 and 3
    both = ExpertRows(first=2, count=2, total=4, tp=TPShard(dim=1, fused=2))
    assert global_shape(torch.Size([2, 4, 6]), both, 2) == (4, 8, 6)
    chunks = tp_chunks((4, 8, 6), both, 1, 2)
    assert [(c.offsets, c.sizes) for c in chunks] == [((2, 2, 0), (2, 2, 6)), ((2, 6, 0), (2, 2, 6))]


def test_strategy_refuses_before_any_worker_starts():
    import lightning as L

    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.strategy import ParallelStrategy
    from tests.expert_parallel.test_ep_training import MoELM, tokens

    def fit(module, devices=4, **sizes):
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=ParallelStrategy(start_method="fork", **sizes),
                            max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
        trainer.fit(module, torch.utils.data.DataLoader(tokens(), batch_size=2))

    with pytest.raises(LaunchError, match="no Mixture-of-Experts layer"):
        fit(GPT(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16), expert_parallel=2)
    with pytest.raises(LaunchError, match="(?s)does not divide the 4 experts.*expert_parallel=4"):
        fit(MoELM(), devices=8, expert_parallel=8)
    with pytest.raises(ConfigurationError, match="expert_parallel=2 with pipeline_parallel=2"):
        fit(MoELM(), expert_parallel=2, pipeline_parallel=2)
