"""Plans detected for models that carry none: separate q/k/v attentions (BERT, OPT, GPT-Neo), MLPs
spread over sibling modules, and the refusals that hand the user a plan to check and paste.

Parity tolerance: as in test_tp_training (float32, sums reordered by sharding; a wrong shard or a
missing reduction is off by about the AdamW step size lr = 1e-2, a hundred times PARAM_TOL).
"""

from __future__ import annotations

import pytest
import torch
import yaml
from torch import nn

from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.tensor_parallel import (
    PlanEntry,
    TensorParallelError,
    detect_plan,
    parallelize,
    parse_plan,
)
from tests.helpers.parity import assert_param_close, full_parameters
from tests.helpers.processes import make_mesh, run_distributed

LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=1e-4)
VOCAB, SEQ, STEPS = 64, 12, 3


def tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                   max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    )


def tiny_opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(
        OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_attention_heads=4, num_hidden_layers=2,
                  word_embed_proj_dim=32, max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0)
    )


def tiny_gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    return GPTNeoForCausalLM(
        GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_heads=4, num_layers=2, attention_types=[[["global", "local"], 1]],
                     window_size=4, max_position_embeddings=SEQ, intermediate_size=64, embed_dropout=0.0,
                     attention_dropout=0.0, resid_dropout=0.0)
    )


def tiny_falcon():
    """Falcon: its Linears are ``FalconLinear`` (an ``nn.Linear`` subclass computing the same); the MLP
    splits, the fused multi-query ``query_key_value`` stays whole."""
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(
        FalconConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                     hidden_dropout=0.0, attention_dropout=0.0)
    )


class Wrapped(nn.Module):
    """A user's module holding a Hugging Face model under an unusual attribute path."""

    def __init__(self, build) -> None:
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.lm = build()


