"""Gradient step that sequence parallelism adds after backward.

Under sequence parallelism a replicated parameter (a LayerNorm gain, a row-parallel bias) sees
only this rank's tokens, so each TP rank holds a partial gradient; the full one is their sum
(Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2; Megatron-LM's
``_allreduce_non_tensor_model_parallel_grads``). Such parameters carry ``sequence_parallel = True``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.mesh import local_part


def sync_sequence_parallel_grads(module: nn.Module, mesh) -> None:
    """Sum over the TP group the gradients of parameters marked ``sequence_parallel`` (one all-reduce)."""
    # a ZeRO-2/3 shard (DTensor) is summed shard by shard: every TP rank shards the parameter alike
    grads = [local_part(p.grad) for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or mesh.tp_size == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=mesh.tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
