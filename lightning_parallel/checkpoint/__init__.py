"""Sharded checkpoints that load on any layout, and their consolidation into a plain file.

``save_sharded``/``load_sharded`` back ``ParallelStrategy.save_checkpoint``/``load_checkpoint``
(directories in PyTorch Distributed Checkpoint format: ``dcp.py``); ``consolidate`` (console
script ``lp-consolidate``) turns a shard directory into the file a single-device run would have
written.
"""

from lightning_parallel.checkpoint.atomic import (
    CheckpointSaveError,
    IncompleteCheckpointError,
)
from lightning_parallel.checkpoint.consolidate import consolidate
from lightning_parallel.checkpoint.format import CheckpointMismatchError
from lightning_parallel.checkpoint.io import (
    is_sharded_checkpoint,
    load_sharded,
    save_sharded,
)

__all__ = ["CheckpointMismatchError", "CheckpointSaveError", "IncompleteCheckpointError", "consolidate",
           "is_sharded_checkpoint", "load_sharded", "save_sharded"]
