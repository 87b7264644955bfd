"""Attention masks that keep their meaning when the sequence is split: padding and packed documents.

Pure tensor logic, no processes. A mask over the whole ``S x S`` attention cannot travel with the
sequence's chunks, but the masks fine-tuning brings are made of per-token facts: which keys are
padding (a tokenizer's ``attention_mask``, right or left) and which document a token belongs to
(packed rows, where Hugging Face builds a block-diagonal mask from restarting ``position_ids``).
Both fit in one integer per token and per side, ``TokenIds``: query ``q`` attends key ``k`` when
``query[q] == key[k]``, and, for causal attention, ``k <= q``. A padding key gets an id no query
has; a query is given the id of the first key it attends to (the first token of its document), or
one no key has when it attends to none. Those ``2 x batch x S`` integers are sliced like the tokens
(``chunks.shard``), so each (query chunk, key chunk) block of the ring rebuilds its part of the
mask exactly (``block_mask``); the same ids describe a bidirectional encoder's padded batch.

``token_ids`` derives the ids from the mask itself and keeps them only when they rebuild it entry
for entry; any other mask (a sliding window, a prefix-LM mask, a different mask per head, an
additive bias such as ALiBi, an arbitrary dense pattern) has no such per-token form and is named
by ``what_it_is`` for the refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

NO_KEY, PADDING = -1, -2  # the id of a query attending to no key; the id of a padding key


@dataclass(frozen=True)
class TokenIds:
    """Per-token ids of a mask over a ``length``-token sequence, ``(batch or 1, length)`` each (module docstring)."""

    query: Tensor
    key: Tensor
    causal: bool


def allowed(mask: Tensor, length: int) -> Optional[Tensor]:
    """``mask`` as a boolean ``(batch or 1, length, length)`` (True attends), or None when it is not one
    mask over the whole sequence: another shape, an additive bias (values other than 0 and -inf / the
    dtype's minimum), a different mask per head."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length) or mask.dim() > 4:
        return None
    if mask.dtype == torch.bool:
        attends = mask
    else:
        attends = mask == 0
        if not bool((attends | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            return None
    attends = attends.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if attends.shape[1] > 1 and not bool((attends == attends[:, :1]).all()):
        return None
    return attends[:, 0]


def token_ids(mask: Tensor, length: int) -> Optional[TokenIds]:
    """The per-token ids that rebuild ``mask`` exactly (causal when it lets no query see a later key),
    or None when no ids do."""
    attends = allowed(mask, length)
    if attends is None:
        return None
    causal = not bool(attends.triu(1).any())
    first = attends.to(torch.uint8).argmax(-1)  # the first key each query attends to (the first maximum)
    query = torch.where(attends.any(-1), first, torch.full_like(first, NO_KEY))
    key = torch.where(attends.diagonal(dim1=-2, dim2=-1), query, torch.full_like(query, PADDING))
    ids = TokenIds(query, key, causal)
    return ids if bool((block_mask(ids.query, ids.key, causal) == attends).all()) else None


def block_mask(query: Tensor, key: Tensor, causal: bool) -> Tensor:
    """The boolean ``(batch, queries, keys)`` mask of queries with ids ``query`` on keys with ids ``key``;
    ``causal`` also masks the upper triangle (queries and keys then cover the same positions, in order)."""
    same = query.unsqueeze(-1) == key.unsqueeze(-2)
    if causal:
        same = same & torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()
    return same


def what_it_is(mask: Tensor, length: int) -> str:
    """Words for a mask ``token_ids`` cannot describe, for the refusal."""
    shape = tuple(mask.shape)
    if mask.dim() < 2 or shape[-2:] != (length, length):
        return (f"an attention mask of shape {shape}, not one over the {length}-token sequence's queries and keys "
                "(e.g. one cut to the local keys)")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
        return (f"an additive attention mask of shape {shape} with values other than 0 and -inf: a bias on the "
                "scores (ALiBi-like or learned), not a mask")
    if allowed(mask, length) is None:
        return f"an attention mask of shape {shape} that differs between heads"
    return (f"an attention mask of shape {shape} that is neither causal nor bidirectional attention within "
            "documents with padding (e.g. a sliding window, a prefix-LM mask, an arbitrary dense pattern)")
