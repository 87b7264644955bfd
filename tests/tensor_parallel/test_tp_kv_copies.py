"""Tensor parallelism past the key/value heads: each rank holds a copy of the KV head its query heads use.

Parity is against one process, same seed, same batches, AdamW (lr 1e-2), within the documented float32
bound (``tests/helpers/parity.py``: LOSS_BOUND, PARAM_BOUND). A copy whose gradient were not summed over
the ranks sharing it would hold only its own query heads' part: the key/value weights then move by
O(lr) = 1e-2 per step, a hundred times the bound (measured: 0.03 after three steps).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_parallel.checkpoint.chunks import tp_chunks
from lightning_parallel.checkpoint.format import global_shape, local_shape
from lightning_parallel.checks.share import planned_share
from lightning_parallel.tensor_parallel import parallelize
from lightning_parallel.tensor_parallel.detect import detect_plan
from lightning_parallel.tensor_parallel.plan import parse_plan
from lightning_parallel.tensor_parallel.resolve import resolve_plan
from lightning_parallel.tensor_parallel.shard import TPShard, merge_shards, slice_shard
from tests.helpers.parity import (
    LOSS_BOUND,
    PARAM_BOUND,
    assert_close_series,
    assert_param_close,
    assert_params_close,
    full_parameters,
    mean_over_ranks,
)
from tests.helpers.processes import make_mesh, run_distributed

STEPS, BATCH, SEQ, VOCAB = 3, 2, 12, 48


def causal_lm(arch: str, heads: int, kv_heads: int, head_dim: int = 8, layers: int = 2):
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),  # q/k/v biases: sliced and summed too
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[arch]
    torch.manual_seed(0)
    # mixtral: 2 experts, fewer than the TP ranks too; every expert is split over all of them
    experts = dict(num_local_experts=2, num_experts_per_tok=1, router_jitter_noise=0.0) if arch == "mixtral" else {}
    config = config_cls(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=48, head_dim=head_dim,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers,
                        max_position_embeddings=SEQ, **experts)
    return model_cls(config)


def train(model, mesh=None):
    if mesh is not None:
        parallelize(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def with_lora(model):
    """PEFT LoRA on q/k/v (B starts non-zero, so the adapters count from the first step), under eager
    attention, which repeats each local KV head by the stored ``num_key_value_groups``."""
    from peft import LoraConfig, get_peft_model

    model.set_attn_implementation("eager")
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj"])
    return get_peft_model(model, config)


def _worker(rank, world, arch, heads, kv_heads, lora=False):
    model = causal_lm(arch, heads, kv_heads)
    model = with_lora(model) if lora else model
    losses = train(model, make_mesh(rank, world, tp=world))
    attention = model.get_decoder().layers[0].self_attn
    if lora:
        return losses, {n: p.numpy() for n, p in full_parameters(model, make_mesh(rank, world, tp=world)).items()}, \
            {"groups": attention.num_key_value_groups}
    local = {"k_proj": tuple(attention.k_proj.weight.shape), "groups": attention.num_key_value_groups,
             "k_copy": attention.k_proj.weight.detach().clone(), "held": sum(p.numel() for p in model.parameters())}
    full = {n: p.numpy() for n, p in full_parameters(model, make_mesh(rank, world, tp=world)).items()}
    return losses, full, local


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch, heads, kv_heads, tp", [("qwen2", 4, 1, 2), ("llama", 4, 2, 4), ("mixtral", 4, 1, 4)],
                         ids=["qwen2_tp2_one_kv_head", "llama_tp4_two_kv_heads", "mixtral_tp4_one_kv_head_two_experts"])
def test_tp_past_the_kv_heads_matches_single_process(arch, heads, kv_heads, tp):
    expected_losses = train(single := causal_lm(arch, heads, kv_heads))
    expected = {n: p.detach() for n, p in single.named_parameters()}
    results = run_distributed(_worker, tp, arch, heads, kv_heads, timeout=100)
    copies = tp // kv_heads
    unsplit = causal_lm(arch, heads, kv_heads)
    planned = planned_share(unsplit, _resolve(unsplit, tp), tp, None)  # what the launch checks report
    for rank, (losses, params, local) in enumerate(results):
        assert local["held"] == planned.largest
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=0, atol=LOSS_BOUND)
        for name, p in params.items():
            assert_param_close(torch.from_numpy(p), expected[name], atol=PARAM_BOUND, name=name)
        # one KV head per rank, the one its query heads use; the attention sees one local KV head
        assert local["k_proj"] == (8, heads * 8) and local["groups"] == heads // tp
        kv_head = rank // copies
        assert torch.equal(local["k_copy"], slice_shard(torch.from_numpy(params["model.layers.0.self_attn.k_proj.weight"]),
                                                        TPShard(dim=0), kv_head, kv_heads))
        # the ranks sharing a head hold the same bits after training
        assert torch.equal(local["k_copy"], results[kv_head * copies][2]["k_copy"])


@pytest.mark.timeout(120)
def test_lora_adapters_on_copied_kv_projections_match_single_process():
    expected_losses = train(single := with_lora(causal_lm("qwen2", 4, 1)))
    expected = {n: p.detach() for n, p in single.named_parameters()}
    for losses, params, local in run_distributed(_worker, 2, "qwen2", 4, 1, True, timeout=100):
        assert local["groups"] == 2  # 2 local query heads over the one KV head's copy
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=0, atol=LOSS_BOUND)
        for name, p in params.items():
            assert_param_close(torch.from_numpy(p), expected[name], atol=PARAM_BOUND, name=name)


def test_copied_shards_cut_merge_and_save_each_head_once():
    """A KV projection over 2 heads on TP4: ranks 0,1 hold head 0 and ranks 2,3 head 1; merging reads
    one copy of each; the checkpoint chunks of the copies coincide, so DCP writes each once, in the
    unsplit shape, which any TP size reads back."""
    full = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)  # 2 heads of size 2, 3 input features
    shard = TPShard(dim=0, replicas=2)
    shards = [slice_shard(full, shard, r, 4) for r in range(4)]
    assert torch.equal(shards[0], full[:2]) and torch.equal(shards[1], full[:2]) and torch.equal(shards[3], full[2:])
    assert torch.equal(merge_shards(shards, shard), full)
    assert global_shape(shards[0].shape, shard, 4) == (4, 3) and local_shape((4, 3), shard, 4) == (2, 3)
    chunks = [tp_chunks((4, 3), shard, r, 4) for r in range(4)]
    assert chunks[0] == chunks[1] and chunks[2] == chunks[3]
    assert [c.offsets for c in chunks[0] + chunks[2]] == [(0, 0), (2, 0)]


def test_pretrained_file_reads_give_each_rank_its_copy(tmp_path):
    """``from_pretrained`` under empty initialisation reads each rank's part straight from the file: the
    copy ``slice_shard`` cuts, for a weight and a bias."""
    from safetensors.torch import save_file

    from lightning_parallel.checkpoint.pretrained import read_header, read_shard

    full = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    save_file(full, tmp_path / "m.safetensors")
    header = read_header(str(tmp_path / "m.safetensors"))
    for name, tensor in full.items():
        for rank in range(4):
            shard = TPShard(dim=0, replicas=2)
            assert torch.equal(read_shard(header[name], shard, rank, 4), slice_shard(tensor, shard, rank, 4))


def _resolve(model, tp, plan=None):
    return resolve_plan(model, parse_plan(plan) if plan else detect_plan(model), tp, False)


def test_kv_projections_are_found_in_the_models_plan_and_in_a_plan_a_user_writes():
    model = causal_lm("llama", 4, 1, layers=1)
    heads = {a.name: a.entry.heads for a in _resolve(model, 4)}
    assert heads["model.layers.0.self_attn.k_proj"] == heads["model.layers.0.self_attn.v_proj"] == 1
    assert heads["model.layers.0.self_attn.q_proj"] == 0 and heads["model.layers.0.mlp.up_proj"] == 0
    written = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
               "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
    assert {a.name: a.entry.heads for a in _resolve(model, 2, written)}["model.layers.0.self_attn.v_proj"] == 1


def test_a_plan_detected_from_structure_copies_the_kv_head_instead_of_dividing_its_stored_count():
    """StableLM carries no plan: detection divides the head counts its attention stores; past its one KV
    head, ``num_key_value_heads`` is left for the split to set to the one local copy."""
    import transformers

    config = transformers.StableLmConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=1)
    model = transformers.StableLmForCausalLM(config)
    found = {a.name: a.entry for a in _resolve(model, 4)}
    assert found["model.layers.0.self_attn.k_proj"].heads == 1 and found["model.layers.0.self_attn.q_proj"].heads == 0
    assert "num_key_value_heads" not in found["model.layers.0.self_attn"].divide
    assert "num_heads" in found["model.layers.0.self_attn"].divide



class OneKVHeadLM(L.LightningModule):
    """A user's module around a Hugging Face Llama with 4 query heads over one KV head."""

    def __init__(self) -> None:
        super().__init__()
        from tests.checkpoint.test_checkpoint import VOCAB as CKPT_VOCAB

        self.model = causal_lm("llama", 4, 1)
        self.model.resize_token_embeddings(CKPT_VOCAB)
        torch.manual_seed(0)
        self.model.apply(self.model._init_weights)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)


