"""Bucketed gradient all-reduce that overlaps with backward.

Each bucket is one flat buffer; a parameter's ``.grad`` becomes a view into it, so an all-reduce of
the buffer reduces all of the bucket's gradients at once. A post-accumulate-grad hook marks a
parameter ready; when every parameter of a bucket is ready, and every earlier bucket has been
launched, the bucket's asynchronous all-reduce starts while backward continues on earlier layers
(Li et al., VLDB 2020). Launching strictly in bucket order keeps the sequence of collectives the
same on every rank even when ranks see different sets of used parameters.

Each bucket carries one extra element per parameter: 1 when this rank produced a gradient for it.
After the sum-all-reduce that flag says whether *any* replica produced one; a parameter no replica
touched keeps ``grad=None``, exactly as on one device, so optimizers skip it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from lightning_parallel.data_parallel.buckets import assign_buckets


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], offsets: list[int], numel: int, dtype, device):
        self.params = params
        self.offsets = offsets
        # gradient elements, then one "used" flag per parameter
        self.buffer = torch.zeros(numel + len(params), dtype=dtype, device=device)
        self.flags = self.buffer[numel:]
        self.views = [self.buffer[o : o + p.numel()].view_as(p) for p, o in zip(params, offsets)]
        self.pending = len(params)
        self.ready = [False] * len(params)
        self.work: Optional[dist.Work] = None

    def reset(self) -> None:
        self.pending = len(self.params)
        self.ready = [False] * len(self.params)
        self.work = None


class GradientSynchronizer:
    """Average gradients over a data-parallel group with overlapped, bucketed all-reduce.

    Args:
        params: the parameters to synchronise (those with ``requires_grad``).
        group: the data-parallel process group.
        bucket_size_mb: bucket capacity in MiB of gradient data.

    Use: backward as usual (hooks launch buckets as they fill), then ``finish()`` before the
    optimizer step. Inside ``no_sync()`` backward only accumulates, as for gradient accumulation.
    """

    def __init__(self, params: list[torch.nn.Parameter], group, bucket_size_mb: float = 25.0):
        self.group = group
        self.world = dist.get_world_size(group)
        self.enabled = True
        params = [p for p in params if p.requires_grad]
        if not params:
            self.buckets: list[_Bucket] = []
            return
        elem = params[0].element_size()
        slots, sizes = assign_buckets(params, max(1, int(bucket_size_mb * 2**20 / elem)))
        members: list[list[tuple[int, torch.nn.Parameter]]] = [[] for _ in sizes]
        for p, s in zip(params, slots):
            members[s.bucket].append((s.offset, p))
        self.buckets = []
        self._where: dict[torch.nn.Parameter, tuple[_Bucket, int]] = {}
        for size, m in zip(sizes, members):
            m.sort(key=lambda t: t[0])
            b = _Bucket([p for _, p in m], [o for o, _ in m], size, m[0][1].dtype, m[0][1].device)
            self.buckets.append(b)
            for i, p in enumerate(b.params):
                self._where[p] = (b, i)
        self._next = 0  # first bucket not yet launched
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    # ---- backward-time ------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket, i = self._where[param]
        view = bucket.views[i]
        if param.grad is not view:
            # first gradient since zero_grad(set_to_none=True): move it into the bucket so later
            # accumulation happens in place and the all-reduce sees it
            if param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)
            param.grad = view
        if self.enabled:
            self._mark_ready(bucket, i)
            self._launch_ready()

    @staticmethod
    def _mark_ready(bucket: _Bucket, i: int) -> None:
        if not bucket.ready[i]:
            bucket.ready[i] = True
            bucket.flags[i] = 1
            bucket.pending -= 1

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        for i, done in enumerate(bucket.ready):
            if not done:  # no gradient here this step: contribute zeros
                bucket.views[i].zero_()
                bucket.flags[i] = 0
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self._next += 1

    # ---- step-time ----------------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the backward after this block communicates."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def finish(self) -> None:
        """Launch what backward did not, wait for every bucket, and average the gradients."""
        if not self.buckets:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.buffer.div_(self.world)
            for p, view, used in zip(bucket.params, bucket.views, bucket.flags.tolist()):
                p.grad = view if used > 0 else None
            bucket.reset()
        self._next = 0

    def sync_now(self) -> None:
        """Average the gradients the parameters hold now, e.g. after backwards run under ``no_sync``."""
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if p.grad is not None:
                    if p.grad.data_ptr() != bucket.views[i].data_ptr():
                        bucket.views[i].copy_(p.grad)
                        p.grad = bucket.views[i]
                    self._mark_ready(bucket, i)
        self.finish()

    def remove(self) -> None:
        for h in getattr(self, "_hooks", []):
            h.remove()
