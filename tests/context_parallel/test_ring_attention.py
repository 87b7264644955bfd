"""Ring attention over N gloo ranks equals one device's ``scaled_dot_product_attention``, forward and
backward, for causal and bidirectional attention and grouped key/value heads, and with masks of
padding (right, left: rows with no key) and packed documents.

Tolerance: float32. Each rank merges its blocks by their log-sum-exp instead of one softmax over
all keys, which reorders sums (~1e-7 relative); gradients add the blocks' shares in ring order.
1e-5 is a hundred times that and a thousand times below any missing block's effect.
"""

import pytest
import torch
import torch.nn.functional as F

from lightning_parallel.context_parallel.chunks import shard
from lightning_parallel.context_parallel.comm import Ring
from lightning_parallel.context_parallel.kernels import (
    block_attention,
    block_attention_backward,
)
from lightning_parallel.context_parallel.masks import token_ids
from lightning_parallel.context_parallel.ring import ring_attention
from tests.helpers.processes import make_mesh, run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(heads=4, kv_heads=4, length=24, dim=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, length, dim, generator=g)
    k, v = (torch.randn(2, kv_heads, length, dim, generator=g) for _ in range(2))
    grad = torch.randn(2, heads, length, dim, generator=g)
    return q, k, v, grad


def _reference(causal, kv_heads):
    q, k, v, grad = _inputs(kv_heads=kv_heads)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != q.shape[1])
    return out, torch.autograd.grad(out, (q, k, v), grad)


def _worker(rank, world, causal, kv_heads, fused):
    mesh = make_mesh(rank, world, cp=world)
    ring = Ring(mesh.cp_group)
    q, k, v, grad = (shard(t, 2, world, mesh.cp_rank) for t in _inputs(kv_heads=kv_heads))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, causal, None, ring, fused)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), [g.detach() for g in grads]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,causal,kv_heads,fused", [
    (2, True, 4, None), (4, True, 2, None), (3, False, 4, None), (2, True, 2, False),
])
def test_ring_attention_matches_one_device_forward_and_backward(world, causal, kv_heads, fused):
    expected_out, expected_grads = _reference(causal, kv_heads)
    for rank, (out, grads) in enumerate(run_distributed(_worker, world, causal, kv_heads, fused)):
        torch.testing.assert_close(out, shard(expected_out.detach(), 2, world, rank), **TOL)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, shard(want, 2, world, rank), **TOL)


@pytest.mark.parametrize("causal", [True, False])
def test_float32_formulas_match_the_fused_cpu_kernel(causal):
    q, k, v, grad = _inputs(kv_heads=2)
    fused_out, fused_lse = block_attention(q, k, v, causal, 0.3, fused=True)
    out, lse = block_attention(q, k, v, causal, 0.3, fused=False)
    torch.testing.assert_close(out, fused_out, **TOL)
    torch.testing.assert_close(lse, fused_lse, **TOL)
    for got, want in zip(block_attention_backward(grad, q, k, v, out, lse, causal, 0.3, fused=False),
                         block_attention_backward(grad, q, k, v, fused_out, fused_lse, causal, 0.3, fused=True)):
        torch.testing.assert_close(got, want, **TOL)


def _mask(kind: str, length: int = 24) -> torch.Tensor:
    """A boolean (batch, 1, length, length) mask as Hugging Face builds it for sdpa (True attends)."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    real = torch.ones(2, length, dtype=torch.bool)
    if kind in ("right", "bidirectional"):
        real[0, -7:] = False  # the padding reaches into the second-to-last chunk at CP4
    if kind == "left":
        real[1, :9] = False  # queries 0..8 of sample 1 attend to no key
    mask = real[:, None, None, :].expand(2, 1, length, length)
    if kind == "packed":  # documents of 5, 11 and 8 tokens, as restarting position_ids give
        doc = torch.tensor([0] * 5 + [1] * 11 + [2] * 8)
        mask = mask & (doc[:, None] == doc[None, :])
    return mask if kind == "bidirectional" else mask & causal


def _masked_worker(rank, world, kind, fused):
    mesh = make_mesh(rank, world, cp=world)
    q, k, v, grad = (shard(t, 2, world, mesh.cp_rank) for t in _inputs(kv_heads=2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ids = token_ids(_mask(kind), q.shape[2] * world)
    out = ring_attention(q, k, v, ids.causal, None, Ring(mesh.cp_group), fused, ids)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), [g.detach() for g in grads]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,kind,fused", [
    (2, "right", None), (4, "left", None), (4, "packed", None), (2, "bidirectional", None), (2, "left", False),
])
def test_masked_ring_attention_matches_one_device_forward_and_backward(world, kind, fused):
    # one device: sdpa with the boolean mask; a row with no key gives 0 and no gradient, without NaN
    q, k, v, grad = _inputs(kv_heads=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    expected_out = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(kind), enable_gqa=True)
    expected_grads = torch.autograd.grad(expected_out, (q, k, v), grad)
    for rank, (out, grads) in enumerate(run_distributed(_masked_worker, world, kind, fused)):
        assert not out.isnan().any()
        torch.testing.assert_close(out, shard(expected_out.detach(), 2, world, rank), **TOL)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, shard(want, 2, world, rank), **TOL)
