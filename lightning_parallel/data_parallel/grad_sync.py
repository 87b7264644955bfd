"""Bucketed gradient all-reduce that overlaps with backward.

Each bucket is one flat buffer; a parameter's ``.grad`` becomes a view into it, so one collective on
the buffer reduces all of the bucket's gradients at once. A post-accumulate-grad hook marks a
parameter ready; when every parameter of a bucket is ready, and every earlier bucket has been
launched, the bucket's asynchronous collective starts while backward continues on earlier layers
(Li et al., "PyTorch Distributed", VLDB 2020). Launching strictly in bucket order keeps the sequence
of collectives the same on every rank even when ranks see different sets of used parameters.

Gradient accumulation: inside ``no_sync()`` backward only accumulates into the bucket views. Only the
backward that communicates marks parameters ready, so a bucket holding a parameter that this last
micro-batch did not use is launched by ``finish()`` instead of during backward. A parameter
contributes what it accumulated over the whole window, whichever micro-batches produced it; only a
parameter with no gradient at all (``.grad is None``) contributes zeros.

Each bucket also carries one flag per parameter: 1 when this rank holds a gradient for it. After
the sum over ranks the flag says whether *any* replica produced one in the window; a parameter that
no replica touched keeps ``grad=None``, exactly as on one device, so optimizers skip it. The flags of
all buckets are read to the host once per step, together, in ``finish()``: the only device->host
synchronisation of the synchroniser.

Under pipeline parallelism every micro-batch's backward runs inside ``no_sync()``; ``syncing()``
re-enables the hooks around the backward that produces a stage's final gradients (the last one of
the step for that stage), so the stage's buckets are reduced while the other stages finish their
cool-down, as Megatron-LM overlaps the gradient reduction with the pipeline flush (Narayanan et al.
2021, arXiv 2104.04473 §4.2). ``deferred`` parameters (weights tied across stages, summed over
the stages before they are averaged) are never marked ready by a hook; they are laid out in the
buckets launched last, so they hold back no other bucket, and ``finish()`` launches those.

With ``shard=True`` (ZeRO stage 1, Rajbhandari et al. 2020, arXiv 1910.02054) a bucket is
reduce-scattered instead: each rank receives the averaged gradient of its own ``1/dp`` slice only,
which is all its optimizer shard needs (see ``zero.py``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import ContextManager, Iterator, Optional

import torch
import torch.distributed as dist

from lightning_parallel.data_parallel.buckets import assign_buckets


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], offsets: list[int], numel: int, world: int, dtype, device):
        self.params = params
        self.offsets = offsets
        self.numel = numel
        self.padded = -(-numel // world) * world  # reduce-scatter needs equal slices
        # gradient elements (padded), then one "used" flag per parameter
        self.buffer = torch.zeros(self.padded + len(params), dtype=dtype, device=device)
        self.grads = self.buffer[: self.padded]
        self.flags = self.buffer[self.padded :]
        self.views = [self.buffer[o : o + p.numel()].view_as(p) for p, o in zip(params, offsets)]
        self.shard: Optional[torch.Tensor] = None  # this rank's reduced slice, when sharded
        self.pending = len(params)
        self.ready = [False] * len(params)  # got its gradient in the backward that communicates
        self.used = [False] * len(params)  # some replica had a gradient in the last window (finish)
        self.works: list[dist.Work] = []

    def reset(self) -> None:
        self.pending = len(self.params)
        self.ready = [False] * len(self.params)
        self.works = []


class GradientSynchronizer:
    """Average gradients over a data-parallel group with overlapped, bucketed collectives.

    Args:
        params: the parameters to synchronise (those with ``requires_grad``).
        group: the data-parallel process group.
        bucket_size_mb: bucket capacity in MiB of gradient data.
        shard: reduce-scatter (ZeRO-1) instead of all-reduce; ``bucket.shard`` then holds this
            rank's averaged slice and the parameters' own ``.grad`` are released.
        average_over: divide the sum over ``group`` by this many ranks instead of the group's size (the
            experts of expert parallelism: their gradients already sum several ranks' tokens).

    Use: backward as usual (hooks launch buckets as they fill), then ``finish()`` before the
    optimizer step. Inside ``no_sync()`` backward only accumulates, as for gradient accumulation.
    ``deferred``: parameters whose gradient changes after their last backward (see the module docstring).
    """

    def __init__(self, params: list[torch.nn.Parameter], group, bucket_size_mb: float = 25.0, shard: bool = False,
                 deferred: list[torch.nn.Parameter] = (), average_over: Optional[int] = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.divisor = average_over or self.world
        self.rank = dist.get_rank(group)
        self.shard = shard
        self.enabled = True
        self._deferred = {id(p) for p in deferred}
        self.buckets: list[_Bucket] = []
        self._where: dict[torch.nn.Parameter, tuple[_Bucket, int]] = {}
        self._next = 0  # first bucket not yet launched
        params = [p for p in params if p.requires_grad]
        # buckets are filled from the end of the list: deferred parameters first puts them in the last buckets
        params = [p for p in params if id(p) in self._deferred] + [p for p in params if id(p) not in self._deferred]
        if not params:
            self._hooks = []
            return
        slots, sizes = assign_buckets(params, max(1, int(bucket_size_mb * 2**20 / params[0].element_size())))
        members: list[list[tuple[int, torch.nn.Parameter]]] = [[] for _ in sizes]
        for p, s in zip(params, slots):
            members[s.bucket].append((s.offset, p))
        for size, m in zip(sizes, members):
            m.sort(key=lambda t: t[0])
            b = _Bucket([p for _, p in m], [o for o, _ in m], size, self.world, m[0][1].dtype, m[0][1].device)
            if shard:
                b.shard = torch.zeros(b.padded // self.world, dtype=b.buffer.dtype, device=b.buffer.device)
            self.buckets.append(b)
            for i, p in enumerate(b.params):
                self._where[p] = (b, i)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    # ---- backward-time ------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket, i = self._where[param]
        self._adopt(bucket, i)
        if self.enabled and id(param) not in self._deferred:
            self._mark_ready(bucket, i)
            self._launch_ready()

    @staticmethod
    def _adopt(bucket: _Bucket, i: int) -> None:
        """Move a fresh gradient into its bucket, so accumulation happens there, in place."""
        param, view = bucket.params[i], bucket.views[i]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    @staticmethod
    def _mark_ready(bucket: _Bucket, i: int) -> None:
        if not bucket.ready[i]:
            bucket.ready[i] = True
            bucket.pending -= 1

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        # flags are written on the device (no host read); a parameter not ready may still hold what
        # earlier micro-batches of the window accumulated: only one without any gradient sends zeros
        bucket.flags.fill_(1)
        for i, done in enumerate(bucket.ready):
            if not done:
                self._adopt(bucket, i)
                if bucket.params[i].grad is None:
                    bucket.views[i].zero_()
                    bucket.flags[i] = 0
        if self.shard:
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            bucket.works = [
                reduce_scatter(bucket.shard, bucket.grads, group=self.group, async_op=True),
                dist.all_reduce(bucket.flags, group=self.group, async_op=True),
            ]
        else:
            bucket.works = [dist.all_reduce(bucket.buffer, group=self.group, async_op=True)]
        self._next += 1

    # ---- step-time ----------------------------------------------------------------------------
    def no_sync(self) -> ContextManager[None]:
        """Accumulate gradients locally; the backward after this block communicates."""
        return self._hooks_launch(False)

    def syncing(self) -> ContextManager[None]:
        """Inside ``no_sync()``: let this backward mark its parameters ready and launch full buckets."""
        return self._hooks_launch(True)

    @contextmanager
    def _hooks_launch(self, enabled: bool) -> Iterator[None]:
        previous, self.enabled = self.enabled, enabled
        try:
            yield
        finally:
            self.enabled = previous

    def finish(self) -> None:
        """Launch what backward did not, wait for every bucket, and average the gradients.

        Reads the summed flags of all buckets with one device->host copy; afterwards
        ``bucket.used[i]`` says whether any replica had a gradient for the bucket's i-th parameter.
        """
        if not self.buckets:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            for work in bucket.works:
                work.wait()
            if self.shard:
                bucket.shard.div_(self.divisor)
            else:
                bucket.grads.div_(self.divisor)
        flags = torch.cat([bucket.flags for bucket in self.buckets]).tolist()  # the step's one host read
        start = 0
        for bucket in self.buckets:
            bucket.used = [f > 0 for f in flags[start : start + len(bucket.params)]]
            start += len(bucket.params)
            for p, view, used in zip(bucket.params, bucket.views, bucket.used):
                p.grad = view if used and not self.shard else None
            bucket.reset()
        self._next = 0

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
