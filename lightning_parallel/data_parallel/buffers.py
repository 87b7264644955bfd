"""Buffers of the data-parallel replicas (BatchNorm's running statistics) kept as DDP keeps them.

Each replica normalises its own samples in training, so the running mean and variance a BatchNorm
layer updates drift apart between replicas, and each would validate with its own statistics.
PyTorch's ``DistributedDataParallel`` (``broadcast_buffers=True``, its default; Li et al., "PyTorch
Distributed", VLDB 2020) broadcasts rank 0's buffers to the other replicas before a forward, when
the forward before it was one that synchronises gradients (grad enabled, outside ``no_sync``): once
per optimizer step under gradient accumulation, at the first validation forward after training, and
never right after a forward without grad. ``BufferBroadcast`` does exactly that over the
data-parallel group, in DDP's coalesced buckets, so the replicas keep the statistics DDP's would.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_parallel.compat import _sync_params_and_buffers

_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size


class BufferBroadcast:
    """Call ``before_forward(synchronising)`` on every rank before each forward of the replica."""

    def __init__(self, module: nn.Module, group) -> None:
        self.buffers = [b.detach() for b in module.buffers()]
        self.group = group
        self.pending = True  # DDP's require_forward_param_sync starts True: the first forward broadcasts

    def before_forward(self, synchronising: bool) -> None:
        """Broadcast the group's first rank's buffers if the previous forward synchronised gradients;
        ``synchronising``: whether this forward will (grad enabled, gradients reduced after it)."""
        if self.pending and self.buffers:
            _sync_params_and_buffers(self.group, self.buffers, _BUCKET_BYTES, 0)
        self.pending = synchronising and torch.is_grad_enabled()
