"""Which boxes of a global tensor a rank's local shard holds (pure logic).

PyTorch Distributed Checkpoint (DCP) stores every tensor under one name and its global shape, as a
list of *chunks*: boxes given by an offset and a size per dimension. A TP shard is one chunk for a
row or column split, several for a fused QKV weight (the rank's slice of each of the q, k, v blocks,
Megatron's ``stride``), and for a vocabulary padded to a multiple of the TP size only the rows that
exist in the unsplit model (the padding is not stored, so the checkpoint does not depend on the TP
size). A tensor that is not split is one chunk covering it. Any layout can then read any other:
DCP intersects the chunks a rank needs with the chunks that were saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lightning_parallel.tensor_parallel.shard import TPShard, padded_size


@dataclass(frozen=True)
class Chunk:
    """A box of the global tensor and where it sits in the local shard.

    offsets, sizes: the box in the global tensor.
    dim, local: the split dimension and the box's offset along it in the local shard (the box
        spans the local shard along every other dimension).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dim: int = 0
    local: int = 0


def tp_chunks(shape: tuple[int, ...], shard: Optional[TPShard], tp_rank: int, tp_size: int) -> list[Chunk]:
    """The chunks of the global tensor of ``shape`` that TP rank ``tp_rank`` holds (``tensor_parallel.shard``'s cut)."""
    if shard is None:
        return [Chunk((0,) * len(shape), tuple(shape))]
    dim = shard.dim % len(shape)
    length = shape[dim]
    block = (padded_size(length, tp_size) if shard.full_size is not None else length) // shard.fused
    per_rank = block // tp_size
    chunks = []
    for b in range(shard.fused):
        start = b * block + tp_rank * per_rank
        stop = min(start + per_rank, length)  # rows past ``length`` are padding: not stored
        if stop > start:
            offsets, sizes = [0] * len(shape), list(shape)
            offsets[dim], sizes[dim] = start, stop - start
            chunks.append(Chunk(tuple(offsets), tuple(sizes), dim, b * per_rank))
    return chunks


def chunk_view(local: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The part of the local shard ``local`` that holds ``chunk`` (a view)."""
    if local.dim() == 0:
        return local
    return local.narrow(chunk.dim, chunk.local, chunk.sizes[chunk.dim])
