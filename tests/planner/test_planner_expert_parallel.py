"""The planner and expert parallelism: searched only where asked for (without pipelining and ZeRO, on DP
sizes it divides), the routed experts' parameters divided by the EP size (the rest not), the all-to-alls in
the predicted step, and an expert count EP does not divide leaves no layout. Meta-device models."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.planner import Constraints, Workload
from lightning_parallel.planner.experts import all_to_all_bytes, expert_elements
from lightning_parallel.planner.space import enumerate_layouts
from tests.planner.test_planner import cluster, one

WORK = Workload(seq=256, replica_batch=2)


def meta_mixtral(experts: int = 8):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                           num_experts_per_tok=2, max_position_embeddings=512)
    with torch.device("meta"):
        return MixtralForCausalLM(config)


def test_the_search_enumerates_ep1_unless_asked_and_ep_only_where_it_fits():
    model = meta_mixtral()
    assert {c.layout.ep for c in enumerate_layouts(model, cluster(devices=8), WORK)} == {1}
    asked = enumerate_layouts(model, cluster(devices=8), WORK, Constraints(ep=4))
    assert asked and {c.layout.ep for c in asked} == {4}
    for c in asked:
        assert c.layout.pp == 1 and c.layout.zero == 0 and c.layout.dp % 4 == 0
        assert c.layout.options()["expert_parallel"] == 4 and "ep=4" in c.layout.describe()
    assert not enumerate_layouts(meta_mixtral(experts=6), cluster(devices=8), WORK, Constraints(ep=4))


def test_ep_divides_the_experts_parameters_and_nothing_else():
    model = meta_mixtral()
    experts = expert_elements(model, set(), 1)
    assert experts == 2 * (8 * 2 * 128 * 64 + 8 * 64 * 128)  # two layers' gate_up_proj and down_proj
    held = {ep: one(model, cluster(devices=4, memory=float("inf")), WORK, tp=1, dp=4, ep=ep).candidate.memory[0]
            for ep in (1, 2, 4)}
    for ep in (2, 4):
        assert held[1].params - held[ep].params == experts * (ep - 1) // ep
        assert held[ep].optimizer_bytes == pytest.approx(held[ep].params * 8)
        assert held[ep].activation_bytes == held[1].activation_bytes


def test_ep_layout_predicts_its_all_to_alls():
    model = meta_mixtral()
    plain = one(model, cluster(devices=4, memory=float("inf")), WORK, tp=1, dp=4, ep=1).prediction
    split = one(model, cluster(devices=4, memory=float("inf")), WORK, tp=1, dp=4, ep=4).prediction
    assert plain.expert_parallel == 0 and split.expert_parallel > 0
    # 4 all-to-alls per MoE layer of 2 x 512 token copies of 64 float32 elements, 3/4 of them to other ranks
    sent = all_to_all_bytes(512, 64, 2, 2, 4, 4)
    assert sent == 4 * 2 * 2 * 512 * 64 * 4 * 3 / 4
    rates = cluster().rates
    assert split.expert_parallel == pytest.approx(sent / rates.intra_bandwidth + 4 * 2 * 3 * rates.latency)
    assert split.bytes_moved >= sent  # counted with the other collectives' bytes


def test_lp_plan_reports_an_ep_layout_with_the_experts_divided():
    from lightning_parallel.cli.launch_plan import build_plan, format_plan
    from lightning_parallel.cli.overrides import compose_config

    def plan(ep: int):
        return build_plan(compose_config(
            ["strategy=ep", "trainer.devices=4", f"strategy.expert_parallel={ep}", "model=custom",
             "model._target_=tests.expert_parallel.test_ep_training.MoELM", "data.block_size=8"]), env={})

    held = {ep: plan(ep).memory[0].params for ep in (1, 2, 4)}
    experts = 2 * (4 * 64 * 32 + 4 * 32 * 32)  # Mixtral's 2 layers of 4 experts (hidden 32, intermediate 32)
    assert held[1] - held[2] == experts // 2 and held[1] - held[4] == experts * 3 // 4
    text = format_plan(plan(2))
    assert "ep groups: [0, 1] [2, 3]" in text and "expert dp groups: [0, 2] [1, 3]" in text
    assert f"{held[2]:,} of {held[1]:,})" in text  # the share of the largest rank
