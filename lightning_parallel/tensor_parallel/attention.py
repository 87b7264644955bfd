"""Attention with its heads split across TP ranks (Shoeybi et al. 2019, §3, Figure 3b).

Each rank computes ``heads / tp`` whole heads: the Q, K, V projection is column-parallel (each
rank keeps its slice of the q, k and v blocks of a fused weight), the attention itself is local,
and the output projection is row-parallel. Two shapes of unchanged model code need more than a
sharded Linear, so they get the forward below:

* ``nn.MultiheadAttention`` keeps Q, K and V in one raw parameter (``in_proj_weight``), not in
  Linears: ``ParallelMultiheadAttention`` replaces the module with the same call signature.
* nanoGPT-shaped attention (a fused ``Linear(d, 3d)``, a ``Linear(d, d)`` and a stored head
  count or head size) reshapes with sizes taken from its *input*, which is full width (or, with
  sequence parallelism, a sequence shard): ``tp_causal_attention_forward`` is bound to the module
  in place of its forward and does the same math on the local heads. It is recognised by
  structure, not by class name (``plan.find_fused_attention``).

Dropout on attention probabilities acts on sharded heads, so it draws from the per-rank stream.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .comm import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
)
from .layers import RowParallelLinear
from .random import TPRandom


def _to_additive(mask: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    """A ``nn.MultiheadAttention`` mask (bool: True = blocked, or float: added) as an additive float mask."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


class ParallelMultiheadAttention(nn.Module):
    """Drop-in replacement for ``nn.MultiheadAttention`` holding ``num_heads / tp`` heads.

    ``in_proj_weight``/``in_proj_bias`` are this rank's rows of each of the q, k, v blocks
    (``TPShard(dim=0, fused=3)``); ``out_proj`` is a ``RowParallelLinear``. Returns
    ``(output, weights or None)`` like the original; averaged weights are summed across ranks.
    """

    # PyTorch's fused inference path for nn.TransformerEncoderLayer reads the full weights; this
    # flag (the same one MultiheadAttention sets for separate q/k/v sizes) makes it fall back.
    _qkv_same_embed_dim = False

    def __init__(
        self,
        in_proj_weight: nn.Parameter,
        in_proj_bias: Optional[nn.Parameter],
        out_proj: RowParallelLinear,
        num_heads: int,
        dropout: float,
        batch_first: bool,
        group,
        tp_rank: int,
        rng: TPRandom,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.in_proj_weight = in_proj_weight  # (3 * d / tp, d)
        self.in_proj_bias = in_proj_bias
        self.out_proj = out_proj
        self.embed_dim = in_proj_weight.shape[1]
        self.num_heads = num_heads
        self.head_dim = self.embed_dim // num_heads
        self.local_heads = in_proj_weight.shape[0] // (3 * self.head_dim)
        self.head_start = tp_rank * self.local_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.group = group
        self.rng = rng
        self.sequence_parallel = sequence_parallel

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_from_sequence_region(x, self.group)
        return copy_to_region(x, self.group)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[torch.Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        if not self.batch_first:  # (s, b, d) -> (b, s, d)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        if query is key and key is value:  # self-attention: one f (one backward all-reduce)
            x = self._enter(query)
            q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            q = F.linear(self._enter(query), w_q, b_q)
            k = F.linear(self._enter(key), w_k, b_k)
            v = F.linear(self._enter(value), w_v, b_v)
        B, T, S = q.shape[0], q.shape[1], k.shape[1]
        # (b, s, heads/tp * head_dim) -> (b, heads/tp, s, head_dim)
        q, k, v = (t.reshape(B, -1, self.local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))

        mask = _to_additive(attn_mask, q.dtype)
        if mask is not None and mask.dim() == 3:  # (b * heads, t, s): keep this rank's heads
            mask = mask.view(B, self.num_heads, T, S)[:, self.head_start : self.head_start + self.local_heads]
        if key_padding_mask is not None:
            pad = _to_additive(key_padding_mask, q.dtype).view(B, 1, 1, S)
            mask = pad if mask is None else mask + pad
        causal = is_causal and mask is None and not need_weights
        p = self.dropout if self.training else 0.0

        with self.rng.fork() if self.training else nullcontext():  # evaluation draws nothing, as on one device
            if need_weights:
                scores = q @ k.transpose(-2, -1) / self.head_dim**0.5  # (b, h/tp, t, s)
                if is_causal and mask is None:
                    mask = torch.full((T, S), float("-inf"), device=q.device).triu(1)
                if mask is not None:
                    scores = scores + mask
                probs = F.dropout(scores.softmax(dim=-1), p)
                y = probs @ v
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)

        y = self.out_proj(y.transpose(1, 2).reshape(B, T, -1))  # (b, t, d/tp) -> (b, t, d)
        if not self.batch_first:
            y = y.transpose(0, 1)
        if not need_weights:
            return y, None
        if average_attn_weights:  # mean over all heads = sum over ranks of (local sum / heads)
            return y, reduce_from_region(probs.sum(dim=1) / self.num_heads, self.group)
        return y, gather_from_region(probs, self.group, dim=1)  # (b, heads, t, s)


def tp_causal_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Forward for nanoGPT-shaped causal self-attention whose projections are TP-sharded.

    Bound to the module in place of its own forward (``plan.py``); ``self.tp_attention`` names
    its fused QKV (column-parallel, ``fused=3``) and output (row-parallel) projections.
    """
    parts: FusedAttentionParts = self.tp_attention
    qkv = getattr(self, parts.qkv)(x)  # (b, s, 3 * d / tp); full sequence even under SP
    B, T, _ = qkv.shape
    # (b, s, heads/tp * head_dim) -> (b, heads/tp, s, head_dim)
    q, k, v = (t.view(B, T, parts.local_heads, -1).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    with parts.rng.fork() if self.training else nullcontext():  # evaluation draws nothing, as on one device
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=parts.dropout if self.training else 0.0)
    y = getattr(self, parts.out)(y.transpose(1, 2).reshape(B, T, -1))  # (b, s(/tp), d)
    return getattr(self, parts.resid_dropout)(y) if parts.resid_dropout else y


@dataclass(frozen=True)
class FusedAttentionParts:
    """What ``tp_causal_attention_forward`` needs to know about one nanoGPT-shaped attention."""

    qkv: str
    out: str
    local_heads: int
    dropout: float
    resid_dropout: Optional[str]
    rng: TPRandom
