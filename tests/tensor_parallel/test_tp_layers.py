"""Layer-level promises of tensor parallelism: each sharded layer computes what the unsharded
PyTorch layer computes, forward and backward, on 2 gloo processes.

Tolerance: float32 on CPU; sharding changes only the order of the sums inside matmuls and the
all-reduce, so results agree to a few ulps: rtol 1e-5, atol 1e-6 (outputs are O(1)).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_parallel.models.gpt import GPT, Block
from lightning_parallel.tensor_parallel import (
    TPRandom,
    TPShard,
    comm,
    gather_full_tensor,
    parallelize,
    shard_tensor,
    vocab_parallel_cross_entropy,
)
from lightning_parallel.tensor_parallel.shard import merge_shards, slice_shard
from tests.helpers.processes import make_mesh, run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)


def _check_grads(full: nn.Module, tp: nn.Module, mesh) -> None:
    """Every TP parameter's grad equals the matching slice of the full model's grad."""
    full_params = dict(full.named_parameters())
    for name, p in tp.named_parameters():
        expected = full_params[name].grad
        if hasattr(p, "tp_shard"):
            expected = shard_tensor(expected, p.tp_shard, mesh)
        torch.testing.assert_close(p.grad, expected, **TOL, msg=name)


def test_shards_merge_back_to_the_full_tensor():
    full = torch.arange(7 * 3 * 4.0).view(21, 4)
    for shard, tp in [
        (TPShard(0), 3),
        (TPShard(1, full_size=4), 3),
        (TPShard(0, fused=3), 7),
        (TPShard(0, full_size=21), 4),
    ]:
        parts = [slice_shard(full, shard, r, tp) for r in range(tp)]
        assert len({p.shape for p in parts}) == 1
        torch.testing.assert_close(merge_shards(parts, shard), full)
    q, k, v = full.chunk(3)
    fused = slice_shard(full, TPShard(0, fused=3), 0, 7)  # rank 0 keeps row 0 of each of q, k, v
    torch.testing.assert_close(fused, torch.stack([q[0], k[0], v[0]]))


def _mlp_worker(rank, world, gather):
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
    if gather:
        full = nn.Sequential(nn.Linear(8, 9))
    tp = copy.deepcopy(full)
    mesh = make_mesh(rank, world, tp=world)
    plan = {"0": {"style": "colwise", "gather_output": True}} if gather else {"0": "colwise", "2": "rowwise"}
    parallelize(tp, mesh, plan)
    x = torch.randn(2, 5, 8)
    x_tp = x.clone().requires_grad_()
    x.requires_grad_()
    torch.testing.assert_close(tp(x_tp), full(x), **TOL)
    full(x).square().sum().backward()
    tp(x_tp).square().sum().backward()
    torch.testing.assert_close(x_tp.grad, x.grad, **TOL)
    _check_grads(full, tp, mesh)
    for name, p in tp.named_parameters():
        if hasattr(p, "tp_shard"):
            torch.testing.assert_close(gather_full_tensor(p, p.tp_shard, mesh), dict(full.named_parameters())[name])
    return True


@pytest.mark.timeout(30)
def test_column_then_row_parallel_linear_match_nn_linear():
    run_distributed(_mlp_worker, 2, False)


@pytest.mark.timeout(30)
def test_column_parallel_linear_gathers_an_output_size_not_divisible_by_tp():
    run_distributed(_mlp_worker, 2, True)


def _embedding_worker(rank, world):
    torch.manual_seed(0)
    full = nn.Sequential(nn.Embedding(11, 6, padding_idx=7))  # 11 rows: padded to 12 on 2 ranks
    tp = copy.deepcopy(full)
    mesh = make_mesh(rank, world, tp=world)
    parallelize(tp, mesh, {"0": "vocab"})
    assert tp[0].weight.shape == (6, 6) and tp[0].weight.tp_shard.full_size == 11
    ids = torch.tensor([[0, 5, 6, 10, 7], [7, 3, 9, 1, 2]])
    torch.testing.assert_close(tp(ids), full(ids), **TOL)
    full(ids).pow(3).sum().backward()
    tp(ids).pow(3).sum().backward()
    _check_grads(full, tp, mesh)
    return True


@pytest.mark.timeout(30)
def test_vocab_parallel_embedding_matches_nn_embedding_with_padding():
    run_distributed(_embedding_worker, 2)


def _cross_entropy_worker(rank, world):
    mesh = make_mesh(rank, world, tp=world)
    torch.manual_seed(0)
    vocab = 13  # padded to 14 columns on 2 ranks
    logits = torch.randn(3, 5, vocab) * 4
    target = torch.randint(0, vocab, (3, 5))
    target[0, :2] = -100
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full.view(-1, vocab), target.view(-1))
    expected.backward()
    local = shard_tensor(logits, TPShard(-1, full_size=vocab), mesh).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, mesh, vocab_size=vocab)
    loss.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    torch.testing.assert_close(local.grad, shard_tensor(full.grad, TPShard(-1, full_size=vocab), mesh), **TOL)
    return True


@pytest.mark.timeout(30)
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy():
    run_distributed(_cross_entropy_worker, 2)


def _mha_worker(rank, world, batch_first, need_weights):
    torch.manual_seed(0)
    full = nn.Sequential(nn.MultiheadAttention(8, 4, batch_first=batch_first, bias=True))
    tp = copy.deepcopy(full)
    mesh = make_mesh(rank, world, tp=world)
    parallelize(tp, mesh, {"0": "attention"})
    x = torch.randn(2, 5, 8) if batch_first else torch.randn(5, 2, 8)
    memory = torch.randn(2, 6, 8) if batch_first else torch.randn(6, 2, 8)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    calls = [
        dict(args=(x, x, x), kwargs=dict(attn_mask=causal, need_weights=need_weights)),
        dict(args=(x, memory, memory), kwargs=dict(key_padding_mask=pad, need_weights=need_weights)),
        dict(args=(x, x, x), kwargs=dict(attn_mask=torch.randn(2 * 4, 5, 5), need_weights=need_weights)),  # per head
    ]
    for call in calls:
        full.zero_grad()
        tp.zero_grad()
        y, w = full[0](*call["args"], **call["kwargs"])
        y_tp, w_tp = tp[0](*call["args"], **call["kwargs"])
        torch.testing.assert_close(y_tp, y, **TOL)
        if need_weights:
            torch.testing.assert_close(w_tp, w, **TOL)
        y.sum().backward()
        y_tp.sum().backward()
        _check_grads(full, tp, mesh)
    return True


@pytest.mark.timeout(30)
@pytest.mark.parametrize("batch_first,need_weights", [(True, False), (False, True)])
def test_parallel_multihead_attention_matches_nn_multihead_attention(batch_first, need_weights):
    run_distributed(_mha_worker, 2, batch_first, need_weights)


def _dropout_worker(rank, world):
    mesh = make_mesh(rank, world, tp=world)
    torch.manual_seed(1234)  # the strategy seeds every rank alike
    rng = TPRandom(mesh.tp_rank)
    x = torch.ones(4096)
    with rng.fork():
        sharded = F.dropout(x, 0.5)
    replicated = F.dropout(x, 0.5)  # default stream, advanced by the fork alike on every rank
    torch.manual_seed(1234)  # what activation checkpointing does before it recomputes
    with rng.fork():
        assert torch.equal(F.dropout(x, 0.5), sharded), "a recomputation drew another per-rank mask"
    assert torch.equal(F.dropout(x, 0.5), replicated), "the fork left the default stream elsewhere"
    masks = []
    for mask in (sharded, replicated):
        gathered = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(gathered, mask, group=mesh.tp_group)
        masks.append(torch.equal(gathered[0], gathered[1]))
    return masks


@pytest.mark.timeout(30)
def test_dropout_masks_differ_across_tp_ranks_only_in_sharded_regions():
    same_sharded, same_replicated = run_distributed(_dropout_worker, 2)[0]
    assert not same_sharded and same_replicated


def _dropout_kinds_worker(rank, world, sequence_parallel):
    model = GPT(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32, dropout=0.1)
    parallelize(model, make_mesh(rank, world, tp=world), sequence_parallel=sequence_parallel)
    return type(model.transformer.drop).__name__, type(model.transformer.h[0].mlp.dropout).__name__


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sequence_parallel,kind", [(False, "Dropout"), (True, "ShardedDropout")])
def test_dropout_on_sequence_shards_draws_from_the_per_rank_stream(sequence_parallel, kind):
    assert run_distributed(_dropout_kinds_worker, 2, sequence_parallel)[0] == (kind, kind)


def _count_block_collectives(rank, world, sequence_parallel):
    """(op, elements) of every TP collective of one GPT block, forward then backward."""
    torch.manual_seed(0)
    block = Block(n_embd=16, n_head=4, dropout=0.0)
    mesh = make_mesh(rank, world, tp=world)
    parallelize(block, mesh, {"attn": "attention", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}, sequence_parallel)
    log = []
    all_reduce, gather, reduce_scatter = dist.all_reduce, comm._gather_into, comm._reduce_scatter_into

    def counted_all_reduce(t, *a, **k):
        log.append(("all_reduce", t.numel()))
        return all_reduce(t, *a, **k)

    def counted_gather(out, inp, *a, **k):
        log.append(("all_gather", out.numel()))
        return gather(out, inp, *a, **k)

    def counted_reduce_scatter(out, inp, *a, **k):
        log.append(("reduce_scatter", inp.numel()))
        return reduce_scatter(out, inp, *a, **k)

    dist.all_reduce, comm._gather_into, comm._reduce_scatter_into = (
        counted_all_reduce,
        counted_gather,
        counted_reduce_scatter,
    )
    seq = 8 // world if sequence_parallel else 8
    y = block(torch.randn(2, seq, 16, requires_grad=True))
    forward = list(log)
    y.sum().backward()
    return forward, log[len(forward) :]


@pytest.mark.timeout(30)
def test_one_block_does_megatrons_two_all_reduces_each_way():
    forward, backward = run_distributed(_count_block_collectives, 2, False)[0]
    bsh = 2 * 8 * 16  # batch x seq x hidden
    assert forward == [("all_reduce", bsh)] * 2
    assert backward == [("all_reduce", bsh)] * 2


@pytest.mark.timeout(30)
def test_sequence_parallel_swaps_each_all_reduce_for_gather_and_reduce_scatter_of_the_same_volume():
    forward, backward = run_distributed(_count_block_collectives, 2, True)[0]
    bsh = 2 * 8 * 16
    assert forward == [("all_gather", bsh), ("reduce_scatter", bsh)] * 2
    assert backward == [("all_gather", bsh), ("reduce_scatter", bsh)] * 2
