"""Every tensor-parallel style trains like one process: TP=2 on gloo against the unsharded module.

Each test builds one module (a small hand-made one per style, then tiny Hugging Face models whose
own plans use the style), runs a few AdamW steps on one process and on 2 TP ranks from the same
initial weights and batches, and compares every step's loss and the final full parameters.
Then: the collectives of a paired MLP, refusals, and dropout (per-rank masks on split
activations, replayed exactly when activation checkpointing recomputes).

Tolerance: float32 on CPU. Sharding only reorders sums (matmul blocks, all-reduce), so the
first step agrees to a few ulps; AdamW divides by the gradient's running RMS, which lifts
rounding noise on near-zero gradients to steps of size lr, so parameters are compared at 1e-4
after 3 steps (lr 1e-2, eps 1e-6: see ``test_tp_training.py``). A missing gradient sum (the
failure these styles prevent) moves losses by 1e-3 or more within those steps.
"""

from __future__ import annotations

import copy
import io
import sys
from contextlib import contextmanager, redirect_stdout

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.models.gpt import Block
from lightning_parallel.tensor_parallel import TensorParallelError, comm, parallelize
from tests.helpers.parity import assert_param_close, full_parameters
from tests.helpers.processes import make_mesh, run_distributed

LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_TOL = dict(rtol=1e-4, atol=1e-4)
STEPS, VOCAB = 3, 64


def _train(model: nn.Module, loss_fn, mesh=None, plan=None):
    if mesh is not None:
        with redirect_stdout(io.StringIO()):  # the plan table
            parallelize(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        loss = loss_fn(model, torch.randint(0, VOCAB, (2, 8), generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.numpy() for n, p in full_parameters(model, mesh).items()}


def _worker(rank, world, build, loss_fn, plan):
    torch.manual_seed(0)
    return _train(build(), loss_fn, make_mesh(rank, world, tp=world), plan)


def assert_tp2_matches_single_process(build, loss_fn, plan=None):
    """``build()`` (seeded alike everywhere) trained on one process and on 2 TP ranks agree."""
    torch.manual_seed(0)
    expected_losses, expected = _train(build(), loss_fn)
    results = run_distributed(_worker, 2, build, loss_fn, plan, timeout=120)
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **LOSS_TOL)
        assert params.keys() == expected.keys()
        for name, p in params.items():
            assert_param_close(torch.from_numpy(p), torch.from_numpy(expected[name]), **PARAM_TOL, name=name)
    for name, p in results[1][1].items():  # replicated parameters stay identical across ranks
        assert (p == results[0][1][name]).all(), f"{name} drifted apart across ranks"


# ---- hand-made modules, one per style ----------------------------------------------------------
class HeadNormAttentionish(nn.Module):
    """A per-head RMSNorm with one shared weight between a colwise and a rowwise Linear (Qwen3's q_norm)."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.q = nn.Linear(d, d)
        self.norm = nn.RMSNorm(d // heads)
        self.o = nn.Linear(d, VOCAB)
        self.head_dim = d // heads

    def forward(self, ids):
        q = self.q(self.embed(ids))
        q = self.norm(q.view(*q.shape[:-1], -1, self.head_dim)).flatten(-2)
        return self.o(torch.tanh(q))


class FusedThenSliced(nn.Module):
    """Phi-3's shape: a fused projection whose output the code slices by absolute positions, so it
    must be gathered, and a projection whose input comes from that replicated code."""

    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.qkv = nn.Linear(d, 3 * d - 4, bias=False)  # unequal parts, as with grouped KV heads
        self.o = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)
        self.d = d

    def forward(self, ids):
        y = self.qkv(self.embed(ids))
        a, b = y[..., : self.d], y[..., self.d : 2 * self.d]
        return self.head(self.o(a * torch.sigmoid(b)))


class PackedMLP(nn.Module):
    """A fused gate/up projection (``chunk(2)``) and a projection fed the packed output directly."""

    def __init__(self, d=16, f=24):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.gate_up = nn.Linear(d, 2 * f)
        self.down = nn.Linear(f, d)
        self.down_packed = nn.Linear(2 * f, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        h = self.gate_up(self.embed(ids))
        gate, up = h.chunk(2, dim=-1)
        return self.head(self.down(F.silu(gate) * up) + self.down_packed(torch.tanh(h)))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2): ``kv_a_proj_with_mqa`` gives a latent and one
    rotary key shared by every head; the latent is expanded by a colwise ``kv_b_proj``."""

    def __init__(self, d=16, heads=4, latent=8, rope=4, nope=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.q_proj = nn.Linear(d, heads * (nope + rope))
        self.kv_a_proj_with_mqa = nn.Linear(d, latent + rope)
        self.kv_b_proj = nn.Linear(latent, heads * (nope + nope))
        self.o_proj = nn.Linear(heads * nope, d)
        self.head = nn.Linear(d, VOCAB)
        self.qk_rope_head_dim, self.nope, self.latent = rope, nope, latent

    def forward(self, ids):
        x = self.embed(ids)
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.nope + self.qk_rope_head_dim).transpose(1, 2)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(b, s, -1, 2 * self.nope).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.nope], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(self.o_proj(y.transpose(1, 2).reshape(b, s, -1)))


