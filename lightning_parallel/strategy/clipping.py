"""Gradient clipping by the norm of the *whole* model, when the model is split across ranks.

Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the local parameters. Under tensor
parallelism a sharded parameter's norm is spread over the TP group, and under pipeline parallelism
every stage holds different parameters, so the local norm is wrong. The global squared norm is the
sum over TP shards and pipeline stages of local squared norms, where a parameter replicated across TP
ranks (a LayerNorm weight) is counted on TP rank 0 only and a weight tied between two stages on one
of them only (Megatron-LM's ``param_is_not_tensor_parallel_duplicate`` rule, Shoeybi et al. 2019).
Data-parallel replicas (and context-parallel ranks) hold identical gradients after the all-reduce,
so no DP reduction is needed; under ZeRO each replica holds a disjoint part (ZeRO-1's slices of the
DP x CP group, ZeRO-2/3's DTensor shards: their local parts are used), so the squared norms are
summed over the group whose parts are disjoint: the DP x CP group, or under hybrid sharding the shard
group alone (its replicate peers hold the same rows, which would be counted again). Under expert
parallelism the ranks of an expert-parallel group hold different experts, so the experts' squared norms
are summed over that group instead (each replica of an expert holds its whole gradient, even under
ZeRO-1, which shards only the dense parameters' state).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from lightning_parallel.mesh import ParallelMesh, local_part


def global_grad_norm(
    params: Iterable[torch.nn.Parameter],
    mesh: ParallelMesh,
    counted_once: Callable[[torch.nn.Parameter], bool] = lambda p: True,
    sharded_over: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """The 2-norm of all gradients of the model, identical on every rank of the mesh.

    Args:
        params: this rank's parameters (those without a gradient are ignored).
        mesh: the process mesh.
        counted_once: ``False`` for a local parameter whose gradient another stage also holds and counts.
        sharded_over: the data-parallel ranks whose parameters are disjoint parts (ZeRO-1: the DP x CP group;
            ZeRO-2/3: ``mesh.zero_shard_group``); None: every replica holds them whole.
    """
    params = list(params)
    # [the parameters every DP rank holds (or its ZeRO part of them), the experts this rank holds]
    sums = torch.zeros(2, device=params[0].device if params else "cpu")
    for p in params:
        if p.grad is None or not counted_once(p):
            continue
        shard = getattr(p, "tp_shard", None)
        if shard is None and mesh.tp_size > 1 and mesh.tp_rank != 0:
            continue  # replicated over TP: TP rank 0 counts it
        if shard is not None and mesh.tp_rank % shard.replicas:
            continue  # a copy of a KV head another TP rank also holds: the first of them counts it
        sums[int(hasattr(p, "expert_shard"))] += local_part(p.grad).detach().float().pow(2).sum()
    if mesh.tp_size > 1:
        dist.all_reduce(sums, group=mesh.tp_group)
    if mesh.pp_size > 1:
        dist.all_reduce(sums, group=mesh.pp_group)
    total, experts = sums[0], sums[1]
    if sharded_over is not None and dist.get_world_size(sharded_over) > 1:
        dist.all_reduce(total, group=sharded_over)
    if mesh.ep_size > 1:  # each expert on every replica of its EP rank: summed over the EP group only
        dist.all_reduce(experts, group=mesh.ep_group)
    return (total + experts).sqrt()


def clip_grads_by_global_norm(
    params: list[torch.nn.Parameter],
    max_norm: float,
    mesh: ParallelMesh,
    counted_once: Callable[[torch.nn.Parameter], bool] = lambda p: True,
    sharded_over: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Scale gradients so that their global norm is at most ``max_norm``; returns the norm before.

    Uses the same coefficient as ``torch.nn.utils.clip_grad_norm_``: ``max_norm / (norm + 1e-6)``,
    clamped to 1, so a run on one device and a split run clip identically.
    """
    norm = global_grad_norm(params, mesh, counted_once, sharded_over)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local_part(p.grad).detach().mul_(coef.to(p.grad.dtype))
    return norm
