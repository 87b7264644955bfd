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
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_parallel.context_parallel.chunks import (
    RingBlock,
    ring_block,
    ring_source,
)
from lightning_parallel.context_parallel.comm import Ring
from lightning_parallel.context_parallel.kernels import (
    block_attention,
    block_attention_backward,
)

_KV, _GRAD = 0, 1  # message tags: keys and values, their gradients


def _block(rank: int, step: int, size: int, causal: bool) -> RingBlock:
    if causal:
        return ring_block(rank, step, size)
    return RingBlock(ring_source(rank, step, size), "all", "all", causal=False)


def _rows(block: RingBlock, length: int) -> slice:
    return slice(length // 2 if block.queries == "second" else 0, length)


def _cols(block: RingBlock, length: int) -> slice:
    return slice(0, length // 2 if block.keys == "first" else length)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float], ring: Ring,
                fused: Optional[bool]) -> Tensor:
        length = q.shape[-2]
        kv = torch.stack((k, v))
        out = lse = None
        for step in range(ring.size):
            arriving = ring.shift(kv, _KV) if step + 1 < ring.size else None
            block = _block(ring.rank, step, ring.size, causal)
            rows, cols = _rows(block, length), _cols(block, length)
            o, o_lse = block_attention(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], block.causal,
                                       scale, fused)
            if out is None:  # step 0 covers every row
                out, lse = o.float(), o_lse
            else:  # softmax over both: each part weighted by its share of the rows' exp-sum
                merged = torch.logaddexp(lse[..., rows], o_lse)
                out[..., rows, :] = (out[..., rows, :] * (lse[..., rows] - merged).exp().unsqueeze(-1)
                                     + o.float() * (o_lse - merged).exp().unsqueeze(-1))
                lse[..., rows] = merged
            if arriving is not None:
                kv = arriving()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.ring, ctx.fused = causal, scale, ring, fused
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
            dq_b, dk_b, dv_b = block_attention_backward(
                grad_out[..., rows, :], q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                out[..., rows, :], lse[..., rows], block.causal, ctx.scale, ctx.fused)
            dq[..., rows, :] += dq_b
            dkv[0][..., cols, :] += dk_b
            dkv[1][..., cols, :] += dv_b
            dkv = ring.shift(dkv, _GRAD)()  # on to the next rank, which holds these keys at the next step
            if arriving is not None:
                kv = arriving()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float], ring: Ring,
                   fused: Optional[bool] = None) -> Tensor:
    """Attention of this rank's queries on the keys of the whole sequence, ``(batch, heads, local, dim)``
    in and out; ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention). ``causal``:
    the sequence's causal mask, under the zigzag layout of ``chunks.py``; otherwise every query attends
    to every key. ``fused``: the CPU kernel or the float32 formulas (default: by device, ``kernels.py``)."""
    return _RingAttention.apply(q, k, v, causal, scale, ring, fused)
