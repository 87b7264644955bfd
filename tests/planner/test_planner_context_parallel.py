"""The planner and context parallelism: searched only where asked for, activation memory divided by
the CP size (the head's logits not), the ring's exchanges in the predicted step, ZeRO over DP x CP,
and `lp-plan`'s report of a CP layout. Meta-device models, no processes."""

from __future__ import annotations

import pytest

from lightning_parallel.cli.launch_plan import build_plan, format_plan
from lightning_parallel.cli.overrides import compose_config
from lightning_parallel.planner import Constraints, Workload, search
from lightning_parallel.planner.space import enumerate_layouts
from tests.planner.test_planner import GPU, cluster, meta_gpt, one

WORK = Workload(seq=1024, global_batch=8)


def test_the_search_enumerates_cp1_unless_asked():
    model = meta_gpt(block_size=1024)
    assert {c.layout.cp for c in enumerate_layouts(model, cluster(devices=8), WORK)} == {1}
    asked = enumerate_layouts(model, cluster(devices=8), WORK, Constraints(cp=2))
    assert asked and {c.layout.cp for c in asked} == {2}
    for c in asked:
        assert c.layout.pp == 1 and c.layout.tp * c.layout.dp * 2 == 8  # never with pipelining
        assert c.layout.options()["context_parallel"] == 2 and "cp=2" in c.layout.describe()


def test_cp_divides_the_blocks_activations_but_not_the_logits():
    model = meta_gpt(block_size=1024, vocab_size=4096)
    work = Workload(seq=1024, replica_batch=2)
    memory = {cp: one(model, cluster(devices=4, memory=float("inf")), work, tp=1, cp=cp, dp=4 // cp)
              .candidate.memory[0] for cp in (1, 2, 4)}
    logits = 8 * 1024 * 2 * 4096  # float32 logits and their gradient, on every CP rank
    for cp in (2, 4):
        assert memory[cp].activation_bytes - logits == pytest.approx((memory[1].activation_bytes - logits) / cp)
        assert memory[cp].param_bytes == memory[1].param_bytes  # CP splits no parameter


def test_cp_layout_predicts_ring_exchanges_and_less_compute_per_device():
    model = meta_gpt(block_size=1024, n_embd=256, n_head=8)
    work = Workload(seq=1024, replica_batch=1)
    plain = one(model, cluster(devices=2, memory=float("inf")), work, tp=1, dp=2, cp=1).prediction
    split = one(model, cluster(devices=2, memory=float("inf")), work, tp=1, dp=1, cp=2).prediction
    assert plain.context_parallel == 0 and split.context_parallel > 0
    assert split.compute < plain.compute  # a half of the blocks' tokens each (the head on all of them)
    assert split.compute > plain.compute / 2


def test_zero_shards_the_optimizer_over_dp_and_cp_ranks():
    model, work = meta_gpt(block_size=1024), Workload(seq=1024, replica_batch=1)

    def optimizer_bytes(zero: bool) -> float:
        fixed = Constraints(tp=1, dp=2, cp=2, zero=zero, recompute=(False,))
        best = search(model, cluster(devices=4, memory=float("inf")), work, fixed).best
        return best.candidate.memory[0].optimizer_bytes

    assert optimizer_bytes(True) == pytest.approx(optimizer_bytes(False) / 4)


def test_lp_plan_reports_a_cp_layout_with_its_activation_memory_divided():
    def plan(cp: int):
        return build_plan(compose_config(["strategy=cp", "trainer.devices=4", f"strategy.context_parallel={cp}"]),
                          env={})

    one_device, split = plan(1), plan(2)
    assert split.mesh.cp_size == 2 and split.mesh.dp_size == 2
    assert split.memory[0].activation_bytes < 0.6 * one_device.memory[0].activation_bytes
    text = format_plan(split)
    assert "mesh: pp=1 x dp=2 x cp=2 x tp=1 = 4 processes" in text
    assert "cp groups: [0, 1] [2, 3]" in text
    assert "the blocks' activations per device are 1/2 of one device's" in text


def test_search_with_cp_fixed_ranks_layouts_around_it():
    result = search(meta_gpt(block_size=1024), cluster(devices=8, memory=float("inf"), rates=GPU), WORK,
                    Constraints(cp=4))
    assert {r.candidate.layout.cp for r in result.ranked} == {4}
