"""The setup check of context parallelism: the user's step on the first batch, with the sequence split.

What context parallelism refuses is seen only when the model runs: a sequence length that does not
divide into ``2 x context_parallel`` chunks, an attention mask other than the causal one, attention
dropout, attention that does not go through ``scaled_dot_product_attention``, a per-token side input
the split cannot place. So at setup every rank runs the step the Trainer is about to run on the
loop's first batch (``pipeline/example.py``), forward only, with the split active but without
communicating (``ContextParallel.checking``), leaving nothing behind (``pipeline/isolation.py``,
``self.log`` suppressed, random number generators restored). Then all ranks exchange their outcome
in one collective and, if any failed, raise on every rank, before training starts.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from lightning_parallel.context_parallel import ContextParallel
from lightning_parallel.errors import IncompatibleModelError, LightningParallelError
from lightning_parallel.pipeline.example import first_batch
from lightning_parallel.pipeline.isolation import untouched
from lightning_parallel.pipeline.logs import LogCapture


def refuse_unsplittable_sequence(strategy: Any, trainer: Any, context: ContextParallel) -> None:
    """Run the check of the module docstring; all ranks must call it (one collective). Skipped without
    data, and for ``training_step`` under manual optimisation (it steps optimizers itself)."""
    module = strategy.lightning_module
    error: Optional[BaseException] = None
    manual = trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization
    batch, step = (None, "") if manual else first_batch(trainer, strategy)
    if batch is not None:
        devices = [strategy.root_device] if strategy.root_device.type == "cuda" else []
        try:
            with untouched(module), LogCapture(module).suppressed(), torch.random.fork_rng(devices=devices), \
                    torch.no_grad(), context.checking():
                getattr(module, step)(batch, 0)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            error = err
    outcomes: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
    if not failed:
        return
    if isinstance(error, LightningParallelError):  # a refusal: the same on every rank that read this batch
        raise error
    rank, text = failed[0]
    raise IncompatibleModelError(
        f"context_parallel={context.ring.size}: {step} on the first batch fails with the sequence split "
        f"(rank {rank}): {text}")