class DropoutInsideSplitRegion(nn.Module):
    """Dropout written in the model's own code on split features, then on the replicated output."""

    def __init__(self, d=16):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return F.dropout(self.down(F.dropout(self.up(x), 0.5)), 0.5)


def lm_loss(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


STYLE_CASES = {
    "replicated_grad_sum": (HeadNormAttentionish, {"q": "colwise", "norm": "replicated_grad_sum", "o": "rowwise"}),
    "per-head norm found without a plan entry": (HeadNormAttentionish, {"q": "colwise", "o": "rowwise"}),
    "colwise_gather_output+rowwise_split_input": (
        FusedThenSliced,
        {"qkv": {"style": "colwise", "gather_output": True}, "o": {"style": "rowwise", "split_input": True}},
    ),
    "packed_colwise+packed_rowwise": (
        PackedMLP,
        {
            "gate_up": {"style": "colwise", "fused": 2},
            "down": "rowwise",
            "down_packed": {"style": "rowwise", "fused": 2},
        },
    ),
    "mla_kv_a_proj": (
        LatentAttention,
        {"q_proj": "colwise", "kv_a_proj_with_mqa": "mla_kv_a_proj", "kv_b_proj": "colwise", "o_proj": "rowwise"},
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(STYLE_CASES))
def test_tp2_style_matches_single_process(case):
    build, plan = STYLE_CASES[case]
    assert_tp2_matches_single_process(build, lm_loss, plan)


def _without_grad_sum_worker(rank, world, build, plan):
    apply = sys.modules["lightning_parallel.tensor_parallel.apply"]  # this forked process only
    apply.sum_grads_over_tp = apply.split_rope_grad_sum = lambda *args: None
    torch.manual_seed(0)
    full = build()
    tp = copy.deepcopy(full)
    parallelize(tp, make_mesh(rank, world, tp=world), plan)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    lm_loss(full, ids).backward()
    lm_loss(tp, ids).backward()
    expected = dict(full.named_parameters())
    replicated = [(n, p) for n, p in tp.named_parameters() if not hasattr(p, "tp_shard")]
    return [(n, torch.allclose(p.grad, expected[n].grad, atol=1e-6)) for n, p in replicated]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,module", [("replicated_grad_sum", "norm"), ("mla_kv_a_proj", "kv_a_proj_with_mqa")])
def test_without_the_grad_sum_the_replicated_gradient_is_partial(case, module):
    """The control: with the style's sum switched off, the same module's gradient is wrong."""
    build, plan = STYLE_CASES[case]
    verdicts = dict(run_distributed(_without_grad_sum_worker, 2, build, plan)[0])
    assert not verdicts[f"{module}.weight"]


# ---- Hugging Face models whose own plans use these styles ----------------------------------------
class HF(nn.Module):
    """A tiny Hugging Face causal LM, built from ``config_name`` with the given sizes."""

    def __init__(self, config_name: str, **sizes):
        super().__init__()
        import transformers

        defaults = dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, use_cache=False, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
        config = getattr(transformers, config_name)(**{**defaults, **sizes})
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def forward(self, ids):
        return self.model(input_ids=ids).logits


HF_CASES = {
    "qwen3_q_norm_k_norm": ("Qwen3Config", dict(head_dim=8)),
    "phi3_fused_qkv_and_gate_up": ("Phi3Config", dict(attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    "gemma_scaled_embedding": ("GemmaConfig", dict(head_dim=8)),
    "granite_swa_local_params_sinks": ("GraniteSWAConfig", dict(head_dim=8)),
    "beam_local_params_gate_bias": ("BeamConfig", dict(head_dim=8)),
    "inkling_moe_experts_from_its_ep_plan": (
        "InklingTextConfig",
        dict(head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, moe_intermediate_size=16,
             n_routed_experts=4, num_experts_per_tok=2, sliding_window_size=8, rel_extent=16),
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(HF_CASES))
def test_tp2_hf_model_with_its_own_plan_matches_single_process(case):
    name, sizes = HF_CASES[case]
    assert_tp2_matches_single_process(lambda: HF(name, **sizes), lm_loss)


def _sliced_params_worker(rank, world, name, sizes):
    model = HF(name, **sizes)
    with redirect_stdout(io.StringIO()):
        parallelize(model, make_mesh(rank, world, tp=world))
    return {n: tuple(p.shape) for n, p in model.named_parameters() if hasattr(p, "tp_shard")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,param,full", [
    ("granite_swa_local_params_sinks", "self_attn.sinks", (4,)),
    ("inkling_moe_experts_from_its_ep_plan", "mlp.experts.down_proj", (4, 32, 16)),
])
def test_local_params_and_all_reduce_keep_only_this_ranks_slice_of_the_named_parameters(case, param, full):
    """The parity above holds because each rank trains its slice: the named bare parameters are cut in two."""
    shapes = run_distributed(_sliced_params_worker, 2, *HF_CASES[case])[0]
    dim = 0 if len(full) == 1 else len(full) - 1
    expected = tuple(n // 2 if i == dim else n for i, n in enumerate(full))
    assert shapes[f"model.model.layers.0.{param}"] == expected


def test_all_reduce_with_a_parameter_left_whole_is_refused():
    """Every rank adds its output to the sum: a whole parameter would count once per rank."""
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Parameter(torch.randn(8, 4))
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return (x @ self.up.T) @ self.up * self.scale

    model = nn.Module()
    model.shared = Shared()
    plan = {"shared": {"style": "all_reduce", "params": {"up": 0}}}
    with pytest.raises(TensorParallelError, match=r"all_reduce.*left whole: \['scale'\]"):
        parallelize(model, ParallelMesh(2, tensor_parallel=2), plan)


# ---- communication: Megatron's pairing wherever the model's code allows it -----------------------
@contextmanager
def counted_collectives(log: list):
    """Record (op, elements) of every TP collective while the block runs."""
    all_reduce, gather = dist.all_reduce, comm._gather_into

    def counted_all_reduce(t, *a, **k):
        log.append(("all_reduce", t.numel()))
        return all_reduce(t, *a, **k)

    def counted_gather(out, inp, *a, **k):
        log.append(("all_gather", out.numel()))
        return gather(out, inp, *a, **k)

    dist.all_reduce, comm._gather_into = counted_all_reduce, counted_gather
    try:
        yield
    finally:
        dist.all_reduce, comm._gather_into = all_reduce, gather


def _mlp_collectives_worker(rank, world, config_name):
    torch.manual_seed(0)
    model = HF(config_name, **HF_CASES["phi3_fused_qkv_and_gate_up"][1])
    with redirect_stdout(io.StringIO()):
        parallelize(model, make_mesh(rank, world, tp=world))
    mlp = model.model.model.layers[0].mlp
    forward, backward = [], []
    with counted_collectives(forward):
        y = mlp(torch.randn(2, 8, 32, requires_grad=True))
    with counted_collectives(backward):
        y.sum().backward()
    return forward, backward


@pytest.mark.timeout(60)
def test_phi3_fused_gate_up_mlp_does_one_all_reduce_each_way():
    """Phi-3's own plan gathers ``gate_up_proj`` and splits ``down_proj``'s input again; its code
    splits the two halves with ``chunk(2)``, so each half is split on its own instead."""
    forward, backward = run_distributed(_mlp_collectives_worker, 2, "Phi3Config")[0]
    bsh = 2 * 8 * 32
    assert forward == [("all_reduce", bsh)] and backward == [("all_reduce", bsh)]


# ---- refusals ----------------------------------------------------------------------------------
class ScaledTwice(nn.Embedding):
    def forward(self, ids):
        return torch.tanh(super().forward(ids))


def _refusal_worker(rank, world, build, plan):
    try:
        parallelize(build(), make_mesh(rank, world, tp=world), plan)
    except TensorParallelError as e:
        return str(e)
    return None


class PerHeadWeights(HeadNormAttentionish):
    """A norm with one weight per head (Cohere's q_norm): it would have to be split by head."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm((4, self.head_dim))


@pytest.mark.timeout(60)
def test_a_module_of_unknown_shape_between_split_layers_is_refused_on_every_rank():
    messages = run_distributed(_refusal_worker, 2, PerHeadWeights, {"q": "colwise", "o": "rowwise"})
    assert messages[0] == messages[1] and messages[0].startswith("norm (LayerNorm)")


@pytest.mark.timeout(60)
def test_an_embedding_with_its_own_forward_is_refused_on_every_rank():
    messages = run_distributed(_refusal_worker, 2, lambda: nn.Sequential(ScaledTwice(VOCAB, 8)), {"0": "vocab"})
    assert messages[0] == messages[1] and "ScaledTwice" in messages[0] and "drop '0'" in messages[0]


# ---- dropout under activation checkpointing ----------------------------------------------------
def _checkpoint_grads_worker(rank, world, sequence_parallel, model_code_dropout=False):
    mesh = make_mesh(rank, world, tp=world)
    torch.manual_seed(0)
    if model_code_dropout:  # F.dropout in the model's own forward, between split layers
        block, plan = DropoutInsideSplitRegion(), {"up": "colwise", "down": "rowwise"}
    else:
        block = Block(n_embd=16, n_head=4, dropout=0.1)
        plan = {"attn": "attention", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}
    parallelize(block, mesh, plan, sequence_parallel)
    x = torch.randn(2, 8 // world if sequence_parallel else 8, 16, generator=torch.Generator().manual_seed(rank))
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(1234)
        y = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        y.square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in block.named_parameters()})
        block.zero_grad()
    return grads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sequence_parallel,model_code_dropout", [(False, False), (True, False), (False, True)])
def test_checkpointed_tp2_block_with_dropout_has_the_gradients_of_the_plain_one(sequence_parallel, model_code_dropout):
    """Recomputation replays the per-rank dropout masks, so checkpointing changes no gradient."""
    results = run_distributed(_checkpoint_grads_worker, 2, sequence_parallel, model_code_dropout)
    for plain, checkpointed in results:
        for name, g in plain.items():
            torch.testing.assert_close(checkpointed[name], g, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _split_region_masks_worker(rank, world):
    mesh = make_mesh(rank, world, tp=world)
    torch.manual_seed(0)
    model = DropoutInsideSplitRegion()
    parallelize(model, mesh, {"up": "colwise", "down": "rowwise"})
    seen = []
    model.down.register_forward_pre_hook(lambda m, args: seen.append(args[0] == 0))
    torch.manual_seed(1234)
    y = model(torch.ones(4, 16))
    masks = [torch.empty_like(seen[0]) for _ in range(world)]
    outputs = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(masks, seen[0], group=mesh.tp_group)
    dist.all_gather(outputs, y.detach(), group=mesh.tp_group)
    return torch.equal(masks[0], masks[1]), torch.equal(outputs[0], outputs[1])


@pytest.mark.timeout(60)
def test_dropout_in_model_code_between_split_layers_draws_per_rank_masks():
    """Between ``up`` (colwise) and ``down`` (rowwise) each rank holds other features, so their
    masks must differ; after ``down`` the activation is replicated, so its mask must not."""
    same_split_mask, same_output = run_distributed(_split_region_masks_worker, 2)[0]
    assert not same_split_mask and same_output