def lora_bert():
    """PEFT LoRA on a model without a plan: adapters on the detected attention and spread MLP Linears."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_bert(), LoraConfig(r=4, target_modules=["query", "value", "dense"], init_lora_weights=False))


MODELS = {
    "bert": tiny_bert,
    "opt": tiny_opt,
    "gpt_neo": tiny_gpt_neo,
    "wrapped_gpt_neo": lambda: Wrapped(tiny_gpt_neo),
    "peft_lora_bert": lora_bert,
    "falcon_linear_subclass": tiny_falcon,
}


def _loss(model, ids):
    hf = model.backbone.lm if isinstance(model, Wrapped) else model
    return hf(input_ids=ids, labels=ids).loss  # BERT: masked-LM loss over every position


def train(name, mesh=None):
    torch.manual_seed(0)
    model = MODELS[name]()
    if mesh is not None:
        parallelize(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)  # eps: see test_tp_training
    data = torch.randint(0, VOCAB, (STEPS, 4, SEQ), generator=torch.Generator().manual_seed(1))
    losses = []
    for ids in data:
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.numpy() for n, p in full_parameters(model, mesh).items()}
    sharded = sum(hasattr(p, "tp_shard") for p in model.parameters())
    return losses, params, sharded


def _worker(rank, world, name):
    return train(name, make_mesh(rank, world, tp=world))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_detected_plan_matches_single_process(name):
    expected_losses, expected_params, _ = train(name)
    for losses, params, sharded in run_distributed(_worker, 2, name, timeout=90):
        assert sharded > 0
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **LOSS_TOL)
        assert params.keys() == expected_params.keys()
        for n, p in params.items():
            assert_param_close(torch.from_numpy(p), torch.from_numpy(expected_params[n]), **PARAM_TOL, name=n)


def test_bert_attention_split_over_sibling_modules_divides_its_stored_head_counts():
    plan = detect_plan(tiny_bert())
    layer = "bert.encoder.layer.*."
    assert plan[layer + "attention.self.query"] == PlanEntry("colwise")
    assert plan[layer + "attention.output.dense"] == PlanEntry("rowwise")
    assert plan[layer + "attention.self"] == PlanEntry(None, divide=("num_attention_heads", "all_head_size"))
    assert plan[layer + "intermediate.dense"] == PlanEntry("colwise")
    assert plan[layer + "output.dense"] == PlanEntry("rowwise")
    assert plan["cls.predictions.decoder"] == PlanEntry("colwise", gather_output=True)


def test_hf_model_under_any_attribute_path_gets_its_own_plan():
    from tests.tensor_parallel.test_tp_training import TinyLlama

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.ModuleDict({"lm": TinyLlama().model})

    plan = detect_plan(Deep())
    assert plan["net.lm.model.layers.*.self_attn.q_proj"] == PlanEntry("colwise")
    assert plan["net.lm.model.layers.*.mlp.down_proj"] == PlanEntry("rowwise")


def test_hf_plan_globs_that_match_no_module_are_skipped():
    from tests.tensor_parallel.test_tp_training import TinyLlama

    model = TinyLlama()
    model.model._tp_plan = dict(model.model._tp_plan, **{"model.layers.*.mlp.experts.gate_up_proj": "colwise"})
    plan = detect_plan(model)
    assert not any("experts" in g for g in plan) and "model.model.layers.*.mlp.up_proj" in plan


class Attention(nn.Module):
    """Separate q/k/v whose forward reads a stored width both as the model's (the input check) and
    as the merged heads' (the reshape): no single rewrite of it is right."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = 16, 4, 4
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        assert x.shape[-1] == self.embed_dim
        q, k, v = (p(x).view(*x.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out_proj(y.transpose(1, 2).reshape(*x.shape[:2], self.embed_dim))


class AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


def test_unsure_detection_refuses_with_a_plan_leaving_that_attention_whole_and_the_split_to_check():
    with pytest.raises(TensorParallelError, match="self.embed_dim") as info:
        detect_plan(AttentionBlock())
    text = str(info.value)
    *_, offered = text.split("tp_plan:")  # the last YAML block: the plan to paste
    assert parse_plan(yaml.safe_load("tp_plan:" + offered)["tp_plan"]) == {
        "mlp.0": PlanEntry("colwise"), "mlp.2": PlanEntry("rowwise")
    }
    to_check = parse_plan(yaml.safe_load("tp_plan:" + text.split("tp_plan:")[1].split("\nThis plan")[0])["tp_plan"])
    assert to_check == {"attn.q_proj": PlanEntry("colwise"), "attn.k_proj": PlanEntry("colwise"),
                        "attn.v_proj": PlanEntry("colwise"), "attn.out_proj": PlanEntry("rowwise"),
                        "attn": PlanEntry(None, divide=("num_heads",))}


def test_attention_taking_a_per_head_bias_from_outside_is_left_whole():
    class BiasedAttention(Attention):
        def forward(self, x, position_bias=None):  # scores + position_bias: (b, all heads, t, t)
            q, k, v = (p(x).view(*x.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=position_bias)
            return self.out_proj(y.transpose(1, 2).flatten(2))

    block = AttentionBlock()
    block.attn = BiasedAttention()
    with pytest.raises(TensorParallelError, match="position_bias"):
        detect_plan(block)


def test_model_with_nothing_to_split_is_refused_with_data_parallelism_as_the_way():
    from torchmetrics.classification import MulticlassAccuracy

    classifier = nn.Module()  # an MNIST-style classifier: its Linears only narrow
    classifier.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    classifier.accuracy = MulticlassAccuracy(num_classes=10)
    with pytest.raises(TensorParallelError, match="nothing to split.*data parallelism"):
        detect_plan(classifier)


class ScaledLinear(nn.Linear):
    """An ``nn.Linear`` subclass whose forward is not ``F.linear``: sharding must not replace it."""

    def forward(self, x):
        return 2 * super().forward(x)


class LinearWithBias(nn.Linear):
    """An ``nn.Linear`` subclass computing ``F.linear`` its own way (Falcon's ``FalconLinear``)."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


def test_only_linear_subclasses_computing_f_linear_are_split_as_linears():
    def mlp(cls):
        model = nn.Module()
        model.block = nn.Module()
        model.block.up, model.block.down = cls(16, 64), cls(64, 16)
        return model

    plan = detect_plan(mlp(LinearWithBias))
    assert {g: e.style for g, e in plan.items()} == {"block.up": "colwise", "block.down": "rowwise"}
    with pytest.raises(TensorParallelError, match="nothing to split"):
        detect_plan(mlp(ScaledLinear))
    with pytest.raises(TensorParallelError, match="ScaledLinear: style 'colwise' fits nn.Linear"):
        parallelize(mlp(ScaledLinear), ParallelMesh(2, tensor_parallel=2), {"block.up": "colwise"})


def test_user_glob_matching_nothing_suggests_the_name_behind_a_wrapper():
    model = Wrapped(tiny_opt)
    with pytest.raises(TensorParallelError, match=r"did you mean 'backbone\.lm\.model\.decoder\.layers\.\*\.fc1'"):
        parallelize(model, ParallelMesh(2, tensor_parallel=2), {"model.decoder.layers.*.fc1": "colwise"})


def test_star_matches_within_one_name_segment():
    plan = detect_plan(tiny_bert())  # 'layer.*.output.dense' must not also claim 'layer.*.attention.output.dense'
    from lightning_parallel.tensor_parallel.resolve import resolve_plan

    names = [a.name for a in resolve_plan(tiny_bert(), plan, 2, False) if a.name.endswith("output.dense")]
    assert sorted(names) == sorted(f"bert.encoder.layer.{i}.{p}output.dense" for i in (0, 1) for p in ("", "attention."))


def tiny_litgpt(kv_heads: int = 4):
    """LitGPT's GPT, Llama-style (RMSNorm, rotary, gated MLP); its attention reads head counts from its config."""
    from litgpt import GPT, Config

    return GPT(Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4,
                      n_query_groups=kv_heads, n_embd=32, head_size=8, intermediate_size=64, bias=False,
                      norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", rotary_percentage=1.0,
                      parallel_residual=False))


def _litgpt_worker(rank, world):
    torch.manual_seed(0)
    model = tiny_litgpt()
    mesh = make_mesh(rank, world, tp=world) if world > 1 else None
    if mesh is not None:
        parallelize(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    data = torch.randint(0, VOCAB, (STEPS, 4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for batch in data:
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.numpy() for n, p in full_parameters(model, mesh).items()}
    return losses, params, model.config.n_head, [n for n, p in model.named_parameters() if hasattr(p, "tp_shard")]


@pytest.mark.timeout(90)
def test_tp2_litgpt_reading_head_counts_from_its_config_matches_single_process():
    plan = detect_plan(tiny_litgpt())
    assert plan["transformer.h.*.attn.qkv"] == PlanEntry("colwise", fused=3)
    assert plan["transformer.h.*.attn"] == PlanEntry(None, divide=("config.n_head", "config.n_query_groups"))
    expected, expected_params, _, _ = _litgpt_worker(0, 1)
    for losses, params, model_heads, sharded in run_distributed(_litgpt_worker, 2, timeout=90):
        assert model_heads == 4  # the attention divided its own copy of the shared config
        assert any(n.endswith("attn.qkv.weight") for n in sharded)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **LOSS_TOL)
        for n, p in params.items():
            assert_param_close(torch.from_numpy(p), torch.from_numpy(expected_params[n]), **PARAM_TOL, name=n)


def test_litgpt_with_grouped_kv_heads_is_refused_with_a_plan_leaving_attention_whole():
    with pytest.raises(TensorParallelError, match="unequal size") as info:
        detect_plan(tiny_litgpt(kv_heads=2))
    text = str(info.value)
    plan = parse_plan(yaml.safe_load(text[text.index("tp_plan:"):])["tp_plan"])
    assert plan == {f"transformer.h.*.mlp.{n}": PlanEntry(s) for n, s in
                    (("fc_1", "colwise"), ("fc_2", "colwise"), ("proj", "rowwise"))}


def test_glob_star_stays_in_one_segment_and_double_star_crosses_them():
    from lightning_parallel.tensor_parallel.names import glob_matches

    assert glob_matches("layers.3.mlp.fc1", "layers.*.mlp.fc1")
    assert not glob_matches("layers.3.block.mlp.fc1", "layers.*.mlp.fc1")
    assert glob_matches("layers.3.block.mlp.fc1", "layers.**.fc1")
    assert glob_matches("_orig_mod.layers.0.fc1", "**.fc1") and not glob_matches("layers.0.fc10", "**.fc1")


def test_detection_of_a_model_without_plan_reads_head_width_reshapes_as_local():
    from transformers import XGLMConfig, XGLMForCausalLM

    model = XGLMForCausalLM(XGLMConfig(vocab_size=VOCAB, d_model=32, ffn_dim=64, attention_heads=4, num_layers=2))
    plan = detect_plan(model)  # XGLM merges heads with reshape(bsz, tgt_len, self.embed_dim)
    assert plan["model.layers.*.self_attn"] == PlanEntry(None, divide=("num_heads", "embed_dim"))


def test_plan_offered_as_yaml_parses_back_to_the_same_plan():
    from lightning_parallel.tensor_parallel.report import plan_as_yaml

    plan = parse_plan({"h.*.attn.c_attn": {"style": "colwise", "fused": 3}, "h.*.attn": {"divide": ["config.n_head"]},
                       "lm_head": {"style": "colwise", "gather_output": True}, "h.*.mlp.fc2": "rowwise",
                       "h.*.attn.sinks_owner": {"style": "local_params", "params": {"sinks": -1}},
                       "h.*.shared": {"style": "all_reduce", "params": {"up": -2, "down": -1}}})
    assert parse_plan(yaml.safe_load(plan_as_yaml(plan))["tp_plan"]) == plan
