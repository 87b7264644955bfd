"""What context parallelism cannot split is refused with what would work: before the processes start
where the model shows it (eager attention, pipelining), in the first step on every rank, before any
optimizer step, where only running the first batch shows it (a sequence length, a mask with no meaning
under the split,
attention written out by hand)."""

from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.checks.launch import check_layout
from lightning_parallel.context_parallel.attention import is_causal_mask
from lightning_parallel.errors import LaunchError
from lightning_parallel.options import ParallelOptions
from lightning_parallel.strategy import ParallelStrategy
from tests.context_parallel.test_cp_training import VOCAB, LlamaLM
from tests.helpers.refusals import RecordingStrategy, Stepped


def refused_messages(module: L.LightningModule, data: torch.Tensor, out: Path, cp: int = 2) -> list[str]:
    """Fit ``module`` with context_parallel=cp and return what its first step raised on each rank; no optimizer
    may step."""
    strategy = RecordingStrategy(out, context_parallel=cp, start_method="fork", timeout=timedelta(seconds=30))
    trainer = L.Trainer(accelerator="cpu", devices=cp, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Stepped(out)])
    with pytest.raises(Exception):
        trainer.fit(module, DataLoader(TensorDataset(data), batch_size=2))
    assert not list(out.glob("step*")), "an optimizer stepped before the refusal"
    return [(out / f"rank{r}.txt").read_text() for r in range(cp)]


@pytest.mark.timeout(90)
def test_sequence_length_that_does_not_divide_into_2n_chunks_is_refused_in_the_first_step_on_every_rank(tmp_path):
    messages = refused_messages(LlamaLM(), torch.randint(0, VOCAB, (4, 14)), tmp_path)
    assert messages[0] == messages[1]
    assert messages[0].startswith("SequenceLengthError: context_parallel=2 cuts each sequence into 2 x 2 = 4")
    assert "the sequence length is 14. Use sequences of a multiple of 4 tokens (12 or 16)" in messages[0]


class PrefixLM(LlamaLM):
    """A prefix-LM mask of the user's own: the first 4 tokens see each other, the rest attend causally."""

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        mask = torch.ones(16, 16, dtype=torch.bool).tril()
        mask[:4, :4] = True
        return self.model(input_ids=tokens, attention_mask=mask.expand(len(tokens), 1, 16, 16), labels=tokens).loss


@pytest.mark.timeout(90)
def test_mask_without_meaning_under_the_split_is_refused_in_the_first_step_on_every_rank(tmp_path):
    # padding and packed documents are taken (test_cp_padding.py); a prefix-LM mask is not
    messages = refused_messages(PrefixLM(), torch.randint(0, VOCAB, (4, 16)), tmp_path)
    assert messages[0] == messages[1]
    assert messages[0].startswith("AttentionError: an attention mask of shape (2, 1, 16, 16) that is neither causal "
                                  "nor bidirectional attention within documents with padding")
    assert "has no meaning once the 16-token sequence is split over 2 context-parallel ranks" in messages[0]
    assert "or train without context_parallel" in messages[0]


class HandWrittenAttention(nn.Module):
    """Attention computed with matmul and softmax, not scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        scores = (x @ x.transpose(1, 2)).masked_fill(torch.ones(x.shape[1], x.shape[1]).triu(1).bool(), -1e9)
        return x + self.proj(scores.softmax(-1) @ x)


class HandWrittenLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(VOCAB, 8), nn.ModuleList(
            HandWrittenAttention() for _ in range(2)), nn.Linear(8, VOCAB)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(90)
def test_attention_that_does_not_call_sdpa_is_refused_in_the_first_step_on_every_rank(tmp_path):
    messages = refused_messages(HandWrittenLM(), torch.randint(0, VOCAB, (4, 16)), tmp_path)
    assert messages[0] == messages[1]
    assert ("block(s) [0, 1] of blocks ran without calling torch.nn.functional.scaled_dot_product_attention"
            in messages[0])


def test_hugging_face_eager_attention_is_refused_before_the_processes_start():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ParallelStrategy(context_parallel=2,
                        start_method="fork"), max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(LaunchError, match=r"attn_implementation='eager'.*attn_implementation='sdpa'") as info:
        trainer.fit(LlamaLM(attention="eager"), DataLoader(TensorDataset(torch.zeros(4, 16, dtype=torch.long))))
    assert "ParallelStrategy(context_parallel=1)" in str(info.value)


def test_context_with_pipeline_parallelism_is_refused_naming_what_works():
    with pytest.raises(LaunchError, match="context_parallel=2 with pipeline_parallel=2 is not supported") as info:
        check_layout(ParallelOptions(context_parallel=2, pipeline_parallel=2), 1, 4)
    assert "strategy.pipeline_parallel=1" in str(info.value) and "strategy.context_parallel=1" in str(info.value)


def test_layout_product_counts_the_context_parallel_ranks():
    assert check_layout(ParallelOptions(context_parallel=2, tensor_parallel=2), 1, 8).dp_size == 2
    with pytest.raises(LaunchError, match="context_parallel=4 x data_parallel=2 needs 8 processes"):
        check_layout(ParallelOptions(context_parallel=4, data_parallel=2), 1, 4)


def test_causal_masks_are_recognised_and_others_are_not():
    n = 6
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert is_causal_mask(causal, n) and is_causal_mask(causal[None, None].expand(2, 1, n, n), n)
    additive = torch.zeros(n, n).masked_fill(~causal, float("-inf"))
    assert is_causal_mask(additive, n)
    assert is_causal_mask(torch.zeros(n, n).masked_fill(~causal, torch.finfo(torch.float32).min), n)
    padded = causal.clone()
    padded[:, -1] = False
    assert not is_causal_mask(padded, n)
    assert not is_causal_mask(additive + torch.arange(n).float(), n)  # a bias (ALiBi-like), not a mask
    assert not is_causal_mask(causal[:, : n // 2], n)  # cut to local keys
