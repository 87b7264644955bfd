"""The collectives of expert parallelism: the token counts exchanged, then the tokens all-to-all.

A token goes to the rank holding its expert and comes back (GShard, Lepikhin et al. 2020,
arXiv 2006.16668 §2.2: *dispatch* and *combine*). The number of tokens each rank sends to each other
one depends on the routing, so the counts are exchanged first (one small all-to-all) and read to the
host once per MoE layer, as Megatron-LM's token dispatcher does; the tokens then travel in one
``all_to_all_single`` with those split sizes.

``all_to_all`` is differentiable: its backward is the all-to-all of the gradients with the split sizes
swapped (what was sent to rank r comes back from rank r).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Rows ``x[sum(send[:r]) : sum(send[:r+1])]`` go to rank ``r`` of ``group``; the result holds the rows
    received, ``recv[r]`` from rank ``r``, in rank order. Differentiable in ``x``."""
    return _AllToAll.apply(x, list(send), list(recv), group)


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """``counts`` of shape ``(ep, local_experts)``: row r, the tokens this rank sends to each expert of rank
    r. Returns the same shape: row r, the tokens rank r sends to each of this rank's experts."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
