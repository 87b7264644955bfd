"""Cross entropy over logits whose vocabulary is split across TP ranks, without gathering them.

Megatron-LM's ``_VocabParallelCrossEntropy`` (Shoeybi et al. 2019, §3): every rank holds
``(tokens, vocab / tp)`` logits. A MAX all-reduce of the per-token maximum gives a common shift
for numerical stability; one SUM all-reduce then combines the target logit (only the rank owning
the target contributes) and the sum of exponentials. Per token, 3 scalars cross the wire instead
of ``vocab`` logits. The backward, ``softmax - onehot(target)``, is purely local.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, ignore_index):
        # logits: (n, v_local); target: (n,) global ids
        logits = logits.float()
        shift = logits.max(dim=-1).values
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - shift.unsqueeze(-1)
        columns = vocab_start + torch.arange(logits.shape[-1], device=logits.device)
        if vocab_size is not None:  # padded vocabulary: the padding columns are not classes
            shifted = shifted.masked_fill(columns >= vocab_size, float("-inf"))
        not_mine = (target < vocab_start) | (target >= vocab_start + logits.shape[-1])
        local_target = (target - vocab_start).masked_fill(not_mine, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_mine, 0.0)
        exp = shifted.exp()
        sums = torch.stack([target_logit, exp.sum(dim=-1)])  # (2, n): one all-reduce for both
        dist.all_reduce(sums, group=group)
        target_logit, sum_exp = sums
        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, not_mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, not_mine, ignored = ctx.saved_tensors
        grad = softmax.clone()  # d loss / d logits = softmax - onehot(target)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~not_mine).to(grad.dtype)
        grad *= grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    mesh,
    ignore_index: int = -100,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Mean cross entropy of ``target`` under logits split along the last dim across TP ranks.

    Equals ``F.cross_entropy(full_logits.view(-1, V), target.view(-1), ignore_index=...)``.
    ``vocab_size`` is the unpadded vocabulary when the local logits include padding columns.
    """
    v_local = local_logits.shape[-1]
    losses = _VocabParallelCrossEntropy.apply(
        local_logits.reshape(-1, v_local),
        target.reshape(-1),
        mesh.tp_group,
        mesh.tp_rank * v_local,
        vocab_size,
        ignore_index,
    )
    counted = (target.reshape(-1) != ignore_index).sum()
    return (losses.sum() / counted).to(local_logits.dtype)
