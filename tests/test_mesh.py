"""Mesh rank arithmetic (no processes) and its errors."""

import pytest
import torch
import torch.distributed as dist

from distributed import make_mesh, run_distributed
from lightning_parallel.mesh import MeshError, ParallelMesh


def test_tp_varies_fastest_then_dp_then_pp():
    mesh = ParallelMesh(8, tensor_parallel=2, pipeline_parallel=2)
    assert mesh.dp_size == 2
    assert [tuple(vars(mesh.coords(r)).values()) for r in range(8)] == [
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
    mesh = make_mesh(rank, world, tp=2, pp=2)
    out = {}
    for kind in ("tp", "dp", "pp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=getattr(mesh, f"{kind}_group"))
        out[kind] = t.item()
    return out, mesh.pp_next_rank, mesh.pp_prev_rank


@pytest.mark.timeout(60)
def test_process_groups_reduce_over_the_right_ranks():
    results = run_distributed(_groups_worker, 8)
    mesh = ParallelMesh(8, tensor_parallel=2, pipeline_parallel=2)
    for rank, (sums, nxt, prv) in enumerate(results):
        for kind, value in sums.items():
            assert value == sum(mesh.group_ranks(kind, rank))
        c = mesh.coords(rank)
        assert nxt == (mesh.rank_of(1, c.dp, c.tp) if c.pp == 0 else None)
        assert prv == (mesh.rank_of(0, c.dp, c.tp) if c.pp == 1 else None)
