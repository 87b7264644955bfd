"""Ring attention over the context-parallel group (Liu et al. 2023, arXiv 2310.01889).

Each rank holds the queries, keys and values of its two chunks of the sequence (``chunks.py``).
Keys and values go around the ring in ``N - 1`` shifts; at each step a rank attends its queries to
the block it holds (``chunks.ring_block``: which half of the queries, which half of the keys, causal
or not) while the next block travels, and merges the block's output into its running result by the
log-sum-exp of the scores (``kernels.py``). Only this rank's ``q, k, v``, output and log-sum-exp are
kept for backward, so the memory of attention falls as ``1/N``.

Backward makes the same round: keys and values travel again, each with the gradient accumulated for
them so far (float32), which every rank the block visits adds its share to; after the ``N``-th shift
each gradient is back at the rank that owns those keys (Liu et al. 2023, §3; the same schedule as
torch's experimental ``context_parallel`` and Megatron-LM's ``AttnFuncWithCPAndKVP2P``).

A padded or packed batch comes as ``masks.TokenIds``, two integers per token of the whole sequence,
which every rank holds (the mask was built before the split): each block's mask is rebuilt from
the ids of its query rows and of the source rank's key chunks, so nothing more travels with the
keys. The zigzag schedule stays as it is (padding and documents only remove pairs); a query row
may then have no key in a block, or in any, and its log-sum-exp ``-inf`` weighs nothing in the merge.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_parallel.context_parallel.chunks import (
    RingBlock,
    ring_block,
    ring_source,
    shard,
)
from lightning_parallel.context_parallel.comm import Ring
from lightning_parallel.context_parallel.kernels import (
    block_attention,
    block_attention_backward,
)
from lightning_parallel.context_parallel.masks import TokenIds, block_mask

_KV, _GRAD = 0, 1  # message tags: keys and values, their gradients


def _block(rank: int, step: int, size: int, causal: bool) -> RingBlock:
    if causal:
        return ring_block(rank, step, size)
    return RingBlock(ring_source(rank, step, size), "all", "all", causal=False)


def _rows(block: RingBlock, length: int) -> slice:
    return slice(length // 2 if block.queries == "second" else 0, length)


def _cols(block: RingBlock, length: int) -> slice:
    return slice(0, length // 2 if block.keys == "first" else length)


def _mask(ids: Optional[TokenIds], block: RingBlock, ring: Ring, rows: slice, cols: slice) -> Optional[Tensor]:
    """The block's mask from the ids of its query rows (this rank's) and key columns (the source rank's)."""
    if ids is None:
        return None
    queries = shard(ids.query, 1, ring.size, ring.rank)[:, rows]
    keys = shard(ids.key, 1, ring.size, block.source)[:, cols]
    return block_mask(queries, keys, block.causal)


def _weight(lse: Tensor, merged: Tensor) -> Tensor:
    """A part's share ``exp(lse - merged)`` of its rows; 0 where no part has a key (both ``-inf``)."""
    return (lse - merged).exp().masked_fill(merged == float("-inf"), 0.0).unsqueeze(-1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float], ring: Ring,
                fused: Optional[bool], ids: Optional[TokenIds]) -> Tensor:
        length = q.shape[-2]
        kv = torch.stack((k, v))
        out = lse = None
        for step in range(ring.size):
            arriving = ring.shift(kv, _KV) if step + 1 < ring.size else None
            block = _block(ring.rank, step, ring.size, causal)
            rows, cols = _rows(block, length), _cols(block, length)
            mask = _mask(ids, block, ring, rows, cols)
            o, o_lse = block_attention(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                       block.causal and mask is None, scale, fused, mask)
            if out is None:  # step 0 covers every row
                out, lse = o.float(), o_lse
            else:  # softmax over both: each part weighted by its share of the rows' exp-sum
                merged = torch.logaddexp(lse[..., rows], o_lse)
                out[..., rows, :] = (out[..., rows, :] * _weight(lse[..., rows], merged)
                                     + o.float() * _weight(o_lse, merged))
                lse[..., rows] = merged
            if arriving is not None:
                kv = arriving()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.ring, ctx.fused, ctx.ids = causal, scale, ring, fused, ids
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, length = ctx.ring, q.shape[-2]
        kv = torch.stack((k, v))
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # the gradient of the keys held now
        for step in range(ring.size):
            arriving = ring.shift(kv, _KV) if step + 1 < ring.size else None
            block = _block(ring.rank, step, ring.size, ctx.causal)
            rows, cols = _rows(block, length), _cols(block, length)
            mask = _mask(ctx.ids, block, ring, rows, cols)
            dq_b, dk_b, dv_b = block_attention_backward(
                grad_out[..., rows, :], q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                out[..., rows, :], lse[..., rows], block.causal and mask is None, ctx.scale, ctx.fused, mask)
            dq[..., rows, :] += dq_b
            dkv[0][..., cols, :] += dk_b
            dkv[1][..., cols, :] += dv_b
            dkv = ring.shift(dkv, _GRAD)()  # on to the next rank, which holds these keys at the next step
            if arriving is not None:
                kv = arriving()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float], ring: Ring,
                   fused: Optional[bool] = None, ids: Optional[TokenIds] = None) -> Tensor:
    """Attention of this rank's queries on the keys of the whole sequence, ``(batch, heads, local, dim)``
    in and out; ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention). ``causal``:
    the sequence's causal mask, under the zigzag layout of ``chunks.py``; otherwise every query attends
    to every key. ``ids``: padding and documents of the whole sequence (``masks.py``), whose ``causal``
    must be ``causal``. ``fused``: the CPU kernel or the float32 formulas (default: by device, ``kernels.py``)."""
    if ids is not None and ids.causal != causal:
        raise ValueError(f"ring_attention: causal={causal} with token ids of a causal={ids.causal} mask")
    return _RingAttention.apply(q, k, v, causal, scale, ring, fused, ids)
