"""Dropout random streams under tensor parallelism.

Dropout on a replicated activation must draw the same mask on every TP rank (otherwise the
replicas drift apart): it uses the default generator, which the strategy seeds identically on
all ranks. Dropout on a sharded activation (local attention heads, a sequence shard) must draw
independent masks per rank, or every shard would reuse one mask. Megatron-LM keeps a second,
TP-rank-offset stream for that (``model_parallel_cuda_manual_seed``: seed + 2718 + tp_rank,
Shoeybi et al. 2019) and, because activation checkpointing recomputes the forward, saves and
restores that stream around every recomputation (its own ``CheckpointFunction``).

Here the per-rank stream is *derived from the default one*: each ``TPRandom.fork`` draws one
number from the default generator (the same on every TP rank, so replicated dropout stays in
step) and seeds the block with it, mixed with the TP rank. Any recomputation that restores the
default generator, as ``torch.utils.checkpoint`` and Hugging Face's gradient checkpointing do,
therefore replays the same per-rank masks, with no hook into the checkpointing code.
``split_region_random`` switches to the per-rank stream between a colwise and a rowwise layer of
one module, for dropout written inside unchanged model code (Hugging Face attention).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

TP_SEED_OFFSET = 2718
_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads consecutive TP ranks over the seed space


class TPRandom:
    """Per-TP-rank random streams, derived from the default generator (CPU and current CUDA device)."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank

    def _block_seed(self) -> int:
        """One draw from the default CPU stream (advances it alike on every TP rank), mixed with the rank."""
        drawn = int(torch.randint(0, 2**62, (1,)).item())
        return (drawn + TP_SEED_OFFSET + self.tp_rank * _GOLDEN) % 2**63

    def enter(self) -> tuple:
        """Switch to this rank's stream (one draw from the default one); returns what ``leave`` restores."""
        use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        seed = self._block_seed()
        saved = (torch.get_rng_state(), torch.cuda.get_rng_state() if use_cuda else None)
        torch.default_generator.manual_seed(seed)
        if use_cuda:
            torch.cuda.manual_seed(seed)
        return saved

    @staticmethod
    def leave(saved: tuple) -> None:
        """Back to the default stream, where one draw left it."""
        torch.set_rng_state(saved[0])
        if saved[1] is not None:
            torch.cuda.set_rng_state(saved[1])

    @contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block on this rank's stream; afterwards the default stream is where one draw left it."""
        saved = self.enter()
        try:
            yield
        finally:
            self.leave(saved)


def split_region_random(parent: nn.Module, colwise: list[nn.Module], rowwise: list[nn.Module], rng: TPRandom) -> None:
    """Random ops in ``parent`` from the first colwise layer's start to a rowwise layer's start act
    on split activations (an attention's heads, an MLP's hidden features): they draw from the
    per-rank stream. Hugging Face attention drops probabilities inside its own code, so the switch
    is made by hooks; it ends at the latest when ``parent`` returns. In evaluation mode nothing
    switches, so the default stream moves as on one device (a sampled ``generate`` draws the same)."""
    state: dict[str, tuple] = {}

    def enter(*_):
        if "saved" not in state and parent.training:  # evaluation drops nothing: it draws nothing, as on one device
            state["saved"] = rng.enter()

    def leave(*_):
        if "saved" in state:
            rng.leave(state.pop("saved"))

    for m in colwise:
        m.register_forward_pre_hook(enter)
    for m in rowwise:
        m.register_forward_pre_hook(leave)
    parent.register_forward_hook(leave, always_call=True)


class ShardedDropout(nn.Dropout):
    """``nn.Dropout`` for an activation that differs per TP rank: draws from the per-rank stream."""

    def __init__(self, p: float, inplace: bool, rng: TPRandom) -> None:
        super().__init__(p, inplace)
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.rng.fork():
            return super().forward(x)
