"""SLURM's requeue signal, handled where every rank can take part in saving a checkpoint.

Lightning saves the checkpoint (a collective: barrier, and gathers for a split model) inside the
signal handler itself, at whatever instruction each rank happens to be. A rank that is in the middle
of a gradient all-reduce or a pipeline send then pairs the wrong collectives and the job hangs. Here
the handler only records the signal; every ``CHECK_EVERY`` batches all ranks agree (one all-reduce of
a flag, read on the host) and, if any rank got the signal, run Lightning's own handler together:
save ``hpc_ckpt_<n>.ckpt``, then ``scontrol requeue`` from rank 0.

Why every ``CHECK_EVERY`` batches and not every batch: the agreement is a collective plus a host read,
which on a GPU waits for the whole queued step; once per batch it stalls the pipeline of kernels
every step. Why not only on the rank that got the signal: the other ranks would have to enter the
same collective at the same batch without knowing about it. Counting batches keeps the decision
identical on every rank at no cost between checks. The price is latency: the checkpoint starts up
to ``CHECK_EVERY`` batches after the signal, so ``#SBATCH --signal=USR1@<seconds>`` must leave at
least ``CHECK_EVERY`` step times plus the checkpoint's write time before the time limit.
"""

from __future__ import annotations

import signal
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment

CHECK_EVERY = 8  # batches between two agreements on the signal


class DeferredRequeue:
    """Swap the requeue-signal handler for one that waits for a batch boundary."""

    def __init__(self, environment: Any):
        self.signum: Optional[int] = None
        self.handler: Optional[Callable] = None
        self.received = False
        self.batches = 0  # counted on every rank alike, so every rank checks at the same batch
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
        """Collective on every ``CHECK_EVERY``-th call: if any rank got the signal, all run Lightning's handler."""
        if self.handler is None:
            return
        self.batches += 1
        if self.batches % CHECK_EVERY:
            return
        flag = torch.tensor([int(self.received)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.received = False
            self.handler(self.signum, None)
