"""The collectives of context parallelism: the ring's shift, and the whole sequence gathered back.

``Ring.shift`` sends a tensor to the next rank of the CP group and receives the previous rank's,
asynchronously, so ring attention computes one block while the next block's keys travel.

``gather_sequence`` ends the split region after the model's last block: every rank receives the
hidden state of the whole sequence, so the head and the user's loss run as on one device, on every
CP rank alike. Its backward keeps this rank's chunks of the (identical) incoming gradient and
multiplies them by the CP size. Why: the modules after the gather compute the whole loss on every
rank and get the whole gradient there, while the blocks and the modules before the split see only
this rank's tokens and get this rank's share of theirs. Scaled by ``N``, each rank's share becomes
an estimate of the whole with the same mean over the CP ranks; so averaging every gradient over the
DP and CP ranks together (``mesh.dp_cp_group``) gives the single-device gradient for both kinds,
as averaging over DP replicas does for data parallelism. The split at the first block needs no
collective: it is indexing (``chunks.shard``), and its backward fills the other ranks' positions
with zeros.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.context_parallel.chunks import shard, unshard


class Ring:
    """This rank's place on the ring of its CP group."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensor: Tensor, tag: int = 0) -> Callable[[], Tensor]:
        """Start sending ``tensor`` to the next rank and receiving the previous rank's; returns a function
        that waits for both and returns what was received. ``tag`` keeps concurrent shifts apart."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ])

        def wait() -> Tensor:
            for work in works:
                work.wait()
            return received
        return wait


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, dim: int, ring: Ring) -> Tensor:
        ctx.dim, ctx.ring = dim, ring
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(ring.size)]
        dist.all_gather(parts, local, group=ring.group)
        return unshard(parts, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ring = ctx.ring
        return shard(grad, ctx.dim, ring.size, ring.rank) * ring.size, None, None


def gather_sequence(local: Tensor, dim: int, ring: Ring) -> Tensor:
    """The whole sequence along ``dim`` from every CP rank's chunks (see the module docstring for the
    gradient)."""
    return _GatherSequence.apply(local, dim, ring)
