"""Setup at scale, rehearsed in this process with torch's fake backend (``benchmarks/scale.py``): a
rank creates as many process groups at 512 ranks as at 64, and holds the parameters, gradients and
AdamW state that ``lp-plan`` estimates for it.

The model is the 4-layer Llama of ``llama_3d_cpu`` with its embedding and head tied, at TP2 x PP4:
the tied weight then sits on stages 0 and 3, which need a group of their own. The DP size is 8 at
64 ranks and 64 at 512.
"""

from __future__ import annotations

import pytest

from benchmarks.scale import lp_plan_estimate, rehearse
from lightning_parallel.cli.overrides import compose_config  # noqa: E402

WORLDS = (64, 512)


def _config(world: int):
    return compose_config([
        "+recipe=llama_3d_cpu", "model.config.tie_word_embeddings=true", f"trainer.num_nodes={world // 8}",
        "trainer.devices=8", "strategy.tensor_parallel=2",
        "strategy.pipeline_parallel=4", f"strategy.data_parallel={world // 8}",
    ])


@pytest.fixture(scope="module")
def setups():
    """(world, rank) -> RankSetup for the first, a middle and the last rank of each world."""
    result = {}
    for world in WORLDS:
        cfg = _config(world)
        estimate = lp_plan_estimate(cfg)
        for rank in (0, 1, world // 2, world - 1):
            result[world, rank] = rehearse("llama", world, rank, cfg, estimate)
    return result


def test_process_groups_a_rank_creates_do_not_grow_with_the_data_parallel_size(setups):
    small, large = WORLDS
    for rank in (0, 1, "middle", "last"):
        a = setups[small, {"middle": small // 2, "last": small - 1}.get(rank, rank)]
        b = setups[large, {"middle": large // 2, "last": large - 1}.get(rank, rank)]
        assert (a.stage, b.dp) == (b.stage, large // 8)
        assert a.new_group_calls == b.new_group_calls, rank
        assert a.groups_held == b.groups_held, rank
    # tp, dp and pp groups, and the tied embedding's group (stages 0 and 3) or its stand-in
    assert {s.new_group_calls for s in setups.values()} == {4}


def test_each_rank_holds_the_parameters_lp_plan_estimates(setups):
    for (world, rank), s in setups.items():
        params, param_bytes, grad_bytes, optimizer_bytes = s.estimate
        assert s.params == params, (world, rank)
        assert s.param_bytes == param_bytes and s.optimizer_bytes == optimizer_bytes, (world, rank)
        # the DP buckets pad to a multiple of the DP size and keep one flag per parameter
        assert grad_bytes <= s.grad_bytes <= grad_bytes * 1.05, (world, rank)
