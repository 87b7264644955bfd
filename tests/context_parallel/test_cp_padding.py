"""Padded and packed batches under context parallelism: unchanged LightningModules around tiny Hugging
Face causal LMs (Llama, Qwen2, StableLM; sdpa attention) fed what fine-tuning feeds them, a tokenizer's
padded rows (``attention_mask``, right and left padding in one batch, ``labels=-100`` on padding),
packed rows (restarting ``position_ids``, from which the model builds a block-diagonal mask) and a
user's own additive 4D mask of packed documents with a padded tail, train step by step to the losses
and parameters of one device at CP2, CP4, DP2 x CP2 and TP2 x CP2 (``test_cp_training.assert_matches_one_device``).

Tolerance: that of ``test_cp_training`` (losses 1e-5, parameters 1e-4 after AdamW steps of lr 1e-2),
for the same reason: masking only removes (query, key) pairs from sums ring attention already
reorders. A padding key attended, a document boundary crossed or a row left NaN moves the loss by
far more (a NaN fails any comparison).
"""

import lightning as L
import pytest
import torch
from torch.utils.data import TensorDataset

from tests.context_parallel.test_cp_training import SEQ, VOCAB, assert_matches_one_device

PAD = 5  # padding tokens on the left; one fewer on the right, so every row has as many labels once they are
# shifted (the first token predicts nothing): each data-parallel replica then averages over as many as one device
DOCS = ([5, 11], [3, 6, 7], [9, 7], [2, 8, 6], [16], [4, 4, 8], [7, 9], [1, 15])  # packed rows' document lengths


class FineTuneLM(L.LightningModule):
    """A user's module around a tiny Hugging Face causal LM; batches hold the tokens, what ``given`` names
    (``attention_mask``: a tokenizer's 2D mask or a 4D mask; ``position_ids``: restarting at each packed
    document) and the labels (-100 on padding and at document starts). No cache, so that transformers
    builds the block-diagonal mask of packed rows."""

    def __init__(self, family: str, given: str) -> None:
        super().__init__()
        import transformers

        config = getattr(transformers, f"{family}Config")(
            hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=VOCAB, max_position_embeddings=4 * SEQ)
        config._attn_implementation = "sdpa"
        self.model, self.given = transformers.AutoModelForCausalLM.from_config(config), given

    def training_step(self, batch, batch_idx):
        tokens, extra, labels = batch
        return self.model(input_ids=tokens, labels=labels, use_cache=False, **{self.given: extra}).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)


def _tokens(samples: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(1))


def padded(samples: int = 8) -> TensorDataset:
    """Rows with padding on the right (``PAD - 1`` tokens) in even rows and on the left (``PAD``) in odd ones."""
    mask = torch.ones(samples, SEQ, dtype=torch.long)
    mask[0::2, 1 - PAD:] = 0
    mask[1::2, :PAD] = 0
    tokens = _tokens(samples)
    return TensorDataset(tokens, mask, tokens.masked_fill(mask == 0, -100))


def packed(samples: int = 8) -> TensorDataset:
    """Rows of documents packed end to end, ``position_ids`` restarting at each."""
    positions = torch.stack([torch.cat([torch.arange(n) for n in DOCS[i % len(DOCS)]]) for i in range(samples)])
    tokens = _tokens(samples)
    return TensorDataset(tokens, positions, tokens.masked_fill(positions == 0, -100))


def packed_mask(samples: int = 8) -> TensorDataset:
    """Packed documents and a padded tail of ``PAD`` tokens, as an additive (batch, 1, S, S) mask of 0 and the
    dtype's minimum, causal within each document; the tail attends nothing."""
    masks, labels, tokens = [], [], _tokens(samples)
    for i in range(samples):
        doc = torch.cat([torch.full((n,), d) for d, n in enumerate(DOCS[i % len(DOCS)])])
        start = torch.cat([torch.ones(1, dtype=torch.bool), doc[1:] != doc[:-1]])
        doc[-PAD:] = -1  # the tail: in no document
        keep = (doc[:, None] == doc[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril() & (doc >= 0)[:, None]
        masks.append(torch.zeros(1, SEQ, SEQ).masked_fill(~keep, torch.finfo(torch.float32).min))
        labels.append(tokens[i].masked_fill(start | (doc < 0), -100))
    return TensorDataset(tokens, torch.stack(masks), torch.stack(labels))


CASES = {
    "llama_padded": (lambda: FineTuneLM("Llama", "attention_mask"), padded),
    "qwen2_packed": (lambda: FineTuneLM("Qwen2", "position_ids"), packed),
    "qwen2_padded": (lambda: FineTuneLM("Qwen2", "attention_mask"), padded),
    "stablelm_additive_mask": (lambda: FineTuneLM("StableLm", "attention_mask"), packed_mask),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,cp", [("llama_padded", 2), ("qwen2_packed", 4), ("qwen2_padded", 4),
                                     ("stablelm_additive_mask", 2)])
def test_padded_and_packed_batches_match_one_device(tmp_path, case, cp):
    assert_matches_one_device(tmp_path, dp=1, cp=cp, model=CASES[case])


@pytest.mark.timeout(120)
def test_dp2_cp2_padded_batches_match_one_device(tmp_path):
    assert_matches_one_device(tmp_path, dp=2, cp=2, model=CASES["llama_padded"])


@pytest.mark.timeout(120)
def test_tp2_cp2_padded_batches_match_one_device(tmp_path):
    # each rank rings its own heads under the one mask every head shares
    assert_matches_one_device(tmp_path, dp=1, cp=2, tp=2, model=CASES["qwen2_padded"])
