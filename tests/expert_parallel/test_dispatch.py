"""Dispatch and combine in processes: a Hugging Face experts module placed over 2 or 4 gloo ranks computes,
for each rank's tokens, what the whole module computes on one process for all of them, and its gradients
(of the tokens, the routing weights and each rank's experts) are those of one process.

Tolerance: float32; the combine sums a token's ``k`` expert outputs in another order than the original
module (1e-7 relative per sum), so 1e-5. A token sent to the wrong rank, an expert computed with another's
weights or a weight applied twice is off by O(1).
"""

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.expert_parallel import parallelize_experts
from tests.helpers.processes import make_mesh, run_distributed

HIDDEN, TOKENS, K = 16, 12, 2
TOL = dict(atol=1e-5, rtol=1e-5)


def experts_module(num_experts: int = 4):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=8, num_local_experts=num_experts)
    experts = MixtralExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts


class Holder(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts


def routing(world: int, num_experts: int, only_expert0: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * TOKENS, HIDDEN, generator=g)
    scores = torch.randn(world * TOKENS, num_experts, generator=g)
    if only_expert0:  # expert 0 first for every token, expert 1 second: experts 2.. receive nothing
        index = torch.tensor([0, 1]).expand(world * TOKENS, K).contiguous()
    else:
        index = scores.topk(K, dim=-1).indices
    weights = torch.softmax(torch.randn(world * TOKENS, K, generator=g), dim=-1)
    upstream = torch.randn(world * TOKENS, HIDDEN, generator=g)
    return x, index, weights, upstream


def reference(world, num_experts, only_expert0):
    experts = experts_module(num_experts)
    x, index, weights, upstream = routing(world, num_experts, only_expert0)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    out = experts(x, index, weights)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, weights.grad, {n: p.grad for n, p in experts.named_parameters()}


def _placed(rank, world, num_experts, only_expert0):
    mesh = make_mesh(rank, world)
    holder = Holder(experts_module(num_experts))
    placed = parallelize_experts(holder, mesh.dp_group, world, rank)
    x, index, weights, upstream = routing(world, num_experts, only_expert0)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    x, index, weights, upstream = x[mine].clone(), index[mine], weights[mine].clone(), upstream[mine]
    x.requires_grad_(True)
    weights.requires_grad_(True)
    out = holder.experts(x, index, weights)
    (out * upstream).sum().backward()
    shard = holder.experts.gate_up_proj.expert_shard
    grads = {n: p.grad for n, p in holder.experts.named_parameters()}
    return out.detach(), x.grad, weights.grad, grads, (shard.first, shard.count), placed.tokens_per_expert()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,num_experts,only_expert0", [(2, 4, False), (4, 8, False), (2, 4, True)])
def test_dispatch_and_combine_match_one_process(world, num_experts, only_expert0):
    out, x_grad, w_grad, grads = reference(world, num_experts, only_expert0)
    results = run_distributed(_placed, world, num_experts, only_expert0)
    for rank, (o, xg, wg, g, (first, count), tokens) in enumerate(results):
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        torch.testing.assert_close(o, out[mine], **TOL)
        torch.testing.assert_close(xg, x_grad[mine], **TOL)
        torch.testing.assert_close(wg, w_grad[mine], **TOL)
        assert (first, count) == (rank * num_experts // world, num_experts // world)
        for name, grad in g.items():
            assert grad is not None, f"{name} has no gradient on rank {rank}"
            torch.testing.assert_close(grad, grads[name][first : first + count], **TOL)
        assert int(tokens["experts"].sum()) == TOKENS * K
    if only_expert0:  # rank 1 received nothing: its experts' gradients are zero, not missing
        assert all(float(g.abs().max()) == 0.0 for g in results[1][3].values())


def _dropped(rank, world):
    """Assignments with the id one past the last expert are skipped, as the Hugging Face loop skips them."""
    mesh = make_mesh(rank, world)
    holder = Holder(experts_module(4))
    whole = experts_module(4)
    parallelize_experts(holder, mesh.dp_group, world, rank)
    x, index, weights, _ = routing(world, 4, False)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    x, index, weights = x[mine], index[mine].clone(), weights[mine]
    index[::3, 1] = 4  # every third token's second expert dropped
    return holder.experts(x, index, weights), whole(x, index, weights)


@pytest.mark.timeout(60)
def test_dropped_assignments_are_skipped_as_on_one_process():
    for placed, whole in run_distributed(_dropped, 2):
        torch.testing.assert_close(placed, whole, **TOL)


def _groups(rank, world):
    from lightning_parallel.mesh import ParallelMesh

    mesh = ParallelMesh(world, tensor_parallel=2, expert_parallel=2).init_process_groups(rank)  # dp=4
    return (dist.get_process_group_ranks(mesh.ep_group), dist.get_process_group_ranks(mesh.edp_group),
            mesh.ep_rank)


@pytest.mark.timeout(60)
def test_ep_and_expert_replica_groups_are_created_on_every_rank():
    mesh_groups = run_distributed(_groups, 8)
    assert [g[0] for g in mesh_groups] == [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]
    assert [g[1] for g in mesh_groups] == [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]]
    assert [g[2] for g in mesh_groups] == [0, 0, 1, 1, 0, 0, 1, 1]
