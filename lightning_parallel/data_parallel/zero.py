"""ZeRO stage 1: optimizer state sharded over the data-parallel group.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC 2020,
arXiv 1910.02054), stage 1 (P_os). Every rank keeps the whole model but gives its optimizer only a
``1/dp`` slice of it, so optimizer state (Adam's two moments: 8 bytes per fp32 parameter) shrinks by
``dp``. Per step:

1. backward reduce-scatters each gradient bucket, so a rank receives the averaged gradient of its
   own slice only (``GradientSynchronizer(shard=True)``);
2. the user's optimizer steps on the slice: its parameters are 1-D *pieces* that share storage with
   a flat copy of the bucket's parameters;
3. an all-gather of each bucket's flat parameters hands every rank the updated model.

The pieces are views, so the update is elementwise identical to the unsharded one for elementwise
optimizers (SGD, Adam, AdamW, ...). Optimizers that use whole-tensor statistics (LAMB, Adafactor)
would see slices and are not supported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.data_parallel.grad_sync import GradientSynchronizer


class ZeroOneSharding:
    """Rewrite ``optimizers`` to step on this rank's slice of every gradient bucket of ``sync``."""

    def __init__(self, sync: GradientSynchronizer, optimizers: list[torch.optim.Optimizer]):
        if not sync.shard:
            raise ValueError("ZeRO-1 needs a GradientSynchronizer created with shard=True")
        self.sync = sync
        self.flat: list[torch.Tensor] = []
        # (piece, bucket index, index of the parameter in the bucket, start in the bucket's shard)
        self.pieces: list[tuple[nn.Parameter, int, int, int]] = []
        self.original: dict[nn.Parameter, nn.Parameter] = {}
        pieces_of: dict[nn.Parameter, list[nn.Parameter]] = {}
        rank = sync.rank
        with torch.no_grad():
            for b_idx, bucket in enumerate(sync.buckets):
                flat = torch.zeros(bucket.padded, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
                size = bucket.padded // sync.world
                lo, hi = rank * size, (rank + 1) * size
                for i, (p, o) in enumerate(zip(bucket.params, bucket.offsets)):
                    flat[o : o + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[o : o + p.numel()].view_as(p)
                    a, b = max(o, lo), min(o + p.numel(), hi)
                    if a < b:
                        piece = nn.Parameter(flat[a:b])  # shares storage with flat
                        for attr in ("tp_shard", "sequence_parallel"):
                            if hasattr(p, attr):
                                setattr(piece, attr, getattr(p, attr))
                        self.pieces.append((piece, b_idx, i, a - lo))
                        self.original[piece] = p
                        pieces_of.setdefault(p, []).append(piece)
                self.flat.append(flat)
        # the pieces as a module, for code that walks a module's parameters (sequence-parallel sync)
        self.holder = nn.Module()
        self.holder.pieces = nn.ParameterList([piece for piece, *_ in self.pieces])
        for optimizer in optimizers:
            if optimizer.state:
                raise RuntimeError("ZeRO-1 must shard an optimizer before its first step")
            for group in optimizer.param_groups:
                group["params"] = [q for p in group["params"] for q in pieces_of.get(p, [] if p in sync._where else [p])]

    def attach_grads(self) -> None:
        """Give every piece its averaged gradient slice (``None`` where no replica had a gradient)."""
        used = [bucket.flags.tolist() for bucket in self.sync.buckets]  # one device read per bucket
        for piece, b_idx, i, start in self.pieces:
            shard = self.sync.buckets[b_idx].shard
            piece.grad = shard[start : start + piece.numel()] if used[b_idx][i] > 0 else None

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather every bucket's updated slices into the full flat parameters."""
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        size_of = lambda flat: flat.numel() // self.sync.world  # noqa: E731
        for flat in self.flat:
            n = size_of(flat)
            local = flat[self.sync.rank * n : (self.sync.rank + 1) * n].clone()
            gather(flat, local, group=self.sync.group)
