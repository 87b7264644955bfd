"""The per-token ids of padding and packed-document masks rebuild them exactly; other masks get none
and are named for the refusal (pure logic, ``context_parallel.masks``)."""

import pytest
import torch

from lightning_parallel.context_parallel.masks import NO_KEY, PADDING, block_mask, token_ids, what_it_is

S = 8
CAUSAL = torch.ones(S, S, dtype=torch.bool).tril()


def _padding(real: torch.Tensor, causal: bool = True) -> torch.Tensor:
    mask = real.bool()[:, None, None, :].expand(-1, 1, S, S)
    return mask & CAUSAL if causal else mask


def test_right_and_left_padding_rebuild_exactly():
    real = torch.ones(2, S)
    real[0, -3:] = 0
    real[1, :3] = 0
    mask = _padding(real)
    ids = token_ids(mask, S)
    assert ids.causal and torch.equal(block_mask(ids.query, ids.key, True), mask[:, 0])
    assert ids.key[0].tolist() == [0] * 5 + [PADDING] * 3  # right padding: keys no query attends to
    assert ids.query[1].tolist() == [NO_KEY] * 3 + [3] * 5  # left padding: queries that attend to no key


def test_packed_documents_and_bidirectional_padding_rebuild_exactly():
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    packed = (doc[:, None] == doc[None, :]) & CAUSAL
    ids = token_ids(packed, S)
    assert ids.query.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5]] and torch.equal(block_mask(ids.query, ids.key, True),
                                                                            packed[None])
    real = torch.ones(1, S)
    real[0, -2:] = 0
    encoder = _padding(real, causal=False)
    ids = token_ids(encoder, S)
    assert not ids.causal and torch.equal(block_mask(ids.query, ids.key, False), encoder[:, 0])


def test_additive_masks_of_minus_infinity_or_the_dtype_minimum_are_read_as_boolean():
    real = torch.ones(2, S)
    real[1, :3] = 0
    mask = _padding(real)
    for blocked in (float("-inf"), torch.finfo(torch.float32).min):
        additive = torch.zeros(mask.shape).masked_fill(~mask, blocked)
        ids = token_ids(additive, S)
        assert torch.equal(block_mask(ids.query, ids.key, True), mask[:, 0])


@pytest.mark.parametrize("kind,words", [
    ("sliding_window", "neither causal nor bidirectional attention within documents with padding"),
    ("prefix_lm", "neither causal nor bidirectional attention within documents with padding"),
    ("per_head", "that differs between heads"),
    ("bias", "with values other than 0 and -inf: a bias on the scores"),
    ("cut", "not one over the 8-token sequence's queries and keys"),
])
def test_masks_without_per_token_meaning_get_no_ids_and_are_named(kind, words):
    mask = {
        "sliding_window": CAUSAL & ~torch.ones(S, S, dtype=torch.bool).tril(-3),
        "prefix_lm": CAUSAL | (torch.arange(S)[None, :] < 3),
        "per_head": torch.stack([CAUSAL, CAUSAL & (torch.arange(S) > 0)])[None],
        "bias": torch.zeros(S, S).masked_fill(~CAUSAL, float("-inf")) - torch.arange(S).float(),
        "cut": CAUSAL[:, : S // 2],
    }[kind]
    assert token_ids(mask, S) is None
    assert words in what_it_is(mask, S)