@pytest.mark.timeout(240)
def test_tp4_checkpoint_of_copied_kv_heads_resumes_on_tp2_and_consolidates_to_the_unsplit_model(tmp_path):
    """Saved on TP4 (four copies of the one KV head), each head is stored once
    under its unsplit name; TP2 resumes it with the uninterrupted run's losses and parameters (the bounds of
    ``tests/checkpoint/test_checkpoint.py``), and lp-consolidate's state dict loads into the unsplit model."""
    from lightning_parallel.checkpoint import consolidate
    from tests.checkpoint.test_checkpoint import HALF, half_run
    from tests.checkpoint.test_checkpoint import train as fit

    reference = fit(tmp_path / "reference", build=OneKVHeadLM)[0]
    checkpoint = half_run(tmp_path / "tp4", devices=4, tp=4, build=OneKVHeadLM)
    unsplit = OneKVHeadLM().state_dict()
    state = consolidate(checkpoint)["state_dict"]
    assert {n: t.shape for n, t in state.items()} == {n: t.shape for n, t in unsplit.items()}
    resumed = fit(tmp_path / "tp2", devices=2, tp=2, ckpt_path=checkpoint, build=OneKVHeadLM)
    assert_close_series(mean_over_ranks(resumed), reference["losses"][HALF:], atol=LOSS_BOUND)
    for record in resumed:  # the TP2 shards are another shape: the replicated parameters (norms)
        assert_params_close(record["params"], reference["params"], atol=PARAM_BOUND,
                            names=lambda n: record["params"][n].shape == reference["params"][n].shape)


