"""``scaled_dot_product_attention`` inside the split blocks, replaced by ring attention.

Unchanged attention code (Hugging Face's ``sdpa`` attention, nanoGPT-style modules, torch's
``nn.MultiheadAttention``) calls ``torch.nn.functional.scaled_dot_product_attention`` on the
queries, keys and values of the tokens this rank holds. ``AttentionInterceptor`` puts a function in
its place while the sequence is split, which sends each call to ``ring_attention`` with the same
meaning as on one device. A replaced module attribute rather than a ``TorchFunctionMode``: a mode is
handed ``F.multi_head_attention_forward`` whole and runs it with the mode off, so the attention call
inside ``nn.MultiheadAttention`` would escape it (torch's experimental ``context_parallel`` offers
both ways for the same reason). Code that imported the function under its own name before (``from
torch.nn.functional import scaled_dot_product_attention``) keeps the original; the first step then
sees no attention in its blocks and refuses it (``ContextParallel.counting``). The calls:

* ``is_causal=True``, or an explicit mask that is the causal mask (boolean, or additive with 0 and
  -inf / the dtype's minimum): causal ring attention;
* no mask and ``is_causal=False``: every query attends to every key (bidirectional);
* a mask of padding and packed documents over the whole sequence (right or left padding, the
  block-diagonal mask Hugging Face builds from restarting ``position_ids``; causal or
  bidirectional, boolean or additive): ring attention whose blocks rebuild their part of it from
  two ids per token (``masks.py``). A query with no key to attend to (left padding's first
  positions) gets output 0, as ``scaled_dot_product_attention`` gives it for a boolean or -inf mask
  (for a mask of the dtype's minimum one device averages all values there instead: a padding
  position whose output no real token reads, so losses and gradients are the same);
* keys of the whole, unsplit sequence (cross-attention to an encoder's output, which ran before
  the split): the local queries attend to them directly, no ring.

Anything else has no meaning this split can keep, and is refused with what would work: a mask that
is neither of those (a sliding window, a prefix-LM mask, a mask per head, an additive bias, one cut
to the local keys: ``masks.what_it_is`` names it), attention dropout (its random pattern cannot
match one device's), queries that are not this rank's tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_parallel.context_parallel.comm import Ring
from lightning_parallel.context_parallel.masks import TokenIds, allowed, token_ids, what_it_is
from lightning_parallel.context_parallel.ring import ring_attention
from lightning_parallel.errors import IncompatibleModelError

_SDPA = F.scaled_dot_product_attention  # torch's own, for the calls that stay as they are
_WHAT_WORKS = ("context_parallel supports causal or bidirectional attention, without a mask or with a mask of padding "
               "(right or left) and packed documents over the whole sequence")


class AttentionError(IncompatibleModelError):
    """Attention inside the split blocks that ring attention cannot compute as one device would."""


def is_causal_mask(mask: Tensor, length: int) -> bool:
    """Whether ``mask`` (boolean: True attends; or additive: 0 attends, -inf or the dtype's minimum does
    not) is the causal mask of ``length`` tokens for every batch element and head it covers."""
    attends = allowed(mask, length)
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return attends is not None and bool((attends == causal).all())


@dataclass
class Split:
    """The sequence's split for one step: ``length`` tokens over ``size`` ranks, this one ``rank``, its
    ``ring``. ``masks`` keeps each mask's ids for the step (every block
    is given the same mask)."""

    length: int
    size: int
    rank: int
    ring: Ring
    masks: dict[int, tuple[Tensor, Optional[TokenIds]]] = field(default_factory=dict)

    def ids(self, mask: Tensor) -> Optional[TokenIds]:
        """``mask``'s token ids (None for the plain causal mask), or the refusal naming it."""
        if id(mask) not in self.masks:
            ids = None if is_causal_mask(mask, self.length) else self._ids(mask)
            self.masks[id(mask)] = (mask, ids)
        return self.masks[id(mask)][1]

    def _ids(self, mask: Tensor) -> TokenIds:
        ids = token_ids(mask, self.length)
        if ids is None:
            raise AttentionError(
                f"{what_it_is(mask, self.length)} has no meaning once the {self.length}-token sequence is split "
                f"over {self.size} context-parallel ranks; {_WHAT_WORKS}. Pass the tokenizer's attention_mask "
                "(or restarting position_ids) and let the model build the mask, or train without context_parallel")
        return ids


def attend(split: Split, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
           dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
           enable_gqa: bool = False) -> Tensor:
    """One ``scaled_dot_product_attention`` call on this rank's ``length / size`` tokens of the ``split``
    sequence, computed over the whole sequence (see the module docstring)."""
    length, size = split.length, split.size
    local = length // size
    if query.shape[-2] != local:
        raise AttentionError(
            f"an attention inside the split blocks has {query.shape[-2]} queries, but each of the {size} "
            f"context-parallel ranks holds {local} of the sequence's {length} tokens: the blocks must attend over "
            "the sequence of their hidden state (batch first, the sequence in dimension 1)")
    if dropout_p > 0:
        raise AttentionError(
            f"attention dropout (dropout_p={dropout_p}) under context_parallel: its random pattern over the whole "
            "sequence cannot be drawn in pieces. Set the model's attention dropout to 0 (e.g. attention_dropout=0.0 "
            "in a Hugging Face config, dropout=0.0 for nn.MultiheadAttention)")
    if key.shape[-2] == length:  # an unsplit sequence, e.g. an encoder's output for cross-attention
        if attn_mask is not None or is_causal:
            raise AttentionError(f"a masked attention on the keys of a whole, unsplit sequence; {_WHAT_WORKS}")
        return _SDPA(query, key, value, scale=scale, enable_gqa=enable_gqa)
    if key.shape[-2] != local:
        raise AttentionError(
            f"an attention inside the split blocks has {key.shape[-2]} keys for {local} queries; {_WHAT_WORKS}")
    ids = None
    if attn_mask is not None:
        ids = split.ids(attn_mask)
        is_causal = True if ids is None else ids.causal
    return ring_attention(query, key, value, is_causal, scale, split.ring, ids=ids)


class AttentionInterceptor:
    """While entered, ``torch.nn.functional.scaled_dot_product_attention`` calls go to ``route()``'s function
    (``attend`` with the split's sizes) when it returns one, and to torch's own when it returns None."""

    def __init__(self, route: Callable[[], Optional[Callable[..., Tensor]]]):
        self.route = route

    def __enter__(self) -> "AttentionInterceptor":
        @functools.wraps(_SDPA)
        def scaled_dot_product_attention(*args, **kwargs):
            attention = self.route()
            return (attention or _SDPA)(*args, **kwargs)

        F.scaled_dot_product_attention = scaled_dot_product_attention
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = _SDPA
