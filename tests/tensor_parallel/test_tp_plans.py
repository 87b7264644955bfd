"""Plans: detection on unchanged models, Hydra-style plans, and the errors raised (identically on
every rank, before any collective) when a model or plan cannot be sharded."""

from __future__ import annotations

import contextlib
import copy
import io
import os

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.models.gpt import GPT
from lightning_parallel.tensor_parallel import (
    PlanEntry,
    TensorParallelError,
    detect_plan,
    parallelize,
    parse_plan,
)
from lightning_parallel.tensor_parallel.resolve import resolve_plan
from tests.helpers.processes import make_mesh, run_distributed
from tests.tensor_parallel.test_tp_training import TinyLlama

TOL = dict(rtol=1e-5, atol=1e-6)  # float32, sums reordered by sharding (see test_tp_layers)


class RenamedSelfAttention(nn.Module):
    """nanoGPT's attention under another name: stored head count, fused QKV, causal via a mask."""

    def __init__(self, n_embd: int = 16, n_head: int = 4) -> None:
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(0.0)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.attn = RenamedSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


def test_detected_plan_of_the_default_gpt_shards_attention_mlp_and_tied_vocab():
    plan = detect_plan(GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    assert plan == {
        "transformer.h.*.attn": PlanEntry("attention"),
        "transformer.h.*.mlp.c_fc": PlanEntry("colwise"),
        "transformer.h.*.mlp.c_proj": PlanEntry("rowwise"),
        "transformer.wte": PlanEntry("vocab"),
        "lm_head": PlanEntry("colwise", gather_output=True),
    }


def test_sequence_parallel_plan_scatters_the_position_embedding():
    plan = detect_plan(GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32), sequence_parallel=True)
    assert plan["transformer.wpe"] == PlanEntry("sequence_scatter")


def test_hf_plan_is_resolved_relative_to_the_wrapping_module():
    plan = detect_plan(TinyLlama())
    assert plan["model.model.layers.*.self_attn.k_proj"] == PlanEntry("colwise")
    assert plan["model.model.layers.*.mlp.down_proj"] == PlanEntry("rowwise")
    assert plan["model.lm_head"] == PlanEntry("colwise", gather_output=True)
    assert plan["model.model.embed_tokens"] == PlanEntry("vocab")


def test_nanogpt_shaped_attention_is_recognised_by_structure_not_name():
    assert detect_plan(NanoBlock()) == {
        "attn": PlanEntry("attention"),
        "mlp.0": PlanEntry("colwise"),
        "mlp.2": PlanEntry("rowwise"),
    }


def _nano_worker(rank, world):
    torch.manual_seed(0)
    full = NanoBlock()
    tp = copy.deepcopy(full)
    parallelize(tp, make_mesh(rank, world, tp=world))
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(tp(x), full(x), **TOL)
    full(x).sum().backward()
    tp(x).sum().backward()
    torch.testing.assert_close(tp.ln.weight.grad, full.ln.weight.grad, **TOL)
    return True


@pytest.mark.timeout(30)
def test_nanogpt_attention_with_a_stored_head_count_matches_one_device():
    run_distributed(_nano_worker, 2)


def test_hydra_plan_with_fused_layout_and_attribute_rewrite():
    raw = OmegaConf.create(
        {"h.*.c_attn": {"style": "colwise", "fused": 3}, "h.*.c_proj": "rowwise", "h.*": {"divide": ["n_head"]}}
    )
    assert parse_plan(raw) == {
        "h.*.c_attn": PlanEntry("colwise", fused=3),
        "h.*.c_proj": PlanEntry("rowwise"),
        "h.*": PlanEntry(None, divide=("n_head",)),
    }


def _error(model, plan=None, tp=2, sequence_parallel=False) -> str:
    """The error parallelize raises on a mesh with no process groups: proof no collective ran."""
    mesh = ParallelMesh(tp, tensor_parallel=tp)
    with pytest.raises(TensorParallelError) as info:
        parallelize(model, mesh, plan, sequence_parallel)
    return str(info.value)


def test_head_count_not_divisible_names_the_module_and_valid_sizes():
    message = _error(GPT(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32), tp=3)
    assert "transformer.h.0.attn" in message and "[1, 2, 4]" in message


def test_kv_heads_neither_divided_nor_copied_fails_at_setup_not_mid_forward():
    """12 query heads over 4 KV heads: TP 6 splits the query heads but neither divides the KV heads nor is
    a multiple of them (which would give each rank a copy of one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=48, intermediate_size=64, num_attention_heads=12,
                                         num_key_value_heads=4, num_hidden_layers=1, vocab_size=64))
    message = _error(model, tp=6)
    assert "neither divides its 4 KV heads" in message and "[1, 2, 4, 12]" in message


def test_ffn_size_not_divisible_names_the_sizes_that_work():
    model = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
    message = _error(model, {"0": "colwise", "2": "rowwise"}, tp=5)
    assert "out_features = 12" in message and "[1, 2, 3, 4, 6, 12]" in message


def test_glob_matching_nothing_is_an_error():
    assert "matches no module" in _error(NanoBlock(), {"blocks.*.attn": "attention"})


def test_style_that_does_not_fit_the_module_is_an_error():
    assert "LayerNorm: style 'colwise' fits nn.Linear" in _error(NanoBlock(), {"ln": "colwise"})


def test_sequence_parallel_on_a_hugging_face_model_is_refused_up_front():
    assert "sequence_parallel" in _error(TinyLlama(), sequence_parallel=True)


def test_attribute_rewrite_divides_the_stored_head_count():
    block = NanoBlock()
    resolve_plan(block, parse_plan({"attn": {"divide": ["n_head"]}}), 2, False)  # checks pass
    with pytest.raises(TensorParallelError, match="n_head = 4 is not divisible"):
        resolve_plan(block, parse_plan({"attn": {"divide": ["n_head"]}}), 3, False)


def _table_worker(rank, world):
    os.environ["COLUMNS"] = "200"  # rich folds cells to the terminal width; keep each row on one line
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        parallelize(GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32), make_mesh(rank, world, tp=world))
    return out.getvalue()


@pytest.mark.timeout(30)
def test_plan_in_force_is_printed_once_as_a_table():
    printed = run_distributed(_table_worker, 2)
    assert printed[1] == ""
    for text in ("transformer.h.*.attn", "attention", "colwise gather_output", "(32, 32)"):
        assert text in printed[0]


def _transformer_worker(rank, world):
    torch.manual_seed(0)
    full = nn.Transformer(
        16, 4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32, dropout=0.0, batch_first=True
    )
    tp = copy.deepcopy(full)
    parallelize(tp, make_mesh(rank, world, tp=world))
    src, tgt = torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    torch.testing.assert_close(tp(src, tgt, tgt_mask=mask), full(src, tgt, tgt_mask=mask), **TOL)
    full(src, tgt, tgt_mask=mask).sum().backward()
    tp(src, tgt, tgt_mask=mask).sum().backward()
    torch.testing.assert_close(tp.encoder.norm.weight.grad, full.encoder.norm.weight.grad, **TOL)
    return sorted({type(m).__name__ for m in tp.modules()} & {"ParallelMultiheadAttention", "ColumnParallelLinear"})


@pytest.mark.timeout(30)
def test_nn_transformer_with_cross_attention_matches_one_device():
    kinds = run_distributed(_transformer_worker, 2)[0]
    assert kinds == ["ColumnParallelLinear", "ParallelMultiheadAttention"]
