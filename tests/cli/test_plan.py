"""The dry-run planner: recipes compose, parameter and memory estimates, refusals with the fix.

Everything here runs in one process on meta-device models: no SLURM, no training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module

from lightning_parallel.checks.launch import check_allocation, validate_launch
from lightning_parallel.cli.launch_plan import build_plan
from lightning_parallel.cli.plan import main
from lightning_parallel.errors import LaunchError
from lightning_parallel.models.gpt import GPT
from lightning_parallel.options import ParallelOptions
from lightning_parallel.planner.estimate import TransformerDims, layer_activation_bytes
from tests.helpers.pretrained import save_tiny_llama

RECIPES = sorted(
    p.stem
    for p in (Path(__file__).parents[2] / "lightning_parallel/conf/recipe").glob("*.yaml")
    if p.stem not in ("cpu_common", "submitit")  # fragments that other recipes include
)


def config(*overrides: str):
    with initialize_config_module("lightning_parallel.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    """The planner also reads the SLURM allocation; these tests plan as on a login node."""
    for name in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    """The model the fine-tuning recipe loads: byte-level text needs a vocabulary of 256."""
    return save_tiny_llama(tmp_path_factory.mktemp("pretrained") / "llama", vocab=256)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_plans_without_error(recipe, pretrained):
    given = [f"model.pretrained={pretrained}"] if recipe.startswith("finetune") else []
    plan = build_plan(config(f"+recipe={recipe}", *given))
    assert plan.mesh.world_size == plan.num_nodes * plan.devices_per_node
    assert plan.memory and all(m.total_bytes > 0 for m in plan.memory)


def test_recipes_include_gpu_and_cpu_variants_of_each_workload():
    assert {"gpt2_124m_dp8", "gpt_1p3b_3d", "llama_7b_3d", "gpt2_cpu_dp2", "gpt_3d_cpu", "llama_3d_cpu"} <= set(RECIPES)


@pytest.mark.timeout(30)
def test_gpt2_recipe_counts_gpt2_small_parameters():
    # by hand: 12 blocks x (12 d^2 + 13 d) + wte 50304 d + wpe 1024 d + ln_f 2 d, d = 768, head tied to wte
    d = 768
    expected = 12 * (12 * d * d + 13 * d) + 50304 * d + 1024 * d + 2 * d
    plan = build_plan(config("+recipe=gpt2_124m_dp8"))
    assert plan.parameters == expected == 124_475_904
    assert plan.tokens_per_step == 16 * 1024 * 8 * 4


@pytest.mark.timeout(30)
def test_llama_recipe_counts_llama2_7b_parameters():
    plan = build_plan(config("+recipe=llama_7b_3d"))
    h, f, L, V = 4096, 11008, 32, 32000
    # per layer: q, k, v, o (4 h^2) + gate, up, down (3 h f) + 2 RMSNorm; embedding, head, final norm
    assert plan.parameters == L * (4 * h * h + 3 * h * f + 2 * h) + 2 * V * h + h


@pytest.mark.timeout(30)
def test_pipeline_ranks_hold_every_parameter_once_plus_the_tied_head():
    total = build_plan(config("+recipe=gpt_3d_cpu", "strategy.tensor_parallel=1", "strategy.data_parallel=2"))
    # the tied embedding/head matrix sits on the first and the last stage
    tied = 256 * 64
    assert sum(m.params for m in total.memory) == total.parameters + tied


@pytest.mark.timeout(30)
def test_tensor_parallel_halves_the_block_matrices():
    tp1 = build_plan(config("+recipe=gpt_3d_cpu", "strategy.tensor_parallel=1", "strategy.data_parallel=2"))
    tp2 = build_plan(config("+recipe=gpt_3d_cpu"))
    d = 64
    # last stage: 2 blocks, ln_f, tied head (256 x d). Matrices (12 d^2 per block, head) halve; the
    # c_attn (3d) and c_fc (4d) biases are column-parallel and halve too; the other vectors stay whole.
    matrices = 2 * 12 * d * d + 256 * d
    assert tp1.memory[1].params - tp2.memory[1].params == matrices // 2 + 2 * (3 * d + 4 * d) // 2


def test_activation_formula_is_korthikanti_table_2():
    dims = TransformerDims(hidden=2048, heads=16, vocab=50304)
    s, b = 2048, 2
    sbh = s * b * 2048
    full = sbh * (34 + 5 * 16 * s / 2048)
    assert layer_activation_bytes(dims, s, b, 1, False, act_bytes=2) == pytest.approx(full)
    assert layer_activation_bytes(dims, s, b, 8, True, act_bytes=2) == pytest.approx(full / 8)
    assert layer_activation_bytes(dims, s, b, 8, False, act_bytes=2) == pytest.approx(sbh * (10 + 24 / 8 + 5 * 16 * s / (2048 * 8)))
    assert layer_activation_bytes(dims, s, b, 1, False, act_bytes=4) == pytest.approx(2 * full)


@pytest.mark.timeout(30)
def test_1f1b_keeps_pipeline_depth_in_flight_and_gpipe_all_micro_batches():
    one_f_one_b = build_plan(config("+recipe=gpt_1p3b_3d"))
    gpipe = build_plan(config("+recipe=gpt_1p3b_3d", "strategy.schedule=gpipe"))
    assert [m.in_flight for m in one_f_one_b.memory] == [2, 1]
    assert [m.in_flight for m in gpipe.memory] == [8, 8]
    assert gpipe.memory[0].activation_bytes > 3 * one_f_one_b.memory[0].activation_bytes


@pytest.mark.timeout(30)
def test_dry_run_prints_groups_nodes_stages_and_memory(capsys):
    main(["+recipe=gpt_1p3b_3d"])
    out = capsys.readouterr().out
    assert "tp groups: [0, 1] [2, 3] [4, 5] [6, 7]" in out
    assert "pp groups: [0, 4] [1, 5] [2, 6] [3, 7]" in out
    assert "rank    4: stage 1 replica 0 shard 0 node 1" in out
    assert "stage 1 (pp rank 1): blocks 12-23" in out
    assert "peak per device" in out


@pytest.mark.timeout(30)
def test_lp_train_dry_run_prints_the_plan_and_trains_nothing(capsys):
    from lightning_parallel.cli.train import train

    assert train(config("+recipe=gpt_3d_cpu", "dry_run=true")) == {}
    assert "mesh: pp=2 x dp=1 x tp=2 = 4 processes" in capsys.readouterr().out


def refusal(*overrides: str) -> str:
    with pytest.raises(LaunchError) as err:
        build_plan(config(*overrides))
    return str(err.value)


@pytest.mark.timeout(30)
def test_layout_larger_than_allocation_is_refused_with_sbatch_lines():
    message = refusal("+recipe=gpt_1p3b_3d", "trainer.num_nodes=1")
    # the nodes stay those the allocation has: the layout's 8 processes on its one node
    assert "#SBATCH --nodes=1\n    #SBATCH --ntasks-per-node=8" in message and "--nodes=2" not in message
    assert "strategy.data_parallel=1" in message


@pytest.mark.timeout(30)
def test_tp_group_spanning_nodes_is_refused():
    message = refusal("+recipe=llama_7b_3d", "strategy.tensor_parallel=16", "strategy.data_parallel=1")
    assert "span two nodes" in message
    assert "strategy.tensor_parallel=8 strategy.data_parallel=2" in message


@pytest.mark.timeout(30)
def test_tp_size_not_dividing_heads_is_refused_with_sizes_that_work():
    message = refusal("+recipe=gpt_3d_cpu", "model.n_head=3", "model.n_embd=48")
    assert "not divisible by tensor_parallel=2" in message
    assert "strategy.tensor_parallel=1" in message


@pytest.mark.timeout(30)
def test_more_stages_than_blocks_is_refused():
    message = refusal("+recipe=gpt_3d_cpu", "model.n_layer=2", "strategy.tensor_parallel=1", "strategy.pipeline_parallel=4")
    assert "strategy.pipeline_parallel=2" in message


@pytest.mark.timeout(30)
def test_micro_batches_not_dividing_batch_is_refused():
    assert "data.batch_size=6" in refusal("+recipe=gpt_3d_cpu", "data.batch_size=7", "strategy.micro_batches=3")


def test_allocation_differing_from_trainer_is_refused():
    env = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "lp-train"}
    with pytest.raises(LaunchError) as err:
        check_allocation(1, 4, env)
    assert "#SBATCH --ntasks-per-node=4" in str(err.value) and "trainer.devices=2" in str(err.value)
    check_allocation(1, 2, env)


def test_ntasks_without_ntasks_per_node_is_refused():
    env = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS": "8", "SLURM_JOB_NAME": "lp-train"}
    with pytest.raises(LaunchError, match="--ntasks-per-node=4"):
        check_allocation(2, 4, env)


def test_interactive_job_name_is_refused():
    env = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "bash"}
    with pytest.raises(LaunchError, match="--job-name"):
        check_allocation(1, 2, env)


def test_validate_launch_returns_the_mesh_and_checks_the_model():
    model = GPT(n_layer=2, n_head=4, n_embd=32, block_size=16)
    mesh = validate_launch(ParallelOptions(tensor_parallel=2, pipeline_parallel=2), 2, 4, model=model)
    assert (mesh.pp_size, mesh.dp_size, mesh.tp_size) == (2, 2, 2)
    with pytest.raises(LaunchError, match="tensor_parallel"):
        validate_launch(ParallelOptions(tensor_parallel=8), 1, 8, model=model)  # 4 heads


@pytest.mark.timeout(30)
def test_hf_causal_lm_predicts_y_without_shifting_it_again():
    from lightning_parallel.models.hf_causal_lm import HFCausalLM

    torch.manual_seed(0)
    config = {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
    }
    lm = HFCausalLM(config)
    window = torch.randint(0, 64, (2, 17))
    x, y = window[:, :-1], window[:, 1:]
    # Hugging Face's own loss with labels = inputs shifts once: logits[t] against x[t + 1] = y[t], t < T - 1
    hf = lm.model(input_ids=x, labels=x).loss
    # causal: the first T - 1 logits do not depend on the last input token
    ours = lm._loss((x[:, :-1], y[:, :-1]))
    torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-6)  # same float32 ops, different reduction order
    assert not torch.allclose(ours, F.cross_entropy(lm(x)[:, :-1].reshape(-1, 64), y[:, 1:].reshape(-1)))
