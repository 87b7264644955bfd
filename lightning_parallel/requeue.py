"""SLURM's requeue signal, handled where every rank can take part in saving a checkpoint.

Lightning saves the checkpoint (a collective: barrier, and gathers for a split model) inside the
signal handler itself, at whatever instruction each rank happens to be. A rank that is in the middle
of a gradient all-reduce or a pipeline send then pairs the wrong collectives and the job hangs. Here
the handler only records the signal; at the start of the next batch all ranks agree (one all-reduce
of a flag) and run Lightning's own handler together: save ``hpc_ckpt_<n>.ckpt``, then
``scontrol requeue`` from rank 0.
"""

from __future__ import annotations

import signal
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment


class DeferredRequeue:
    """Swap the requeue-signal handler for one that waits for a batch boundary."""

    def __init__(self, environment: Any):
        self.signum: Optional[int] = None
        self.handler: Optional[Callable] = None
        self.received = False
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
            self.signum = environment.requeue_signal

    def install(self) -> None:
        """Call once Lightning has registered its handlers (they are taken over, not dropped)."""
        if self.signum is None or self.handler is not None:
            return
        current = signal.getsignal(self.signum)
        if callable(current):
            self.handler = current
            signal.signal(self.signum, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        self.received = True

    def at_batch_boundary(self, device: torch.device) -> None:
        """Collective: if any rank got the signal, every rank runs Lightning's handler now."""
        if self.handler is None:
            return
        flag = torch.tensor([int(self.received)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.received = False
            self.handler(self.signum, None)
