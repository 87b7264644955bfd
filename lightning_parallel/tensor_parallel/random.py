"""Dropout random streams under tensor parallelism.

Dropout on a replicated activation must draw the same mask on every TP rank (otherwise the
replicas drift apart): it uses the default generator, which the strategy seeds identically on
all ranks. Dropout on a sharded activation (local attention heads, a sequence shard) must draw
independent masks per rank, or every shard would reuse one mask. Megatron-LM keeps a second,
TP-rank-offset stream for that (``model_parallel_cuda_manual_seed``: seed + 2718 + tp_rank,
Shoeybi et al. 2019); ``TPRandom.fork`` swaps it in for the duration of a block.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

TP_SEED_OFFSET = 2718


class TPRandom:
    """A per-TP-rank random stream (CPU, and the current CUDA device once CUDA is in use)."""

    def __init__(self, seed: int, tp_rank: int) -> None:
        self.seed = seed + TP_SEED_OFFSET + tp_rank
        self._cpu = torch.Generator().manual_seed(self.seed).get_state()
        self._cuda: Optional[torch.Tensor] = None

    @contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block on the per-rank stream, then restore the default stream where it was."""
        use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        default_cpu = torch.get_rng_state()
        default_cuda = torch.cuda.get_rng_state() if use_cuda else None
        torch.set_rng_state(self._cpu)
        if use_cuda:
            if self._cuda is None:
                torch.cuda.manual_seed(self.seed)
            else:
                torch.cuda.set_rng_state(self._cuda)
        try:
            yield
        finally:
            self._cpu = torch.get_rng_state()
            torch.set_rng_state(default_cpu)
            if use_cuda:
                self._cuda = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(default_cuda)


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
