"""Mixture-of-Experts under TP=2 trains like one process: every expert split, the router whole.

Same harness and tolerances as ``test_tp_styles.py`` (3 AdamW steps, float32, loss 1e-5,
parameters 1e-4; through the Trainer, ``test_tp_training.fit``: 4 steps at lr 3e-3, same bounds).
The hand-made layer routes 16 tokens top-1 over 8 experts plus an identity expert, so some
experts get no token in a step; they are skipped on every rank alike.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.strategy import ParallelStrategy
from lightning_parallel.tensor_parallel import parallelize
from tests.helpers.processes import make_mesh, run_distributed
from tests.tensor_parallel.test_tp_styles import (
    HF,
    VOCAB,
    assert_tp2_matches_single_process,
    counted_collectives,
    lm_loss,
)
from tests.tensor_parallel.test_tp_training import fit


class Experts(nn.Module):
    """Experts stored as Hugging Face does: one 3-D ``gate_up_proj`` and ``down_proj`` for all, plus
    an identity expert at index ``num_experts``."""

    def __init__(self, num_experts=8, hidden=16, inter=12):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inter) / inter**0.5)
        self.identity_expert = nn.Identity()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts + 1):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue  # an expert with no token this step
            x = hidden_states[token]
            if e == self.num_experts:
                y = self.identity_expert(x)
            else:
                gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class MoELM(nn.Module):
    def __init__(self, hidden=16, num_experts=8):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.router = nn.Linear(hidden, num_experts + 1, bias=False)
        self.experts = Experts(num_experts, hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, ids):
        x = self.embed(ids).flatten(0, 1)
        weights, index = self.router(x).softmax(-1).topk(1, dim=-1)
        y = x + self.experts(x, index, weights)
        return self.head(y).view(*ids.shape, VOCAB)


@pytest.mark.timeout(60)
def test_tp2_moe_experts_with_idle_and_identity_experts_match_single_process():
    torch.manual_seed(0)
    model = MoELM()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    used = model.router(model.embed(ids).flatten(0, 1)).argmax(-1).unique()
    assert len(used) < 9 and 8 in used, "the idle-expert or the identity-expert case is not exercised"
    plan = {"experts": "moe_experts", "experts.identity_expert": "moe_identity_expert"}
    assert_tp2_matches_single_process(MoELM, lm_loss, plan)


def _experts_collectives_worker(rank, world):
    torch.manual_seed(0)
    model = MoELM()
    parallelize(model, make_mesh(rank, world, tp=world), {"experts": "moe_experts"})
    x = torch.randn(12, 16, requires_grad=True)
    weights, index = model.router(x).softmax(-1).topk(2, dim=-1)
    forward, backward = [], []
    with counted_collectives(forward):
        y = model.experts(x, index, weights)
    with counted_collectives(backward):
        y.square().sum().backward()
    return forward, backward


@pytest.mark.timeout(60)
def test_experts_output_is_all_reduced_once_whatever_the_number_of_experts():
    """Forward: one all-reduce of (tokens, hidden). Backward: the experts' input and the routing
    weights (tokens, top-k), each summed once."""
    forward, backward = run_distributed(_experts_collectives_worker, 2)[0]
    assert forward == [("all_reduce", 12 * 16)]
    assert sorted(backward) == [("all_reduce", 12 * 2), ("all_reduce", 12 * 16)]


MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
MLA = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4,
           num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
           topk_group=1, **MOE)
HF_MOE_CASES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)),
    "qwen3_moe_with_q_norm": ("Qwen3MoeConfig", dict(num_experts=4, head_dim=8, decoder_sparse_step=1, **MOE)),
    "deepseek_v3_dense_then_moe_with_shared_experts": ("DeepseekV3Config", MLA),
    "deepseek_v2_split_latent_attention": ("DeepseekV2Config", MLA),
    # its own plan leaves q_norm/k_norm out: found between the split q/k/v and o_proj, summed
    "glm4_moe_with_q_norm_the_plan_forgot": (
        "Glm4MoeConfig",
        dict(use_qk_norm=True, head_dim=8, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
             n_group=1, topk_group=1, **MOE),
    ),
    # experts take the routed tokens only, stored (experts, hidden, 2 * inter); layer 0 dense, layer 1 MoE
    "llama4_text_pre_routed_experts": (
        "Llama4TextConfig",
        dict(intermediate_size=16, intermediate_size_mlp=24, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
             interleave_moe_layer_step=2),
    ),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(HF_MOE_CASES))
def test_tp2_hf_moe_model_matches_single_process(case):
    name, sizes = HF_MOE_CASES[case]
    assert_tp2_matches_single_process(lambda: HF(name, **sizes), lm_loss)


class Qwen3MoeModule(L.LightningModule):
    """A user's unchanged LightningModule around a tiny Qwen3-MoE (q_norm/k_norm, 4 experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = HF("Qwen3MoeConfig", num_experts=4, head_dim=8, decoder_sparse_step=1, **MOE)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.lm.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)


@pytest.mark.timeout(180)
def test_trainer_with_tp2_strategy_trains_qwen3_moe_like_one_device(tmp_path):
    """The whole path: ParallelStrategy finds the model's own plan (q_norm/k_norm grad sums,
    experts split) and trains it like one device."""
    expected = fit(Qwen3MoeModule, tmp_path / "single.pt")
    got = fit(Qwen3MoeModule, tmp_path / "tp2.pt", ParallelStrategy(tensor_parallel=2, start_method="fork"))
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-5)
    for name, p in got["params"].items():
        torch.testing.assert_close(p, expected["params"][name], rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def _llama4_expert_shapes_worker(rank, world):
    torch.manual_seed(0)
    model = HF("Llama4TextConfig", **HF_MOE_CASES["llama4_text_pre_routed_experts"][1])
    experts = model.model.model.layers[1].feed_forward.experts
    full = {n: p.detach().clone() for n, p in experts.named_parameters()}
    with redirect_stdout(io.StringIO()):  # the plan table
        parallelize(model, make_mesh(rank, world, tp=world))
    return full, {n: p.detach().clone() for n, p in experts.named_parameters()}


@pytest.mark.timeout(60)
def test_llama4_experts_keep_their_half_of_each_packed_projection_per_rank():
    """gate_up_proj (experts, hidden, 2 * inter): each rank keeps its half of the gate and of the up
    block; down_proj (experts, inter, hidden): its half of the intermediate rows."""
    for rank, (full, local) in enumerate(run_distributed(_llama4_expert_shapes_worker, 2)):
        gate, up = full["gate_up_proj"].chunk(2, dim=-1)
        half = slice(8 * rank, 8 * rank + 8)
        torch.testing.assert_close(local["gate_up_proj"], torch.cat([gate[..., half], up[..., half]], dim=-1))
        torch.testing.assert_close(local["down_proj"], full["down_proj"][:, half])
