"""Pure bucketing: which parameters share a flat gradient buffer, and where each one sits in it.

Parameters are taken in *reverse* registration order, which is roughly the order backward produces
their gradients (the last layer's gradients are ready first). Consecutive parameters are packed into
a bucket until it holds ``bucket_size`` elements, as in PyTorch DDP (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, §3.2.3); a bucket can
then be all-reduced while backward is still computing the gradients of earlier layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BucketSlot:
    """One parameter's place: bucket index, element offset and element count."""

    bucket: int
    offset: int
    numel: int


def assign_buckets(params: list[torch.nn.Parameter], bucket_size: int) -> tuple[list[BucketSlot], list[int]]:
    """Lay ``params`` out in reverse order into buckets of at most ``bucket_size`` elements.

    A parameter larger than ``bucket_size`` gets a bucket of its own. Parameters of different dtypes
    never share a bucket. Returns the slot of each parameter (in the order of ``params``) and the
    element count of each bucket.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be at least 1 element, got {bucket_size}")
    slots: list[BucketSlot | None] = [None] * len(params)
    sizes: list[int] = []
    dtype = None
    for i in reversed(range(len(params))):
        p = params[i]
        n = p.numel()
        if not sizes or p.dtype != dtype or (sizes[-1] > 0 and sizes[-1] + n > bucket_size):
            sizes.append(0)
            dtype = p.dtype
        slots[i] = BucketSlot(len(sizes) - 1, sizes[-1], n)
        sizes[-1] += n
    return [s for s in slots if s is not None], sizes
