"""A random-number stream of its own for each pipeline stage, so stages draw different dropout masks.

Every rank of a pipeline starts from the same seed, so without care the blocks of stage 1 would
draw exactly the masks stage 0 drew for tensors of the same shape: the "independent" dropout of
two layers would be one mask twice. Megatron-LM offsets the seed by the pipeline rank
(``seed + 100 * pipeline_rank`` in ``_set_random_seed`` before ``model_parallel_cuda_manual_seed``);
here the offset goes to a generator state kept apart from the global one and swapped in only
around this rank's forwards. The rest of the program (data shuffling, which every stage must do
alike) keeps the global stream it had, and two runs with one seed draw the same masks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

SEED_OFFSET = 100  # per pipeline rank, as in Megatron-LM


class StageRandomness:
    """The generator states (CPU, and the stage's CUDA device) of one pipeline rank.

    Args:
        seed: the run's seed (``torch.initial_seed()``, equal on every rank under ``seed_everything``).
        pipeline_rank: this rank's position in the pipeline.
        device: where the stage computes.
    """

    def __init__(self, seed: int, pipeline_rank: int, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        seed = seed + SEED_OFFSET * pipeline_rank
        cpu = torch.Generator().manual_seed(seed).get_state()
        self.state = (cpu, torch.Generator(self.device).manual_seed(seed).get_state() if self.cuda else None)

    def _get(self) -> tuple:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda else None

    def _set(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state(state[1], self.device)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Draw from this stage's stream inside; the global stream is untouched (``fork_rng`` puts it back)."""
        with torch.random.fork_rng(devices=[self.device] if self.cuda else []):
            self._set(self.state)
            try:
                yield
            finally:
                self.state = self._get()
