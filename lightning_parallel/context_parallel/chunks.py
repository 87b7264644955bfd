"""Which tokens of a sequence each context-parallel rank holds, and which attention blocks it computes.

Pure arithmetic and tensor indexing, no processes. Under causal attention a query at position ``p``
attends to ``p + 1`` keys, so cutting the sequence into ``N`` contiguous parts would give the last
rank ``2N - 1`` times the work of the first. Instead the sequence is cut into ``2N`` equal chunks
and rank ``i`` holds chunks ``i`` and ``2N - 1 - i``, one from each end: every rank then has the
same number of (query, key) pairs to compute (the "zigzag" or head-tail layout of ring attention
implementations; Megatron-LM's context parallelism splits the sequence the same way; Brandon et al.
2023, "Striped Attention", arXiv 2311.09431, measure the imbalance of contiguous parts).

Keys and values travel around the ring of CP ranks (Liu et al. 2023, "Ring Attention with Blockwise
Transformers", arXiv 2310.01889): at ring step ``j`` rank ``r`` holds the keys of rank
``(r - j) mod N``. With the zigzag layout each step is one rectangular block of the causal mask:

* step 0 (its own keys): causal attention of its two chunks on its two chunks, which is exactly the
  ordinary causal mask on the rank's local sequence (chunk ``i`` comes before chunk ``2N-1-i``);
* keys from a lower rank ``s < r``: both query chunks see key chunk ``s`` entirely and never chunk
  ``2N-1-s`` (it lies after both), so all local queries attend to the first half of the keys;
* keys from a higher rank ``s > r``: query chunk ``r`` sees neither key chunk, query chunk
  ``2N-1-r`` sees both entirely, so the second half of the queries attends to all the keys.

So every step after the first computes half of a square block, on every rank: the load is balanced
step by step, not only in total.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_parallel.errors import ConfigurationError


class SequenceLengthError(ConfigurationError):
    """A sequence whose length does not divide into the ``2 * context_parallel`` chunks."""


def check_length(length: int, cp: int) -> None:
    """Refuse a sequence length that does not divide by ``2 * cp``, naming the nearest ones that do."""
    parts = 2 * cp
    if length % parts == 0 and length > 0:
        return
    below, above = length - length % parts, length - length % parts + parts
    fits = " or ".join(str(n) for n in (below, above) if n > 0)
    raise SequenceLengthError(
        f"context_parallel={cp} cuts each sequence into 2 x {cp} = {parts} equal chunks (rank i holds chunks i "
        f"and {parts - 1}-i, which balances causal attention), but the sequence length is {length}. Use sequences "
        f"of a multiple of {parts} tokens ({fits}), or another context_parallel size that divides {length} "
        f"into an even number of chunks: {', '.join(map(str, sizes_for(length))) or 'none'}"
    )


def sizes_for(length: int, largest: int = 64) -> list[int]:
    """The context-parallel sizes above 1 (up to ``largest``) that split ``length`` tokens."""
    return [cp for cp in range(2, largest + 1) if length % (2 * cp) == 0]


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) rank ``rank`` holds, in sequence order."""
    return rank, 2 * cp - 1 - rank


def local_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions in the whole sequence of the tokens rank ``rank`` holds, in its local order."""
    check_length(length, cp)
    size = length // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks_of(rank, cp)])


def shard(tensor: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s two chunks of ``tensor`` along ``dim``, concatenated in sequence order."""
    check_length(tensor.shape[dim], cp)
    chunks = tensor.chunk(2 * cp, dim)
    first, second = chunks_of(rank, cp)
    return torch.cat((chunks[first], chunks[second]), dim)


def unshard(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's ``shard`` (in rank order): the inverse of ``shard``."""
    cp = len(shards)
    halves = [half for s in shards for half in s.chunk(2, dim)]  # chunk i of rank r is halves[2r + i]
    where = {c: 2 * r + i for r in range(cp) for i, c in enumerate(chunks_of(r, cp))}
    return torch.cat([halves[where[c]] for c in range(2 * cp)], dim)


# ---- the ring's blocks ------------------------------------------------------------------------
@dataclass(frozen=True)
class RingBlock:
    """What a rank computes at one ring step, in halves of its local sequence (chunk ``i``, chunk ``2N-1-i``).

    ``queries``: ``"all"`` or ``"second"`` (chunk ``2N-1-i`` only); ``keys``: ``"all"`` or ``"first"``
    (the source rank's lower chunk only); ``causal``: the causal mask on the local order (step 0).
    """

    source: int
    queries: str
    keys: str
    causal: bool


def ring_source(rank: int, step: int, cp: int) -> int:
    """The rank whose keys and values rank ``rank`` holds at ring step ``step`` (they move to rank + 1)."""
    return (rank - step) % cp


def ring_block(rank: int, step: int, cp: int) -> RingBlock:
    """The block rank ``rank`` computes at ring step ``step`` under causal attention (module docstring)."""
    source = ring_source(rank, step, cp)
    if source == rank:
        return RingBlock(source, "all", "all", causal=True)
    if source < rank:
        return RingBlock(source, "all", "first", causal=False)
    return RingBlock(source, "second", "all", causal=False)


def block_mask(rank: int, step: int, cp: int, length: int, causal: bool = True) -> torch.Tensor:
    """The (query, key) pairs of the whole ``length x length`` attention that rank ``rank`` computes at
    ring step ``step``, as a boolean matrix over whole-sequence positions (for tests and planning).
    Without ``causal`` every step is the full block."""
    q_pos = local_positions(length, cp, rank)
    k_pos = local_positions(length, cp, ring_source(rank, step, cp))
    half = length // (2 * cp)
    mask = torch.zeros(length, length, dtype=torch.bool)
    if not causal:
        mask[q_pos[:, None], k_pos[None, :]] = True
        return mask
    block = ring_block(rank, step, cp)
    qs = q_pos if block.queries == "all" else q_pos[half:]
    ks = k_pos if block.keys == "all" else k_pos[:half]
    allowed = torch.ones(len(qs), len(ks), dtype=torch.bool)
    if block.causal:
        allowed = allowed.tril()
    mask[qs[:, None], ks[None, :]] = allowed
    return mask
