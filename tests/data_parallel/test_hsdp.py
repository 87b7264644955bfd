"""Hybrid sharding (HSDP, ``zero_shard_size``): ZeRO-2/3 sharded inside runs of data-parallel replicas and
replicated across them. The groups' arithmetic, the refusals of sizes that do not fit, and parity with one
device.

Tolerances: the documented float32 parity bound (losses 1e-5, parameters 1e-4 after several AdamW steps);
the runs differ from one device only in the association of float32 sums (a mean of replica means; a
reduce-scatter inside a shard group then an all-reduce across groups against one device's sum). A gradient
averaged over the shard group only, or summed over the replicate group without dividing, is off by
O(lr) = 1e-2; a clip on a norm that counts every replicate peer's rows again scales the step by up to
1/sqrt(2) (measured: parameters then off by more than 1e-4).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from lightning_parallel import DataParallelStrategy, ParallelStrategy
from lightning_parallel.checks.launch import validate_launch
from lightning_parallel.errors import ConfigurationError, LaunchError
from lightning_parallel.mesh import MeshError, ParallelMesh
from lightning_parallel.models.gpt import GPT
from lightning_parallel.options import ParallelOptions
from tests.data_parallel.test_zero_sharded import Holdings
from tests.helpers.parity import assert_close_series, assert_params_close, fit_and_record, mean_over_ranks
from tests.helpers.processes import run_distributed
from tests.strategy.test_3d import token_data


def test_shard_groups_are_runs_of_replicas_and_replicate_groups_cross_them():
    mesh = ParallelMesh(16, tensor_parallel=2, pipeline_parallel=2, zero_shard_size=2)  # dp = 4
    assert (mesh.dp_shard_size, mesh.dp_replicate_size, mesh.is_hybrid_sharded) == (2, 2, True)
    # dp ranks of pipeline 0, tp 0 are global ranks 0 2 4 6: runs [0 2] [4 6], replicas [0 4] [2 6]
    assert mesh.dp_shard_groups()[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.dp_replicate_groups()[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for kind in ("dp_shard", "dp_replicate"):
        groups = getattr(mesh, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(range(16))
        for group in groups:
            assert all(mesh.group_ranks(kind, r) == group for r in group)
    assert "zero shard groups: [0, 2] [1, 3] [4, 6]" in mesh.describe()
    assert not ParallelMesh(8, zero_shard_size=8).is_hybrid_sharded  # every replica: plain ZeRO


def test_shard_size_that_does_not_fit_is_refused_with_sizes_that_do():
    with pytest.raises(MeshError, match=r"zero_shard_size=3 does not divide data_parallel=4.*\(1, 2, 4\)"):
        ParallelMesh(8, tensor_parallel=2, zero_shard_size=3)
    # at launch, with the replicas of one node as the fix (4 devices per node, tp=2: 2 replicas a node)
    with pytest.raises(LaunchError, match=r"(?s)zero_shard_size=3 does not divide data_parallel=4.*\(1, 2, 4\)") as err:
        validate_launch(ParallelOptions(tensor_parallel=2, zero_stage=3, zero_shard_size=3), 2, 4)
    assert err.value.fixes[0].settings == {"strategy.zero_shard_size": 2}
    mesh = validate_launch(ParallelOptions(tensor_parallel=2, zero_stage=2, zero_shard_size=2), 2, 4)
    assert (mesh.dp_shard_size, mesh.dp_replicate_size) == (2, 2)
    with pytest.raises(ConfigurationError, match=r"zero_shard_size=2 .* only ZeRO-2/3 do, but zero_stage=1; use "
                                                 r"zero_stage=3 \(or 2\) with zero_shard_size=2"):
        ParallelStrategy(zero_stage=1, zero_shard_size=2)
    with pytest.raises(ConfigurationError, match="zero_shard_size must be a positive integer"):
        DataParallelStrategy(zero_stage=3, zero_shard_size=0)


def _hybrid_mesh_worker(rank, world):
    mesh = ParallelMesh(world, zero_shard_size=2).init_process_groups(rank)
    zero = mesh.zero_mesh
    sums = {}
    for name in ("dp_replicate", "dp_shard"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=zero.get_group(name))
        sums[name] = t.item()
    return zero.mesh_dim_names, zero.mesh.tolist(), sums, mesh.zero_shard_group is zero.get_group("dp_shard")


@pytest.mark.timeout(60)
def test_hybrid_mesh_is_the_replicas_as_replicate_by_shard():
    for rank, (names, layout, sums, shard_group) in enumerate(run_distributed(_hybrid_mesh_worker, 4)):
        assert names == ("dp_replicate", "dp_shard") and layout == [[0, 1], [2, 3]] and shard_group
        assert sums == {"dp_replicate": [2.0, 4.0][rank % 2], "dp_shard": [1.0, 5.0][rank // 2]}


class HybridHoldings(Holdings):
    """Also save the placements of a block's weight: replicated over the first mesh dimension, rows sharded
    over the second."""

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        weight = pl_module.transformer.h[0].mlp.c_fc.weight
        held = torch.load(f"{self.out_dir}/held{trainer.global_rank}.pt")
        held["placements"] = tuple(weight.placements)
        held["rows"] = weight.to_local().clone()
        torch.save(held, f"{self.out_dir}/held{trainer.global_rank}.pt")


@pytest.mark.timeout(180)
def test_zero3_shard2_on_4_ranks_with_accumulation_and_clipping_matches_single_device(tmp_path):
    L.seed_everything(0)
    module = GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, lr=1e-2)
    data = token_data()
    kwargs = dict(max_steps=3, gradient_clip_val=0.1, accumulate_grad_batches=2)
    ref = fit_and_record(module, data, batch_size=8, out_dir=str(tmp_path / "ref"), emulate_replicas=4, **kwargs)[0]
    strategy = DataParallelStrategy(start_method="fork", zero_stage=3, zero_shard_size=2)
    recs = fit_and_record(module, data, batch_size=2, out_dir=str(tmp_path / "hsdp"), devices=4, strategy=strategy,
                          callbacks=[HybridHoldings(str(tmp_path))], **kwargs)
    assert_close_series(mean_over_ranks(recs), ref["losses"], atol=1e-5)
    assert ref["losses"][-1] < ref["losses"][0]
    for rec in recs:
        assert_params_close(rec["params"], ref["params"], atol=1e-4)
    # ranks 0 1 shard every parameter in halves, and ranks 2 3 hold the same halves
    held = [torch.load(tmp_path / f"held{r}.pt") for r in range(4)]
    assert held[0]["placements"] == (Replicate(), Shard(0))
    torch.testing.assert_close(held[0]["rows"], held[2]["rows"], rtol=0, atol=0)
    for name, (_, shape) in held[0]["held"].items():
        assert held[0]["held"][name][0] + held[1]["held"][name][0] == shape.numel(), name
        assert [h["held"][name][0] for h in held[2:]] == [h["held"][name][0] for h in held[:2]], name

