"""Context parallelism through Lightning: unchanged LightningModules (around a Hugging Face Llama, the
embedded nanoGPT-style GPT with its tied head, Lightning's demo encoder-decoder Transformer) train,
step by step, to the losses and parameters of one device, at CP2, DP2 x CP2 and TP2 x CP2.

Tolerance: float32 on CPU. Ring attention merges key blocks by their log-sum-exp and the gradients
of the split blocks are summed over the CP ranks, which reorders sums (~1e-7 relative per op);
losses are compared at 1e-5 and parameters at 1e-4 after AdamW steps of lr 1e-2 (every element moves
by about lr per step, so a missing block of attention or a gradient off by the CP factor is off by
~1e-2, a hundred times the tolerance).
"""

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import TensorDataset

from lightning_parallel.models.gpt import GPT
from lightning_parallel.strategy import ParallelStrategy
from tests.helpers.parity import (
    assert_close_series,
    assert_params_close,
    fit_and_record,
    full_parameters,
    mean_over_ranks,
)

SEQ, VOCAB, STEPS = 16, 64, 3
LOSS_TOL = dict(atol=1e-5, rtol=1e-5)
PARAM_TOL = dict(atol=1e-4, rtol=1e-4)


class LlamaLM(L.LightningModule):
    """A user's module: a tiny Hugging Face Llama (grouped KV heads, rotary positions), loss on all tokens."""

    def __init__(self, attention: str = "sdpa", checkpointing: bool = False) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=4 * SEQ)
        config._attn_implementation = attention
        self.model = LlamaForCausalLM(config)
        if checkpointing:  # blocks recomputed in backward: split again, attention round the ring again
            self.model.gradient_checkpointing_enable({"use_reentrant": False})

    def training_step(self, batch, batch_idx):
        tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)


class AttentionLengths(Callback):
    """Saves, per rank, the sequence lengths the first block's attention saw in training."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.lengths = out_dir, []

    def on_train_start(self, trainer, pl_module):
        def record(module, args, kwargs):
            self.lengths.append((args[0] if args else kwargs["hidden_states"]).shape[1])
        attention_of(pl_module).register_forward_pre_hook(record, with_kwargs=True)

    def on_train_end(self, trainer, pl_module):
        torch.save(self.lengths, os.path.join(self.out_dir, f"lengths{trainer.global_rank}.pt"))


class FullParameters(Callback):
    """Saves, per rank, every parameter as one device holds it (tensor-parallel shards gathered)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        params = full_parameters(pl_module, trainer.strategy.mesh)
        torch.save(params, os.path.join(self.out_dir, f"full{trainer.global_rank}.pt"))


def tokens(samples: int = 8, length: int = SEQ) -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (samples, length), generator=torch.Generator().manual_seed(1)))


def pairs(samples: int = 8, length: int = SEQ) -> TensorDataset:
    """(input, next tokens) pairs, as the embedded GPT and Lightning's demo Transformer read them."""
    data = torch.randint(0, VOCAB, (samples, length + 1), generator=torch.Generator().manual_seed(1))
    return TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())


def demo_transformer() -> L.LightningModule:
    """Lightning's demo encoder-decoder Transformer, dropout off (its random pattern differs per layout),
    without its WikiText2 download (the test brings its data)."""
    from lightning.pytorch.demos import LightningTransformer

    module = LightningTransformer(vocab_size=VOCAB)
    module.prepare_data = lambda: None
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    return module


def attention_of(module: L.LightningModule) -> nn.Module:
    """The first split block's self-attention."""
    decoder = getattr(getattr(module, "model", None), "model", None)  # a Hugging Face causal LM's decoder
    if decoder is not None:
        return decoder.layers[0].self_attn
    if isinstance(module, GPT):
        return module.transformer.h[0].attn
    return module.model.transformer.decoder.layers[0].self_attn


MODELS = {
    "hf_llama": (LlamaLM, tokens),
    "gpt": (lambda: GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32), pairs),
    "lightning_demo": (demo_transformer, pairs),
    "hf_llama_checkpointed": (lambda: LlamaLM(checkpointing=True), tokens),
}


def assert_matches_one_device(tmp_path, dp: int, cp: int, tp: int = 1, model: str | tuple = "hf_llama",
                              zero_stage: int = 0, **trainer) -> None:
    """``model``: a name of ``MODELS``, or its ``(build, data)`` pair."""
    build, data = MODELS[model] if isinstance(model, str) else model
    L.seed_everything(0)
    module, data = build(), data()
    expected = fit_and_record(module, data, 2 * dp, str(tmp_path / "one"), max_steps=STEPS, emulate_replicas=dp,
                              **trainer)[0]
    out = tmp_path / "cp"
    strategy = ParallelStrategy(context_parallel=cp, tensor_parallel=tp, zero_stage=zero_stage, start_method="fork")
    got = fit_and_record(module, data, 2, str(out), devices=dp * cp * tp, max_steps=STEPS, strategy=strategy,
                         callbacks=[AttentionLengths(str(out)), FullParameters(str(out))], **trainer)
    # each replica's loss is over its own samples; its CP and TP ranks (consecutive ranks) agree on it
    assert_close_series(mean_over_ranks(got), expected["losses"], **LOSS_TOL)
    for rank, record in enumerate(got):
        lengths = torch.load(out / f"lengths{rank}.pt")  # each rank attended its part (recomputed ones too)
        assert set(lengths) == {SEQ // cp} and len(lengths) >= STEPS
        assert record["losses"] == got[rank - rank % (cp * tp)]["losses"]
        params = torch.load(out / f"full{rank}.pt")
        assert set(params) <= set(expected["params"]) and len(params) > 0  # tied weights once
        assert_params_close(params, expected["params"], **PARAM_TOL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["hf_llama", "gpt", "lightning_demo", "hf_llama_checkpointed"])
def test_cp2_matches_single_device(tmp_path, model):
    assert_matches_one_device(tmp_path, dp=1, cp=2, model=model)


@pytest.mark.timeout(120)
def test_dp2_cp2_hf_llama_matches_single_device(tmp_path):
    assert_matches_one_device(tmp_path, dp=2, cp=2)


@pytest.mark.timeout(120)
def test_tp2_cp2_hf_llama_matches_single_device(tmp_path):
    # heads split over the TP ranks, the sequence over the CP ranks: each rank rings its own heads
    assert_matches_one_device(tmp_path, dp=1, cp=2, tp=2)


@pytest.mark.timeout(120)
def test_cp2_with_zero1_and_clipping_matches_single_device(tmp_path):
    # ZeRO-1 shards the optimizer over the DP x CP ranks, and clipping takes the norm over their slices
    assert_matches_one_device(tmp_path, dp=1, cp=2, zero_stage=1, gradient_clip_val=0.05)
