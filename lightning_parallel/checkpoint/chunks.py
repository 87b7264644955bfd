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

from lightning_parallel.checkpoint.format import ExpertRows, local_shape
from lightning_parallel.tensor_parallel.shard import TPShard, padded_size


@dataclass(frozen=True)
class Chunk:
    """A box of the global tensor and where it sits in the local shard.

    offsets, sizes: the box in the global tensor.
    dim, local: the split dimension and the box's offset along it in the local shard (the box
        spans the local shard along every other dimension).
    strided: for a flat slice of the local shard (ZeRO-1), where the box's first element is in the
        slice and the local shard's strides, which step through the box's other elements.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dim: int = 0
    local: int = 0
    strided: Optional[tuple[int, tuple[int, ...]]] = None  # (start, strides) in a flat slice instead


def tp_chunks(shape: tuple[int, ...], shard: Optional[TPShard], tp_rank: int, tp_size: int) -> list[Chunk]:
    """The chunks of the global tensor of ``shape`` that TP rank ``tp_rank`` holds (``tensor_parallel.shard``'s cut);
    for an expert parameter (``ExpertRows``), that cut of this rank's experts, moved to their rows."""
    if isinstance(shard, ExpertRows):
        own = tp_chunks((shard.count, *shape[1:]), shard.tp, tp_rank, tp_size)
        return [Chunk((c.offsets[0] + shard.first, *c.offsets[1:]), c.sizes, c.dim, c.local) for c in own]
    if shard is None:
        return [Chunk((0,) * len(shape), tuple(shape))]
    dim = shard.dim % len(shape)
    tp_rank, tp_size = shard.part(tp_rank), shard.parts(tp_size)  # copies of one slice hold the same chunks
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


def slice_chunks(shape: tuple[int, ...], shard: Optional[TPShard], tp_rank: int, tp_size: int,
                 begin: int, length: int) -> list[Chunk]:
    """The chunks of the global tensor of ``shape`` held by elements ``[begin, begin + length)`` of
    the flattened local shard of TP rank ``tp_rank`` (a ZeRO-1 slice), each ``strided`` in the slice."""
    shard_shape = local_shape(shape, shard, tp_size)
    strides = [1] * len(shard_shape)
    for d in range(len(shard_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shard_shape[d + 1]
    chunks = []
    for tp in tp_chunks(shape, shard, tp_rank, tp_size):
        # the TP chunk as a box of the local shard: it spans every dimension but ``dim``
        low = [0] * len(shape)
        if shape:
            low[tp.dim] = tp.local
        for start, size in _range_boxes(shard_shape, begin, begin + length):
            lo = [max(a, b) for a, b in zip(start, low)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(start, size, low, tp.sizes)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            offsets = tuple(o + l - b for o, l, b in zip(tp.offsets, lo, low))
            first = sum(l * s for l, s in zip(lo, strides)) - begin
            chunks.append(Chunk(offsets, tuple(h - l for l, h in zip(lo, hi)), strided=(first, tuple(strides))))
    return chunks


def _range_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[list[int], list[int]]]:
    """Elements ``[a, b)`` of a row-major tensor of ``shape`` as boxes (start, size)."""
    if a >= b:
        return []
    if not shape:
        return [([], [])]
    row = 1
    for n in shape[1:]:
        row *= n
    first, last = -(-a // row), b // row  # the whole rows are [first, last)
    if first > last:  # inside one row
        return [([a // row, *s], [1, *n]) for s, n in _range_boxes(shape[1:], a % row, b % row)]
    head = [([first - 1, *s], [1, *n]) for s, n in _range_boxes(shape[1:], a % row, row)] if a % row else []
    whole = [([first, *[0] * (len(shape) - 1)], [last - first, *shape[1:]])] if last > first else []
    tail = [([last, *s], [1, *n]) for s, n in _range_boxes(shape[1:], 0, b % row)]
    return head + whole + tail


def chunk_view(local: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The part of the local shard ``local`` that holds ``chunk`` (a view)."""
    if chunk.strided is not None:
        start, strides = chunk.strided
        return local.as_strided(chunk.sizes, strides, local.storage_offset() + start)
    if local.dim() == 0:
        return local
    return local.narrow(chunk.dim, chunk.local, chunk.sizes[chunk.dim])
