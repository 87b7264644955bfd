"""How a full tensor maps onto TP shards, and back.

A sharded parameter carries ``param.tp_shard = TPShard(...)``: the dimension it is split along,
how many fused blocks that dimension holds (a QKV projection stores ``[q; k; v]``, so each rank
keeps its slice of every block, Megatron's ``stride``), and, for a vocabulary padded to a multiple
of the TP size, the unpadded length, and how many consecutive TP ranks hold the same slice (the key
and value projections of an attention with fewer KV heads than TP ranks: each rank keeps a copy
of the one KV head its query heads attend to, as vLLM's ``num_kv_head_replicas``). That is enough
to rebuild the full tensor on any TP size.
The slicing is pure; ``gather_full_tensor``/``shard_tensor`` add the process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class TPShard:
    """Layout of one TP-sharded tensor.

    dim: the dimension split across TP ranks.
    fused: number of equal blocks along ``dim`` that are split separately (3 for fused QKV).
    full_size: length of ``dim`` before padding to a multiple of the TP size (None: no padding).
    replicas: consecutive TP ranks that hold the same slice; the tensor is cut into
        ``tp_size / replicas`` parts and rank r holds part ``r // replicas``.
    """

    dim: int
    fused: int = 1
    full_size: Optional[int] = None
    replicas: int = 1

    def parts(self, tp_size: int) -> int:
        """How many distinct slices the TP group holds."""
        return tp_size // self.replicas

    def part(self, rank: int) -> int:
        """Which slice TP rank ``rank`` holds."""
        return rank // self.replicas


def padded_size(size: int, tp_size: int) -> int:
    """``size`` rounded up to a multiple of ``tp_size``."""
    return -(-size // tp_size) * tp_size


def slice_shard(full: torch.Tensor, shard: TPShard, rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a copy, so the full tensor can be freed)."""
    dim = shard.dim % full.dim()
    rank, tp_size = shard.part(rank), shard.parts(tp_size)
    if shard.full_size is not None:
        pad = padded_size(full.shape[dim], tp_size) - full.shape[dim]
        widths = [0, 0] * (full.dim() - dim - 1) + [0, pad]
        full = F.pad(full, widths)
    blocks = full.chunk(shard.fused, dim=dim)
    return torch.cat([b.chunk(tp_size, dim=dim)[rank] for b in blocks], dim=dim).clone()


def merge_shards(shards: list[torch.Tensor], shard: TPShard) -> torch.Tensor:
    """Inverse of ``slice_shard``: the full tensor from every rank's shard (rank order); of the
    ranks that hold copies of one slice, the first is read."""
    shards = shards[:: shard.replicas]
    dim = shard.dim % shards[0].dim()
    per_rank = [s.chunk(shard.fused, dim=dim) for s in shards]
    full = torch.cat([torch.cat([p[b] for p in per_rank], dim=dim) for b in range(shard.fused)], dim=dim)
    if shard.full_size is not None:
        full = full.narrow(dim, 0, shard.full_size)
    return full


def shard_tensor(full: torch.Tensor, shard: TPShard, mesh) -> torch.Tensor:
    """This rank's shard of ``full`` under ``mesh``'s TP layout."""
    return slice_shard(full, shard, mesh.tp_rank, mesh.tp_size)


def gather_full_tensor(tensor: torch.Tensor, shard: TPShard, mesh) -> torch.Tensor:
    """The full tensor, rebuilt on every TP rank from each rank's shard (collective over TP)."""
    local = tensor.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(mesh.tp_size)]
    dist.all_gather(shards, local, group=mesh.tp_group)
    return merge_shards(shards, shard)
