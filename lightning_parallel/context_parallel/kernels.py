"""Attention of one block of queries on one block of keys, with the log-sum-exp ring attention merges by.

``scaled_dot_product_attention`` returns only its output; combining the partial results of several
key blocks needs each query's log-sum-exp of scores too (``out = sum_j exp(lse_j - lse) out_j``,
the online softmax of Milakov & Gimelshein 2018 that FlashAttention and ring attention build on).
Its backward, given the *combined* output and log-sum-exp, yields each block's exact share of the
gradients (Dao et al. 2022, FlashAttention, arXiv 2205.14135, Algorithm 4).

On CPU both come from torch's fused kernel, the one ``scaled_dot_product_attention`` itself runs
there (``compat.cpu_flash_attention``), so a block computes exactly what one device would. On other
devices the same formulas are written out in float32 matrix products: correct everywhere, but they
hold a block's ``queries x keys`` scores in memory (a fused CUDA kernel is left to do). Grouped
key/value heads (fewer than the query heads, ``enable_gqa``) are accepted by both.

A block may carry a boolean ``mask`` of the (query, key) pairs it holds (padding, documents:
``masks.py``). A query row with no key in the block gets output 0 and log-sum-exp ``-inf``, so it
weighs nothing when the ring merges blocks; a row with no key in any block keeps output 0 and no
gradient, which is what ``scaled_dot_product_attention`` gives such a row on one device.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from lightning_parallel.compat import cpu_flash_attention


def block_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float],
                    fused: Optional[bool] = None, mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of queries ``q`` on keys ``k`` (``(batch, heads, length, dim)``); ``causal``
    masks the upper triangle (queries and keys then cover the same positions); ``mask``, boolean
    ``(batch, queries, keys)``, True attends, masks the pairs it excludes besides. ``lse`` is float32
    ``(batch, heads, queries)``. ``fused``: use the CPU kernel (default: on CPU tensors)."""
    if _fused(q, fused):
        forward, _ = cpu_flash_attention()
        out, lse = forward(q, k, v, 0.0, causal, attn_mask=_additive(mask, q), scale=scale)
    else:
        scores = _scores(q, k, causal, scale, mask)
        lse = scores.logsumexp(-1)
        out = ((scores - lse.unsqueeze(-1)).exp() @ _grouped(v, q).float()).to(q.dtype)
    if mask is None:
        return out, lse
    empty = ~mask.any(-1).unsqueeze(1)  # rows with no key here: the kernel gives lse 0, the formulas NaN
    return out.masked_fill(empty.unsqueeze(-1), 0), lse.masked_fill(empty, float("-inf"))


def block_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             causal: bool, scale: Optional[float], fused: Optional[bool] = None,
                             mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``(q, k, v)`` of one block, where ``out`` and ``lse`` are the rows' values over
    *all* their key blocks: the block's share of the whole attention's gradients. ``mask`` as in
    ``block_attention``; a row whose ``lse`` is ``-inf`` (no key anywhere) gets no gradient."""
    if mask is not None:  # every score of such a row is -inf: any finite lse makes its weights 0
        lse = lse.masked_fill(lse == float("-inf"), 0.0)
    if _fused(q, fused):
        _, backward = cpu_flash_attention()
        dq, dk, dv = backward(grad_out.contiguous(), q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q),
                              scale=scale)
        return dq, dk, dv
    probs = (_scores(q, k, causal, scale, mask) - lse.unsqueeze(-1)).exp()  # (b, h, q, k)
    g, o = grad_out.float(), out.float()
    dv = probs.transpose(-2, -1) @ g
    dp = g @ _grouped(v, q).float().transpose(-2, -1)
    ds = probs * (dp - (g * o).sum(-1, keepdim=True)) * _scale(q, scale)
    dq = ds @ _grouped(k, q).float()
    dk = ds.transpose(-2, -1) @ q.float()
    return dq.to(q.dtype), _ungrouped(dk, k).to(k.dtype), _ungrouped(dv, v).to(v.dtype)


def _fused(q: Tensor, fused: Optional[bool]) -> bool:
    return q.device.type == "cpu" if fused is None else fused


def _scale(q: Tensor, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _scores(q: Tensor, k: Tensor, causal: bool, scale: Optional[float], mask: Optional[Tensor] = None) -> Tensor:
    scores = (q.float() @ _grouped(k, q).float().transpose(-2, -1)) * _scale(q, scale)
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return scores


def _additive(mask: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
    """A boolean ``(batch, queries, keys)`` mask as the fused kernel takes it: additive, in the queries' dtype,
    one head broadcast over all."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf")).unsqueeze(1)


def _grouped(kv: Tensor, q: Tensor) -> Tensor:
    """Key or value heads repeated to the query heads (grouped-query attention)."""
    groups = q.shape[-3] // kv.shape[-3]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def _ungrouped(grad: Tensor, kv: Tensor) -> Tensor:
    """A gradient over the repeated heads summed back onto the key/value heads."""
    heads = kv.shape[-3]
    groups = grad.shape[-3] // heads
    if groups == 1:
        return grad
    return grad.unflatten(-3, (heads, groups)).sum(-3)