@pytest.mark.timeout(120)
def test_clipping_by_the_global_norm_counts_each_kv_head_once(tmp_path):
    """At clip 0.05 every step is clipped; the norm of TP2 counts the one KV head once, not per copy
    (counted twice, the losses move by up to 1.6e-4, sixteen times the bound)."""
    from lightning_parallel import ParallelStrategy
    from tests.checkpoint.test_checkpoint import DATASET
    from tests.helpers.parity import fit_and_record

    clip = dict(max_steps=4, gradient_clip_val=0.05)
    reference = fit_and_record(OneKVHeadLM(), DATASET, 8, str(tmp_path / "one"), emulate_replicas=1, **clip)[0]
    unclipped = fit_and_record(OneKVHeadLM(), DATASET, 8, str(tmp_path / "free"), emulate_replicas=1, max_steps=4)[0]
    assert max(abs(a - b) for a, b in zip(reference["losses"], unclipped["losses"])) > 10 * LOSS_BOUND
    split = fit_and_record(OneKVHeadLM(), DATASET, 8, str(tmp_path / "tp2"), devices=2,
                           strategy=ParallelStrategy(tensor_parallel=2, start_method="fork"), **clip)
    for record in split:
        assert_close_series(record["losses"], reference["losses"], atol=LOSS_BOUND)
