"""Pipeline stages for models whose code this project does not control, each inside a plain LightningModule.

Every test trains the same initial weights on the same batches on one device and at PP=2 (PP=4 for
LitGPT) through ``ParallelStrategy`` and the Trainer, and compares each step's loss, the logged
``train_loss`` and every stage's parameters with the single-device run. Tolerances are those of
``test_pp_training`` (losses 1e-5, parameters 5e-5 after AdamW, with the reasoning given there): the
pipeline only reorders float32 sums, while a module placed on the wrong stage, a skipped update or a
residual lost at a stage boundary moves losses by >1e-3.

What each model exercises:
- LitGPT ``GPT``: ``lm_head`` is registered before the block list and runs after it;
- OPT: ``final_layer_norm`` registered before the layers, run after them;
- XLM-RoBERTa (causal LM, ``is_decoder=True``): an encoder-style stack with post-norm blocks;
- Mixtral: mixture-of-experts blocks (a router and per-expert weights inside each block);
- PEFT LoRA on Llama: frozen base weights, trainable adapters, a wrapped model tree;
- a model whose caller adds the residual (``h = h + block(h)``);
- a model that passes the embedding output to every block: the embedding stays on every stage;
- a model that reads a first-stage module's weight without calling it (as ProphetNet does).
"""

import warnings

import lightning as L
import pytest
import torch
from torch import nn

from tests.helpers.parity import fit_and_record
from tests.pipeline.test_pp_training import (
    assert_records_match,
    pp_strategy,
    token_data,
)

VOCAB = 128


class CausalLM(L.LightningModule):
    """A plain LightningModule around a model built by ``make`` (seeded), loss from ``labels=``."""

    def __init__(self, make, hf=True):
        super().__init__()
        torch.manual_seed(0)
        self.model, self.hf = make(), hf

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.hf:
            loss = self.model(input_ids=x, labels=y).loss
        else:
            logits = self.model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def litgpt_model():
    import litgpt

    config = litgpt.Config(name="tiny-llama", block_size=32, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=4,
                           n_head=4, n_embd=32, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False,
                           bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64)
    return litgpt.GPT(config)


def opt_model():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=4,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    dropout=0.0, attention_dropout=0.0))


def xlm_roberta_model():
    from transformers import XLMRobertaConfig, XLMRobertaForCausalLM

    config = XLMRobertaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, max_position_embeddings=64, is_decoder=True,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return XLMRobertaForCausalLM(config)


def mixtral_model():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=64))


def lora_llama_model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():  # PEFT starts lora_B at zero: give the adapters a visible effect
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    return model


class ResidualByCaller(nn.Module):
    """Blocks return only their update; the caller adds the residual between blocks."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class X0Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, h, x0):
        return h + torch.tanh(self.lin(self.norm(h))) + 0.5 * x0


class EmbeddingToEveryBlock(nn.Module):
    """Every block also takes the embedding output ``x0`` (as in modded-nanoGPT's value residual)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(X0Block() for _ in range(4))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x):
        h = x0 = self.emb(x)
        for block in self.blocks:
            h = block(h, x0)
        return self.head(h)


class TableReadBeforeBlocks(nn.Module):
    """The caller indexes a module's weight instead of calling the module (ProphetNet's decoder adds
    ``ngram_embeddings.weight[i]`` to its position embeddings before the blocks)."""

    def __init__(self):
        super().__init__()
        self.emb, self.offsets = nn.Embedding(VOCAB, 32), nn.Embedding(2, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x):
        h = self.emb(x) + self.offsets.weight[0]
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def run_parity(tmp_path, make, stages=2, hf=True, steps=3):
    warnings.filterwarnings("ignore")
    module, data = CausalLM(make, hf), token_data(vocab=VOCAB)
    reference = fit_and_record(module, data, 8, str(tmp_path / "ref"), max_steps=steps)[0]
    records = fit_and_record(module, data, 8, str(tmp_path / "pp"), devices=stages, strategy=pp_strategy(stages),
                             max_steps=steps, use_distributed_sampler=False)
    assert_records_match(reference, records)
    return records


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages", [2, 4], ids=["pp2", "pp4"])
def test_litgpt_gpt_with_head_registered_first_matches_single_device(tmp_path, stages):
    records = run_parity(tmp_path, litgpt_model, stages, hf=False)
    assert "model.lm_head.weight" in records[-1]["params"] and "model.lm_head.weight" not in records[0]["params"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("make", [opt_model, xlm_roberta_model, mixtral_model],
                         ids=["opt", "xlm-roberta-causal", "mixtral-moe"])
def test_hugging_face_model_matches_single_device_at_pp2(tmp_path, make):
    run_parity(tmp_path, make)


@pytest.mark.timeout(90)
def test_peft_lora_llama_matches_single_device_at_pp2(tmp_path):
    records = run_parity(tmp_path, lora_llama_model)
    trained = [n for r in records for n in r["params"] if "lora_" in n]
    assert len(trained) == 4 * 2 * 2  # A and B of q_proj and v_proj in 4 layers, each on exactly one stage


@pytest.mark.timeout(90)
def test_residual_added_by_the_caller_between_blocks_matches_single_device_at_pp2(tmp_path):
    run_parity(tmp_path, ResidualByCaller, hf=False)


@pytest.mark.timeout(90)
def test_embedding_passed_to_every_block_is_kept_on_every_stage_and_matches_single_device(tmp_path):
    records = run_parity(tmp_path, EmbeddingToEveryBlock, hf=False)
    assert all("model.emb.weight" in r["params"] for r in records)  # replicated, its gradient summed over stages


@pytest.mark.timeout(90)
def test_weight_of_a_first_stage_module_read_by_the_caller_matches_single_device_at_pp2(tmp_path):
    records = run_parity(tmp_path, TableReadBeforeBlocks, hf=False)
    assert "model.offsets.weight" in records[0]["params"] and "model.offsets.weight" not in records[1]["params"]
