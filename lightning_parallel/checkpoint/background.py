"""Checkpoints written while training goes on: staged in host memory, then written by a thread.

The two halves of ``torch.distributed.checkpoint.async_save``, with the commit protocol of
``atomic.py`` inside the second:

1. **stage** (on the training thread, the only time training stops): every tensor of the
   checkpoint is copied into host memory by DCP's ``DefaultStager`` (pinned memory when CUDA is
   there; the buffers are kept and reused by the next save), so the optimizer steps that follow
   cannot change what is written;
2. **write** (on one background thread): the whole save, every rank's pieces, the agreements
   and the final renames, runs there. Its collectives use a process group of their own (gloo,
   spanning every process), created once, so they never pair with the training's collectives on
   other groups (torchtitan does the same for its asynchronous saves).

One save is in flight at a time: a new one first waits for the previous write (whose staging
buffers it reuses), and so do loading a checkpoint and the strategy's teardown at the end of
``fit``. A removal (``ModelCheckpoint`` keeping the top k) runs after the write in flight and only
if that write succeeded, so a crash during the write never leaves fewer complete checkpoints than
before. A write that failed raises its error on the training thread at the next save, load or
teardown; as with any save of ``atomic.py``, the previous checkpoint is then unchanged.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


def writes_default_files(checkpoint_io: Any) -> bool:
    """Whether ``checkpoint_io`` is Lightning's default writer, alone or under ``AsyncCheckpointIO``:
    the plugins whose files the strategy writes itself (atomically, and in the background with
    ``AsyncCheckpointIO``)."""
    if type(checkpoint_io) is AsyncCheckpointIO:
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io is None or type(checkpoint_io) is TorchCheckpointIO


class BackgroundSaves:
    """The staging buffers, the writing thread and the process group of asynchronous checkpoints."""

    def __init__(self, timeout: timedelta) -> None:
        # a collective: every process creates the group, in the same order as its other groups
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        pinned = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_parallel-checkpoint")
        self._pending: list[Future] = []  # the write in flight, then the steps that wait for it

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` whose tensors are in host memory, once the previous write has finished."""
        self.wait()
        return self._stager.stage(obj)

    def submit(self, write: Callable[[], None]) -> None:
        """Run ``write`` (which reads only staged copies) on the background thread."""
        self.wait()
        self._pending.append(self._executor.submit(write))

    def then(self, step: Callable[[], None]) -> None:
        """Run ``step`` once the write in flight has succeeded (now, when none is in flight); skip it
        when that write failed."""
        if not self._pending:
            step()
            return
        write = self._pending[0]

        def after() -> None:  # the thread runs one job at a time: ``write`` is done
            if write.exception() is None:
                step()

        self._pending.append(self._executor.submit(after))

    def wait(self) -> None:
        """Block until nothing is in flight; raise the first error of what ran."""
        pending, self._pending = self._pending, []
        errors = [future.exception() for future in pending]
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            raise first
