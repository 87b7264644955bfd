"""Mesh rank arithmetic (no processes) and its errors; the process groups and DeviceMesh built on it."""

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_parallel import compat
from lightning_parallel.mesh import MeshError, ParallelMesh
from tests.helpers.processes import run_distributed


def test_tp_varies_fastest_then_dp_then_pp():
    mesh = ParallelMesh(8, tensor_parallel=2, pipeline_parallel=2)
    assert mesh.dp_size == 2
    assert [(c.pp, c.dp, c.tp) for c in map(mesh.coords, range(8))] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]
    assert mesh.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (4, 4, 1), (6, 3, 2), (12, 2, 3), (16, 2, 4)])
def test_groups_partition_the_world_and_rank_of_inverts_coords(world, tp, pp):
    mesh = ParallelMesh(world, tensor_parallel=tp, pipeline_parallel=pp)
    for kind in ("tp", "dp", "pp"):
        groups = getattr(mesh, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(range(world))
    for r in range(world):
        c = mesh.coords(r)
        assert mesh.rank_of(c.pp, c.dp, c.tp) == r
        assert r in mesh.group_ranks("tp", r)


def test_auto_data_parallel_takes_the_ranks_left_over():
    assert ParallelMesh(12, tensor_parallel=2, pipeline_parallel=3, data_parallel="auto").dp_size == 2
    assert ParallelMesh(12, tensor_parallel=2, pipeline_parallel=3, data_parallel=-1).dp_size == 2


def test_product_that_does_not_match_the_world_names_layouts_that_fit():
    with pytest.raises(MeshError, match=r"= 8 processes, but the world size is 6.*tp=2 pp=3 dp=1"):
        ParallelMesh(6, tensor_parallel=2, pipeline_parallel=2, data_parallel=2)
    with pytest.raises(MeshError, match="does not divide the world size 6"):
        ParallelMesh(6, tensor_parallel=4)
    with pytest.raises(MeshError, match="positive integer"):
        ParallelMesh(4, tensor_parallel=0)


def test_describe_places_ranks_on_nodes():
    text = ParallelMesh(4, tensor_parallel=2).describe(devices_per_node=2)
    assert "rank    3: stage 0 replica 1 shard 1 node 1" in text
    assert "tp groups: [0, 1] [2, 3]" in text


def _groups_worker(rank, world):
    with compat.counting_new_group_calls() as calls:
        mesh = ParallelMesh(world, tensor_parallel=2, pipeline_parallel=2).init_process_groups(rank)
    out = {}
    for kind in ("tp", "dp", "pp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=getattr(mesh, f"{kind}_group"))
        out[kind] = t.item()
    ours = mesh.device_mesh
    torch_mesh = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=("pp", "dp", "tp"))
    same = ours.mesh.tolist() == torch_mesh.mesh.tolist() and all(
        ours.get_group(d) is getattr(mesh, f"{d}_group")
        and dist.get_process_group_ranks(ours.get_group(d)) == dist.get_process_group_ranks(torch_mesh.get_group(d))
        for d in ("pp", "dp", "tp")
    )
    # a DTensor sharded over the TP dimension: each rank holds its TP rank's rows, all-gathered back whole
    rows = torch.arange(8.0).view(4, 2) + 100 * mesh.coords(rank).dp
    dtensor = distribute_tensor(rows, ours["tp"], [Shard(0)])
    dtensor_ok = torch.equal(dtensor.to_local(), rows.chunk(2)[mesh.tp_rank])
    dtensor_ok = dtensor_ok and torch.equal(dtensor.full_tensor(), rows)
    return out, mesh.pp_next_rank, mesh.pp_prev_rank, same and dtensor_ok, calls[0]


@pytest.mark.timeout(60)
def test_process_groups_reduce_over_the_right_ranks_and_are_the_device_meshs_dimensions():
    results = run_distributed(_groups_worker, 8)
    mesh = ParallelMesh(8, tensor_parallel=2, pipeline_parallel=2)
    for rank, (sums, nxt, prv, same_as_init_device_mesh_and_carries_dtensors, new_group_calls) in enumerate(results):
        assert same_as_init_device_mesh_and_carries_dtensors, rank
        assert new_group_calls == 3  # its own tp, dp and pp groups, none of the other ranks'
        for kind, value in sums.items():
            assert value == sum(mesh.group_ranks(kind, rank))
        c = mesh.coords(rank)
        assert nxt == (mesh.rank_of(1, c.dp, c.tp) if c.pp == 0 else None)
        assert prv == (mesh.rank_of(0, c.dp, c.tp) if c.pp == 1 else None)


def _stage_groups_worker(rank, world):
    mesh = ParallelMesh(world, pipeline_parallel=world).init_process_groups(rank)
    # overlapping sets that members reach after different numbers of other sets
    sets = [(0, 3), (0, 1, 2, 3), (1, 2), (0, 1)]
    with compat.counting_new_group_calls() as calls:
        groups = mesh.stage_groups(sets)
    sums = {}
    for stages, group in groups.items():
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        sums[stages] = t.item()
    return sums, calls[0], groups[(0, 1, 2, 3)] is mesh.pp_group


@pytest.mark.timeout(60)
def test_stage_groups_are_created_by_their_pipelines_ranks_only_and_reduce_over_their_stages():
    for rank, (sums, calls, whole_is_pp_group) in enumerate(run_distributed(_stage_groups_worker, 4)):
        assert whole_is_pp_group
        assert sums == {s: float(sum(s)) for s in [(0, 3), (0, 1, 2, 3), (1, 2), (0, 1)] if rank in s}
        assert calls == 3  # one per set other than the whole pipeline, its own or a stand-in


def test_cp_varies_between_tp_and_dp_and_its_groups_partition_the_world():
    mesh = ParallelMesh(16, tensor_parallel=2, context_parallel=2, pipeline_parallel=2)
    assert mesh.dp_size == 2 and mesh.dims == ("pp", "dp", "cp", "tp")
    assert [(c.pp, c.dp, c.cp, c.tp) for c in map(mesh.coords, range(4))] == [(0, 0, 0, 0), (0, 0, 0, 1),
                                                                             (0, 0, 1, 0), (0, 0, 1, 1)]
    assert mesh.cp_groups()[:2] == [[0, 2], [1, 3]]
    assert mesh.dp_cp_groups()[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradients averaged over DP and CP together
    for kind in ("tp", "dp", "cp", "pp", "dp_cp"):
        groups = getattr(mesh, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(range(16))
    for r in range(16):
        c = mesh.coords(r)
        assert mesh.rank_of(c.pp, c.dp, c.tp, c.cp) == r
    assert ParallelMesh(8, tensor_parallel=2).dims == ("pp", "dp", "tp")  # no cp dimension without CP
    with pytest.raises(MeshError, match=r"context_parallel=4 = 8 does not divide the world size 4"):
        ParallelMesh(4, tensor_parallel=2, context_parallel=4)


def _cp_groups_worker(rank, world):
    mesh = ParallelMesh(world, tensor_parallel=2, context_parallel=2).init_process_groups(rank)
    sums = {}
    for kind in ("tp", "cp", "dp", "dp_cp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=getattr(mesh, f"{kind}_group"))
        sums[kind] = t.item()
    return sums, mesh.device_mesh.mesh_dim_names


@pytest.mark.timeout(60)
def test_cp_and_dp_cp_groups_reduce_over_the_right_ranks():
    mesh = ParallelMesh(8, tensor_parallel=2, context_parallel=2)
    for rank, (sums, names) in enumerate(run_distributed(_cp_groups_worker, 8)):
        assert names == ("pp", "dp", "cp", "tp")
        assert sums == {kind: sum(mesh.group_ranks(kind, rank)) for kind in sums}


def test_group_ranks_of_a_rank_are_its_group_in_the_full_list():
    mesh = ParallelMesh(24, tensor_parallel=2, pipeline_parallel=3)
    for kind in ("tp", "dp", "pp"):
        for group in getattr(mesh, f"{kind}_groups")():
            for r in group:
                assert mesh.group_ranks(kind, r) == group


class _RecordDeviceMesh(L.Callback):
    """On every rank at fit start: the strategy's DeviceMesh, and a DTensor sharded over its DP dimension."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_fit_start(self, trainer, pl_module):
        device_mesh = trainer.strategy.device_mesh
        dtensor = distribute_tensor(torch.arange(4.0), device_mesh["dp"], [Shard(0)])
        torch.save({
            "names": device_mesh.mesh_dim_names,
            "layout": device_mesh.mesh.tolist(),
            "dp_is_ours": device_mesh.get_group("dp") is trainer.strategy.mesh.dp_group,
            "local": dtensor.to_local().tolist(),
            "full": dtensor.full_tensor().tolist(),
        }, f"{self.out_dir}/mesh{trainer.global_rank}.pt")


class _Linear(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(90)
def test_strategy_exposes_its_groups_as_a_device_mesh_for_dtensors(tmp_path):
    from lightning_parallel import ParallelStrategy

    strategy = ParallelStrategy(start_method="fork")
    with pytest.raises(RuntimeError, match="once the strategy has set up its processes"):
        strategy.device_mesh
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, limit_train_batches=0, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[_RecordDeviceMesh(str(tmp_path))],
    )
    trainer.fit(_Linear(), torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2))
    for rank in range(2):
        seen = torch.load(tmp_path / f"mesh{rank}.pt")
        assert seen["names"] == ("pp", "dp", "tp") and seen["layout"] == [[[0], [1]]] and seen["dp_is_ours"]
        assert seen["local"] == [[0.0, 1.0], [2.0, 3.0]][rank] and seen["full"] == [0.0, 1.0, 2.0, 3.0]


def test_where_groups_are_split_from_the_world_the_mesh_is_torchs_init_device_mesh(monkeypatch):
    # NCCL with a bound device cannot run here; the fake backend stands in for the world, and torch's
    # init_device_mesh (here without split_group) must build the same groups
    from lightning_parallel import mesh as mesh_module

    monkeypatch.setattr(mesh_module, "splits_world_communicator", lambda: True)
    dist.init_process_group("fake", store=compat.fake_store(), rank=13, world_size=16)
    try:
        mesh = ParallelMesh(16, tensor_parallel=2, pipeline_parallel=2).init_process_groups(13)
        for kind in ("tp", "dp", "pp"):
            assert dist.get_process_group_ranks(getattr(mesh, f"{kind}_group")) == mesh.group_ranks(kind, 13)
        assert mesh.device_mesh.mesh_dim_names == ("pp", "dp", "tp")
    finally:
        dist.destroy_process_group()
