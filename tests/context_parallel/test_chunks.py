"""The pure arithmetic of context parallelism: which tokens each rank holds and which attention blocks
it computes (no processes)."""

import pytest
import torch

from lightning_parallel.context_parallel.chunks import (
    SequenceLengthError,
    block_mask,
    check_length,
    chunks_of,
    local_positions,
    ring_block,
    shard,
    sizes_for,
    unshard,
)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_rank_i_holds_chunks_i_and_2n_minus_1_minus_i_and_unshard_inverts_shard(cp):
    length = 8 * cp
    x = torch.arange(length).view(1, length, 1).expand(2, length, 3)
    shards = [shard(x, 1, cp, r) for r in range(cp)]
    size = length // (2 * cp)
    for r, s in enumerate(shards):
        first, second = chunks_of(r, cp)
        assert (first, second) == (r, 2 * cp - 1 - r)
        assert s[0, :, 0].tolist() == list(range(first * size, (first + 1) * size)) + list(
            range(second * size, (second + 1) * size))
        assert torch.equal(local_positions(length, cp, r), s[0, :, 0])
    assert torch.equal(unshard(shards, 1), x)
    # every position is held by exactly one rank
    assert sorted(torch.cat([local_positions(length, cp, r) for r in range(cp)]).tolist()) == list(range(length))


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_ring_blocks_cover_the_causal_mask_exactly_once_with_equal_work_per_rank_and_step(cp):
    length = 4 * cp
    covered = torch.zeros(length, length, dtype=torch.int64)
    for rank in range(cp):
        work = []
        for step in range(cp):
            m = block_mask(rank, step, cp, length)
            covered += m.long()
            work.append(int(m.sum()))
        # every step after the first is a half block of the same size on every rank
        assert len(set(work[1:])) <= 1
        if cp > 1:
            assert work[1] == (length // cp) ** 2 // 2
    assert torch.equal(covered, torch.ones(length, length, dtype=torch.int64).tril())
    totals = {sum(int(block_mask(r, s, cp, length).sum()) for s in range(cp)) for r in range(cp)}
    assert len(totals) == 1  # balanced: every rank computes the same number of (query, key) pairs


def test_contiguous_parts_would_not_balance_causal_attention():
    # the reason for the zigzag layout: with N contiguous parts the last rank has 2N - 1 times the first's work
    cp, length = 4, 64
    part = length // cp
    causal = torch.ones(length, length).tril()
    work = [int(causal[r * part:(r + 1) * part].sum()) for r in range(cp)]
    assert work[-1] > 6 * work[0]


def test_non_causal_blocks_cover_the_whole_matrix():
    cp, length = 3, 12
    covered = sum(block_mask(r, s, cp, length, causal=False).long() for r in range(cp) for s in range(cp))
    assert torch.equal(covered, torch.ones(length, length, dtype=torch.int64))


def test_step_zero_is_the_causal_mask_on_the_local_order_then_halves():
    assert ring_block(1, 0, 4).causal and ring_block(1, 0, 4).queries == "all"
    assert (ring_block(2, 1, 4).queries, ring_block(2, 1, 4).keys) == ("all", "first")  # from rank 1 < 2
    assert (ring_block(1, 2, 4).queries, ring_block(1, 2, 4).keys) == ("second", "all")  # from rank 3 > 1


def test_a_length_that_does_not_divide_into_2n_chunks_is_refused_with_the_lengths_and_sizes_that_fit():
    check_length(16, 4)
    with pytest.raises(SequenceLengthError, match=r"2 x 2 = 4 equal chunks.*length is 30.*28 or 32"):
        check_length(30, 2)
    with pytest.raises(SequenceLengthError, match="context_parallel size that divides 30 into an even number of "
                                                  "chunks: 3, 5, 15"):
        check_length(30, 2)
    assert sizes_for(24, largest=8) == [2, 3, 4, 6]
