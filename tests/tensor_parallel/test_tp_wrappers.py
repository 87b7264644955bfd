"""Plans found through wrappers: a Hugging Face model wrapped by PEFT LoRA or by torch.compile,
inside an unchanged LightningModule, trains at TP=2 to the single-device losses and parameters.

LoRA adapters are sharded to match their base layer (``tensor_parallel/lora.py``). Tolerances as
in test_tp_training: float32 sums reordered by sharding, far below the AdamW step lr whose size a
wrong shard or a missing reduction would show.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.strategy import ParallelStrategy
from lightning_parallel.tensor_parallel import PlanEntry, detect_plan, parallelize
from lightning_parallel.tensor_parallel.lora import route_lora
from tests.helpers.parity import assert_param_close
from tests.helpers.processes import make_mesh, run_distributed
from tests.tensor_parallel.test_tp_training import (
    LOSS_TOL,
    PARAM_TOL,
    Record,
    TinyLlama,
)

STEPS, BATCH, SEQ, VOCAB = 4, 4, 16, 128
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]  # colwise and rowwise bases


def lora_llama(hidden: int = 64, vocab: int = VOCAB, modules_to_save=None) -> nn.Module:
    """A tiny HF Llama (4 heads, 2 KV heads) under ``peft.get_peft_model``: only adapters train.
    ``init_lora_weights=False`` draws B at random too, so the adapters change the loss from step 0."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=SEQ)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False,
                      modules_to_save=modules_to_save)
    return get_peft_model(LlamaForCausalLM(config), lora)


class LoraModule(L.LightningModule):
    """A user's LightningModule fine-tuning LoRA adapters on a Hugging Face causal LM."""

    def __init__(self, modules_to_save=None) -> None:
        super().__init__()
        self.net = lora_llama(modules_to_save=modules_to_save)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.net(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3, eps=1e-6)


def fit(path, strategy=None, modules_to_save=None):
    L.seed_everything(0)
    model = LoraModule(modules_to_save)
    data = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(
        accelerator="cpu", devices=2 if strategy else 1, strategy=strategy or "auto", max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record(path)],
        use_distributed_sampler=False,  # every TP rank reads the single-device batches (see test_tp_training)
    )
    trainer.fit(model, DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH))
    return torch.load(path)


@pytest.mark.timeout(120)
def test_trainer_tp2_peft_lora_llama_matches_single_device(tmp_path):
    expected = fit(tmp_path / "single.pt")
    got = fit(tmp_path / "tp2.pt", ParallelStrategy(tensor_parallel=2, start_method="fork"))
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), **LOSS_TOL)
    assert got["params"].keys() == expected["params"].keys()
    trained = [n for n in expected["params"] if "lora_" in n]
    assert len(trained) == 2 * 2 * len(TARGETS)  # A and B, per layer, per target
    for name, p in got["params"].items():
        assert_param_close(p, expected["params"][name], **PARAM_TOL, name=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved", ["lm_head", "embed_tokens"])
def test_tp2_lora_with_a_trainable_copy_of_the_head_or_embedding_matches_single_device(tmp_path, saved):
    # PEFT's modules_to_save wraps the layer with a trainable copy; both are split as the layer would be
    expected = fit(tmp_path / "single.pt", modules_to_save=[saved])
    got = fit(tmp_path / "tp2.pt", ParallelStrategy(tensor_parallel=2, start_method="fork"), modules_to_save=[saved])
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), **LOSS_TOL)
    copy = [n for n in expected["params"] if f"{saved}.modules_to_save.default.weight" in n]
    assert len(copy) == 1  # the trainable copy, compared below with everything else
    for name, p in got["params"].items():
        assert_param_close(p, expected["params"][name], **PARAM_TOL, name=name)


def test_lora_adapters_follow_their_base_layer():
    plan = detect_plan(nn.ModuleDict({"net": lora_llama(32, 64)}))
    layers = "net.base_model.model.model.layers.*."
    assert plan[layers + "self_attn.q_proj"] == PlanEntry("colwise")  # found through PEFT's prefix
    routed = route_lora(nn.ModuleDict({"net": lora_llama(32, 64)}), plan)
    assert routed[layers + "self_attn.q_proj.base_layer"] == PlanEntry("colwise")
    assert routed[layers + "self_attn.q_proj.lora_B.*"] == PlanEntry("colwise")  # B split by output, A whole
    assert routed[layers + "self_attn.o_proj.base_layer"] == PlanEntry("rowwise")
    assert routed[layers + "self_attn.o_proj.lora_A.*"] == PlanEntry("rowwise")  # A split by input, B whole
    assert not any(g.endswith("lora_A.*") and "q_proj" in g for g in routed)
    assert routed[layers + "self_attn.k_proj"] == PlanEntry("colwise")  # no adapter: unchanged


def test_dora_is_refused_with_plain_lora_as_the_way():
    from peft import LoraConfig, get_peft_model

    from lightning_parallel.mesh import ParallelMesh
    from lightning_parallel.tensor_parallel import TensorParallelError

    model = TinyLlama()
    model.model = get_peft_model(model.model, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(TensorParallelError, match="use_dora=False"):
        parallelize(model, ParallelMesh(2, tensor_parallel=2))


def _compiled_worker(rank, world):
    torch.manual_seed(0)
    model = TinyLlama()
    # the eager backend runs Dynamo's graph capture (and the _orig_mod wrapper) without a C++ toolchain
    model.model = torch.compile(model.model, backend="eager")
    if world > 1:
        parallelize(model, make_mesh(rank, world, tp=world))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    ids = torch.randint(0, 64, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    losses = []
    for x in ids:
        loss = model.model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, sum(hasattr(p, "tp_shard") for p in model.parameters())


@pytest.mark.timeout(120)
def test_tp2_torch_compiled_hf_model_matches_single_process():
    plan = detect_plan(TinyLlama())
    compiled = TinyLlama()
    compiled.model = torch.compile(compiled.model, backend="eager")
    assert detect_plan(compiled) == {g.replace("model.", "model._orig_mod.", 1): e for g, e in plan.items()}
    expected, _ = _compiled_worker(0, 1)
    for losses, sharded in run_distributed(_compiled_worker, 2, timeout=120):
        assert sharded > 0
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **LOSS_TOL)
