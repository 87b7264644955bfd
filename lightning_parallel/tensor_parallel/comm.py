"""The autograd collectives that tensor parallelism is built from.

Each is a forward collective paired with its conjugate in backward (Shoeybi et al. 2019,
"Megatron-LM", arXiv 1909.08053, §3, the ``f`` and ``g`` operators), plus the sequence-parallel
pair of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", arXiv 2205.05198, §4.2.2) that replaces one all-reduce by an all-gather and a
reduce-scatter of the same volume.

Activations of the unchanged models we shard are batch first, ``(batch, seq, hidden)`` or
``(seq, hidden)``, so the sequence dimension is ``SEQ_DIM = -2`` (Megatron's ``[s, b, h]`` uses 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQ_DIM = -2

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have only the old names.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    size = dist.get_world_size(group)
    dim = dim % x.dim()
    # gather into a leading rank dimension, then move it next to ``dim``: (r, ..., d, ...) -> (..., r*d, ...)
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_into(out, x, group=group)
    return out.view(size, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice of ``dim``."""
    size = dist.get_world_size(group)
    dim = dim % x.dim()
    if x.shape[dim] % size:
        raise ValueError(
            f"sequence parallelism splits the sequence over {size} TP ranks, but it has length {x.shape[dim]}; "
            f"use a sequence length that is a multiple of {size}"
        )
    # (..., r*d, ...) -> (r, ..., d, ...) so each rank's slice is contiguous
    chunks = x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_into(out, chunks.flatten(0, 1), group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"cannot split dimension {dim} of length {x.shape[dim]} evenly over {size} TP ranks; "
            f"it must be a multiple of {size}"
        )
    return x.chunk(size, dim=dim)[rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    """``f``: identity forward, all-reduce of the gradient backward (entry of a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward (exit of a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along ``dim`` forward, keep own slice backward (``gather_output`` of a column layer)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep own slice along ``dim`` forward, all-gather backward (input replicated on every rank)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Sequence parallel ``g-bar``: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Sequence parallel ``g``: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _SumOverCopies(torch.autograd.Function):
    """Identity forward; backward, the gradient summed over the ranks that hold the same copy.

    The TP group's ranks ``[k * copies, (k + 1) * copies)`` hold copy ``k`` (a KV head shared by
    their query heads, ``kv_heads.py``); each computes the gradient of its own query heads only, so
    the copy's full gradient is their sum. One all-reduce over the whole TP group of a buffer with
    one slot per copy, each rank writing its slot, sums every group of copies at once without a
    process group per copy (adding exact zeros leaves each sum unchanged), and gives every member
    of a group the same bits, so the copies stay identical.
    """

    @staticmethod
    def forward(ctx, x, group, copies):
        ctx.group, ctx.copies = group, copies
        return x

    @staticmethod
    def backward(ctx, grad):
        slots = dist.get_world_size(ctx.group) // ctx.copies
        mine = dist.get_rank(ctx.group) // ctx.copies
        buffer = torch.zeros((slots, *grad.shape), dtype=grad.dtype, device=grad.device)
        buffer[mine] = grad
        dist.all_reduce(buffer, group=ctx.group)
        return buffer[mine], None, None


def sum_over_copies(x: torch.Tensor, group, copies: int) -> torch.Tensor:
    return _SumOverCopies.apply(x, group, copies) if copies > 1 else x


def copy_to_region(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    return _GatherFromRegion.apply(x, dim, group)


def scatter_to_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    return _ScatterToRegion.apply(x, dim, group)


def gather_from_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceScatterToSequenceRegion.apply(x, group)
