"""What each rank of a refused run raised, and whether an optimizer stepped before: for the tests of
refusals raised at setup or in the first step (``checks/first_step.py``).

Fork-started ranks share no memory, so each writes to a file under ``out``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch.callbacks import Callback

from lightning_parallel.errors import LightningParallelError
from lightning_parallel.strategy import ParallelStrategy


class Stepped(Callback):
    """Leaves ``<out>/step<rank>`` when an optimizer steps."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        (self.out / f"step{trainer.global_rank}").touch()


class RecordingStrategy(ParallelStrategy):
    """Writes the refusal its setup or training step raises to ``<out>/rank<r>.txt`` (``Type: message``),
    then raises it on; with ``wait``, once every rank has written its own (the launcher stops the other
    ranks when the first one fails), for refusals every rank raises."""

    def __init__(self, out: Path, wait: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out, self.wait = out, wait

    def _recorded(self, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except LightningParallelError as err:
            (self.out / f"rank{self.global_rank}.txt").write_text(f"{type(err).__name__}: {err}")
            if self.wait:
                torch.distributed.barrier()
            raise

    def setup(self, trainer) -> None:
        self._recorded(lambda: super(RecordingStrategy, self).setup(trainer))

    def training_step(self, *args, **kwargs):
        return self._recorded(lambda: super(RecordingStrategy, self).training_step(*args, **kwargs))


def refusals(out: Path, ranks: int) -> dict[int, str]:
    """What each rank that refused wrote, by rank."""
    return {r: (out / f"rank{r}.txt").read_text() for r in range(ranks) if (out / f"rank{r}.txt").exists()}
