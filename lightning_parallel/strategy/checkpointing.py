"""Checkpoints of ``ParallelStrategy``: a plain file for a whole model, a directory of shards for a split one.

A model that every rank holds whole (data parallelism, ZeRO-1) is written by rank 0 as one file,
atomically (``checkpoint/atomic.py``); a split model (TP shards, pipeline stages, ZeRO-2/3 rows) is
written by every rank as a Distributed Checkpoint directory under the unsplit names
(``checkpoint/dcp.py``), so it resumes on any layout and loads on one device. Each checkpoint records
the module's Hugging Face models, so ``lp-export`` can write them from the checkpoint alone.

With ``async_checkpoint=True`` or Lightning's ``AsyncCheckpointIO`` plugin (over the default
writer), both kinds are staged in host memory and written by a background thread while training
goes on (``checkpoint/background.py``), by the same atomic protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.checkpoint import load_sharded, save_sharded
from lightning_parallel.checkpoint.atomic import remove_checkpoint_dir, save_file
from lightning_parallel.checkpoint.background import BackgroundSaves, writes_default_files
from lightning_parallel.checkpoint.hf_models import RECORD_KEY as HF_RECORD_KEY
from lightning_parallel.checkpoint.hf_models import describe as describe_hf_models
from lightning_parallel.compat import _optimizers_to_device


class SplitCheckpoints:
    """Lightning's checkpoint hooks for a strategy that may split the model (mixed into ``ParallelStrategy``)."""

    background_saves: Optional[BackgroundSaves] = None  # asynchronous checkpoints, once the processes exist

    @property
    def async_checkpoint(self) -> bool:
        """Whether checkpoints are written in the background: asked for by the argument or by the plugin."""
        return self._async_checkpoint or type(self._checkpoint_io) is AsyncCheckpointIO

    @override
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # load into the set-up (possibly split) model, so each rank reads only what it holds
        return True

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        # what lp-export needs to write the module's Hugging Face models from this checkpoint alone
        checkpoint = {**checkpoint, HF_RECORD_KEY: describe_hf_models(self.lightning_module)}
        background = self.background_saves
        if not self.splits_parameters:
            local = writes_default_files(self.checkpoint_io) and "://" not in str(filepath)
            if not local or storage_options is not None:
                return super().save_checkpoint(checkpoint, filepath, storage_options)
            if self.is_global_zero and background is not None:
                staged = background.stage(checkpoint)
                background.submit(lambda: save_file(staged, Path(filepath)))
            elif self.is_global_zero:  # Lightning's writer may copy over the old file: see atomic.save_file
                save_file(checkpoint, Path(filepath))
            return None
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported with a "
                            "split model: it writes a directory of shards itself, without the CheckpointIO plugin")
        if self.fully_sharded is not None:  # the parameters as the optimizer holds them (an evaluation may gather)
            self.fully_sharded.reshard()
        save_sharded(self, checkpoint, filepath, background)

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint being written in the background is on disk; raise its error."""
        if self.background_saves is not None:
            self.background_saves.wait()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict:
        if self.zero is not None and self.is_model_split:  # each rank saves its own slices (checkpoint/dcp.py)
            return self.zero.local_state_dict(optimizer)
        if self.zero is not None:  # the unsharded optimizer's state for a plain file, gathered on data-parallel rank 0
            return self.zero.state_dict(optimizer)
        return super().optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self.zero is None:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self.zero.load_state_dict(optimizer, state)  # each rank keeps the slices it steps
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict:
        # a plain file or a directory of shards, written on any layout
        self.wait_for_checkpoint()
        return load_sharded(self, checkpoint_path, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # a directory of shards disappears by one rename first, so a crash never leaves half of one;
        # with a checkpoint being written, only once it is on disk
        def remove() -> None:
            if self.is_global_zero and Path(filepath).is_dir():
                remove_checkpoint_dir(Path(filepath))
            else:
                super(SplitCheckpoints, self).remove_checkpoint(filepath)

        if self.background_saves is not None:
            self.background_saves.then(remove)
        else:
            remove()
