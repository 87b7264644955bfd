"""The batch shape a run trains on, read from its data before any process group exists.

``strategy=auto``, the memory estimate of ``lp-plan`` and ``lp-plan --search`` size a layout by
(sequences per replica, tokens per sequence). Both the command line (from the config) and the
strategy (from the Trainer's data, on every rank before ``init_process_group``) read it the same
way:

1. a data module's own ``batch_size`` and ``block_size`` arguments, when it has both: the shipped
   ``TextDataModule`` yields batches of exactly that shape, and reading the arguments costs nothing
   where reading a batch means loading its corpus;
2. otherwise the first batch of its training loader: the data module is set up for fitting first
   (``setup("fit")``; Lightning sets it up again for the run, from the same random state, since the
   random number generators are restored after the read), and the first tensor of the batch gives
   ``(B, T, ...)``, or ``(B,)`` read as T = 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch


class BatchShapeUnknown(ValueError):
    """The data does not show its batch shape before the run; the message says why."""


def batch_shape(batch: Any) -> Optional[tuple[int, int]]:
    """(sequences, tokens per sequence) of a batch: the first tensor in it, (B, T, ...) or (B,)."""
    if isinstance(batch, torch.Tensor):
        return (batch.shape[0], batch.shape[1] if batch.dim() > 1 else 1) if batch.dim() else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((shape for shape in map(batch_shape, items) if shape is not None), None)


def argument_shape(arguments: Mapping) -> Optional[tuple[int, int]]:
    """``(batch_size, block_size)`` when a data module's arguments give both, else None."""
    batch, block = arguments.get("batch_size"), arguments.get("block_size")
    return None if batch is None or block is None else (int(batch), int(block))


def first_training_batch(datamodule: Any) -> Any:
    """The first batch of ``datamodule``'s training loader, set up for fitting; the random number
    generators are as they were before (raises what the data module raises)."""
    with torch.random.fork_rng(devices=[]):
        datamodule.setup(stage="fit")
        return next(iter(datamodule.train_dataloader()))


def datamodule_shape(datamodule: Any, arguments: Optional[Mapping] = None) -> tuple[int, int]:
    """The batch shape of ``datamodule`` (the module docstring's rule); ``arguments`` default to its
    saved hyperparameters. Raises ``BatchShapeUnknown``."""
    shape = argument_shape(arguments if arguments is not None else getattr(datamodule, "hparams", {}))
    if shape is not None:
        return shape
    name = type(datamodule).__name__
    try:
        batch = first_training_batch(datamodule)
    except Exception as err:  # noqa: BLE001 - any failure of the user's data code means: unknown here
        raise BatchShapeUnknown(f"{name}'s training loader could not be read before the run "
                                f"({type(err).__name__}: {err})") from err
    shape = batch_shape(batch)
    if shape is None:
        raise BatchShapeUnknown(f"the first batch of {name}'s training loader holds no tensor to read the shape from")
    return shape
