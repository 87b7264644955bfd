"""Split an unchanged model's sequence over the CP ranks at its first block and gather it after its last.

Everything before the model's repeated blocks (embeddings, rotary tables, masks, position ids)
runs unchanged on the whole sequence, on every CP rank. A forward pre-hook on the first block
keeps this rank's two chunks (``chunks.shard``) of the hidden state and of the per-token side
inputs the blocks receive (Hugging Face's ``position_embeddings`` cos/sin, ``position_ids``,
``cache_position``, LitGPT-style ``cos``/``sin``), so positions and rotary embeddings are those of
one device. Inside the blocks, attention goes round the ring (``attention.py``); everything else in
a block acts token by token. A forward hook on the last block gathers the whole sequence back
(``comm.gather_sequence``), so the model's head and the user's loss see it whole. The block list is
given (the strategy passes the one the pipeline would split: ``pipeline.partition.find_blocks``).

The hooks act only inside ``ContextParallel.active()``, which the strategy enters around each step
and backward; elsewhere (a user's own forward outside the loops) the model runs whole on each rank.
During backward, a block that activation checkpointing recomputes is split again as it was, and its
attention still goes round the ring; its output is not gathered again (the forward's gather is the
one autograd uses). Blocks are assumed batch first, the sequence in dimension 1 (Hugging Face,
nanoGPT, ``batch_first=True`` torch layers); a block that is not attends over the wrong dimension,
which ``attention.attend`` refuses.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.compat import in_backward
from lightning_parallel.context_parallel.attention import AttentionInterceptor, Split, attend
from lightning_parallel.context_parallel.chunks import check_length, shard
from lightning_parallel.context_parallel.comm import Ring, gather_sequence
from lightning_parallel.errors import IncompatibleModelError

# side inputs of a block that hold one entry per token: split like the hidden state
PER_TOKEN = frozenset({"position_embeddings", "position_ids", "cache_position", "cos", "sin", "freqs_cis",
                       "rope", "rotary_pos_emb", "input_pos"})
# side inputs that stay whole: another sequence (cross-attention), read by the attention interceptor (masks)
WHOLE = frozenset({"memory", "encoder_hidden_states", "encoder_attention_mask"})


class ContextParallel:
    """Context parallelism on a model's repeated blocks over ``group`` (hooks; no module is changed).

    Args:
        blocks: the model's repeated blocks, in the order they run (the sequence is split at the first
            and gathered after the last).
        group: the CP process group; rank ``i`` of it holds chunks ``i`` and ``2N - 1 - i``.
        blocks_path: the blocks' dotted path in the model, for messages.
    """

    def __init__(self, blocks: Sequence[nn.Module], group: dist.ProcessGroup, blocks_path: str = "the blocks"):
        self.ring = Ring(group)
        self.blocks_path, self.blocks = blocks_path, list(blocks)
        self.length: Optional[int] = None  # the whole sequence's length in the current step
        self.split: Optional[Split] = None  # what attention needs of the current step's split
        self.enabled = False  # inside a step or backward of the strategy
        self.inside = False  # between the first block's input and the last block's output
        self.calls: Optional[list[int]] = None  # attention calls per block while counting
        self._block = 0
        self._names = [_positional_names(b) for b in self.blocks]
        self._shards: dict[int, tuple[Any, Any]] = {}  # id(side input) -> (it, its shard), for this step
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(self._inputs(i), with_kwargs=True)
        self.blocks[-1].register_forward_hook(self._gather)
        self._interceptor = AttentionInterceptor(self._route)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Around a step (or its backward): the hooks split and gather, attention goes round the ring."""
        if self.enabled:  # nested (a backward inside a step with manual optimisation)
            yield
            return
        self.enabled, self.inside = True, False
        try:
            with self._interceptor:
                yield
        finally:
            self.enabled, self.inside = False, False

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Around the run's first step (inside ``active``): refuses, once it ran, blocks in which no
        attention was intercepted (attention written out by hand, Hugging Face's ``eager`` attention),
        which attended within this rank's tokens only, before any parameter changes."""
        self.calls = [0] * len(self.blocks)
        try:
            yield
            missing = [i for i, n in enumerate(self.calls) if n == 0]
        finally:
            self.calls = None
        if missing:
            raise IncompatibleModelError(
                f"context_parallel: block(s) {missing} of {self.blocks_path} ran without calling "
                "torch.nn.functional.scaled_dot_product_attention, so their attention would see only this rank's "
                "part of the sequence. Use attention through scaled_dot_product_attention (Hugging Face: "
                "attn_implementation='sdpa'; nn.MultiheadAttention with need_weights=False does), or train "
                "without context_parallel")

    # ---- hooks -----------------------------------------------------------------------------------
    def _inputs(self, index: int):
        """Block ``index``'s pre-hook: the hidden state split at the first block, the per-token side
        inputs at every block (callers pass the same whole tensors to each)."""
        def hook(block: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            self._block = index
            if not self.enabled:
                return None
            if index == 0:
                hidden = self._split_hidden(args, kwargs)
                args, kwargs = ((hidden, *args[1:]), kwargs) if args else (args, dict(kwargs, hidden_states=hidden))
            length, names = self.length, self._names[index]
            args = args[:1] + tuple(self._side(names[i] if i < len(names) else f"argument {i}", value, length)
                                    for i, value in enumerate(args[1:], 1))
            kwargs = {name: value if name == "hidden_states" else self._side(name, value, length)
                      for name, value in kwargs.items()}
            return args, kwargs
        return hook

    def _split_hidden(self, args: tuple, kwargs: dict) -> Tensor:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, Tensor) or hidden.dim() < 2:
            raise IncompatibleModelError(
                f"context_parallel: the first block of {self.blocks_path} was called without a hidden state of "
                "shape (batch, sequence, ...) as its first argument or hidden_states=")
        length = hidden.shape[1]
        check_length(length, self.ring.size)
        if not in_backward():  # a block recomputed by activation checkpointing is split again, as it was
            self.length, self.inside = length, True
            self._shards = {}
            self.split = Split(length, self.ring.size, self.ring.rank, self.ring)
        return shard(hidden, 1, self.ring.size, self.ring.rank)

    def _side(self, name: str, value: Any, length: int) -> Any:
        """A block's side input: this rank's tokens of a per-token one, the rest as given."""
        tensors = [value] if isinstance(value, Tensor) else (
            list(value) if isinstance(value, (tuple, list)) and all(isinstance(v, Tensor) for v in value) else [])
        if not tensors or "mask" in name or name in WHOLE:
            return value
        if name in PER_TOKEN:
            if id(value) not in self._shards:
                parts = [self._per_token(name, t, length) for t in tensors]
                self._shards[id(value)] = (value, parts[0] if isinstance(value, Tensor) else type(value)(parts))
            return self._shards[id(value)][1]
        if any(length in t.shape for t in tensors):
            raise IncompatibleModelError(
                f"context_parallel: the blocks of {self.blocks_path} receive {name!r}, a tensor with a dimension of "
                f"the sequence's length {length}, and it is not known whether it holds one entry per token (to split "
                f"like the hidden state: {', '.join(sorted(PER_TOKEN))}) or a whole sequence (to keep: "
                f"{', '.join(sorted(WHOLE))}, masks). Pass it under one of those names, or train without "
                "context_parallel")
        return value

    def _per_token(self, name: str, tensor: Tensor, length: int) -> Tensor:
        dim = 1 if tensor.dim() >= 2 and tensor.shape[1] == length else 0
        if tensor.shape[dim] != length:
            raise IncompatibleModelError(
                f"context_parallel: the blocks' side input {name!r} of shape {tuple(tensor.shape)} has no "
                f"dimension 0 or 1 of the sequence's length {length} to split")
        return shard(tensor, dim, self.ring.size, self.ring.rank)

    def _gather(self, block: nn.Module, args: tuple, output: Any) -> Any:
        if not self.enabled or in_backward() or not self.inside:
            return None
        self.inside, self._shards = False, {}
        hidden = output if isinstance(output, Tensor) else output[0]
        whole = gather_sequence(hidden, 1, self.ring)
        return whole if isinstance(output, Tensor) else (whole, *output[1:])

    def _route(self) -> Optional[Callable[..., Tensor]]:
        """For the attention interceptor: ``attend`` with this split's sizes while the sequence is split
        (inside the blocks, or recomputing them during backward), else None."""
        if not (self.enabled and (self.inside or (in_backward() and self.split is not None))):
            return None
        if self.calls is not None:
            self.calls[self._block] += 1
        return functools.partial(attend, self.split)


def _positional_names(block: nn.Module) -> list[str]:
    """Names of ``block.forward``'s positional parameters, in order (``*args`` ends them)."""
    names = []
    for p in inspect.signature(block.forward).parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return names
