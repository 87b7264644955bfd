"""Key/value caches in a relayed forward (``relay``): the layers of other stages keep the cache's length.

Under a relayed ``generate()`` every pipeline rank holds its own Hugging Face ``Cache`` object, and only
its own layers write real keys and values into it. The model reads the cache's length where no layer
of this rank may be: ``cache.get_seq_length()`` (layer 0) gives the new tokens' positions, and
``create_causal_mask`` asks ``get_mask_sizes`` of the first layer of each attention type. So where a
block of another rank is called with a cache, the cache gets a placeholder entry for that layer as long
as the new tokens, with one head of width one: through the cache's own ``update``, so dynamic,
sliding-window and static layers count it as they count real entries, at a tiny fraction of their memory.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _caches(args: tuple, kwargs: dict) -> list[Any]:
    """The Hugging Face caches among a block call's arguments (none where transformers is not in use)."""
    module = sys.modules.get("transformers.cache_utils")
    if module is None:
        return []
    return [v for v in (*args, *kwargs.values()) if isinstance(v, module.Cache)]


def keep_length(args: tuple, kwargs: dict, hidden: torch.Tensor, layer: int) -> None:
    """Add to every cache in a call of block ``layer`` (owned by another rank) an entry as long as the
    call's tokens: ``hidden`` is its ``(batch, tokens, width)`` input."""
    for cache in _caches(args, kwargs):
        if hidden.dim() < 2:
            raise RuntimeError("a block called with a key/value cache received a hidden state with fewer than two "
                               "dimensions; relayed generation expects (batch, tokens, ...) hidden states")
        entry = hidden.new_zeros(hidden.shape[0], 1, hidden.shape[1], 1)
        cache.update(entry, entry.clone(), layer)
