"""Expert parallelism through Lightning: unchanged LightningModules around tiny Hugging Face MoE models
(Mixtral; Qwen3-MoE; DeepSeek-V3 with a shared expert beside the routed ones) train, step by step, to the
losses and parameters of one device at DP2 x EP2 (each of 2 ranks holds 2 of the 4 experts of every
layer), DP4 x EP2 (experts also replicated over 2 replicas), and TP2 x DP2 x EP2; including a run where
the router sends every token to experts 0 and 1, so the other rank's experts receive no token, and
models built on the meta device (with and without expert parallelism, with TP).

Tolerance: float32 on CPU. The combine sums each token's expert outputs in another order than the
original module, and expert gradients are summed over ranks (1e-7 relative per op); losses are compared
at 1e-5 and parameters at 1e-4 after AdamW steps of lr 1e-2 (every element moves by about lr per step,
so an expert computed on the wrong tokens or a gradient off by the data-parallel factor is off by ~1e-2,
a hundred times the tolerance).
"""

import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_parallel.strategy import ParallelStrategy
from tests.helpers.parity import (
    TensorDataset,
    assert_close_series,
    assert_params_close,
    fit_and_record,
    mean_over_ranks,
)

SEQ, VOCAB, STEPS = 8, 64, 3
LOSS_TOL = dict(atol=1e-5, rtol=1e-5)
PARAM_TOL = dict(atol=1e-4, rtol=1e-4)
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=4 * SEQ, tie_word_embeddings=False)


def moe_config(family: str):
    import transformers

    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **SIZES)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                           num_experts_per_tok=2, decoder_sparse_step=1, head_dim=8, **SIZES)
    if family == "deepseek_v3":  # routed experts and one shared expert (MLA attention, first layer dense)
        return transformers.DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **{**SIZES, "num_key_value_heads": 4})
    raise ValueError(family)


def route_to_first_two(router, args, out):
    """The router's (logits, weights, experts) with every token's experts replaced by 0 and 1."""
    logits, weights, experts = out
    return logits, weights, torch.tensor([0, 1]).expand_as(experts)


class MoELM(L.LightningModule):
    """A user's module: a tiny Hugging Face MoE causal LM, loss on all tokens (no auxiliary loss)."""

    def __init__(self, family: str = "mixtral", only_two_experts: bool = False, sgd: bool = False,
                 checkpointing: bool = False) -> None:
        super().__init__()
        self.sgd = sgd
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(moe_config(family))
        if checkpointing:  # blocks recomputed in backward: their all-to-alls run again, inside backward
            self.model.gradient_checkpointing_enable({"use_reentrant": False})
        if only_two_experts:  # experts 0 and 1 take every token: 2 and 3 (rank 1's at EP2) receive none
            for module in self.model.modules():
                if type(module).__name__.lower().endswith("topkrouter"):
                    module.register_forward_hook(route_to_first_two)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.sgd:  # the step is the gradient itself: a gradient's scale shows in the parameters
            return torch.optim.SGD(self.parameters(), lr=10.0)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)


def whole_experts(module, mesh) -> dict:
    """Every parameter as one device holds it: experts gathered over the expert-parallel group (by global id)
    and TP shards over the TP group (collectives)."""
    from lightning_parallel.tensor_parallel import gather_full_tensor

    out = {}
    for name, p in module.named_parameters():
        t = gather_full_tensor(p, p.tp_shard, mesh) if hasattr(p, "tp_shard") else p.detach().clone()
        if hasattr(p, "expert_shard"):
            parts = [torch.empty_like(t) for _ in range(mesh.ep_size)]
            dist.all_gather(parts, t.contiguous(), group=mesh.ep_group)
            t = torch.cat(parts)
        out[name] = t
    return out


class Record(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.tokens = out_dir, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tokens.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("tokens_per")})

    def on_train_end(self, trainer, pl_module):
        local = {n: tuple(p.shape) for n, p in pl_module.named_parameters() if hasattr(p, "expert_shard")}
        torch.save({"params": whole_experts(pl_module, trainer.strategy.mesh), "tokens": self.tokens, "local": local},
                   os.path.join(self.out_dir, f"whole{trainer.global_rank}.pt"))


def tokens(samples: int = 16) -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(1)))


def assert_matches_one_device(tmp_path, dp: int, ep: int, tp: int = 1, family: str = "mixtral",
                              only_two_experts: bool = False, sgd: bool = False, param_tol: dict = PARAM_TOL,
                              checkpointing: bool = False, zero_stage: int = 0, meta: bool = False,
                              **trainer) -> list:
    L.seed_everything(0)
    module, data = MoELM(family, only_two_experts, sgd, checkpointing), tokens()
    expected = fit_and_record(module, data, 2 * dp, str(tmp_path / "one"), max_steps=STEPS, emulate_replicas=dp,
                              **trainer)[0]
    out = tmp_path / "ep"
    strategy = ParallelStrategy(expert_parallel=ep, tensor_parallel=tp, zero_stage=zero_stage, start_method="fork")
    if meta:  # built on the meta device from the same seed: construction is replayed with the same values
        def build(fitting):
            L.seed_everything(0)
            with fitting.init_module(empty_init=True):
                built = MoELM(family, only_two_experts, sgd, checkpointing)
            assert any(p.is_meta for p in built.parameters())
            return built
    got = fit_and_record(build if meta else module, data, 2, str(out), devices=dp * tp, max_steps=STEPS,
                         strategy=strategy, callbacks=[Record(str(out))], **trainer)
    assert_close_series(mean_over_ranks(got), expected["losses"], **LOSS_TOL)
    records = [torch.load(out / f"whole{rank}.pt") for rank in range(dp * tp)]
    for rank, record in enumerate(records):
        assert set(record["params"]) == set(expected["params"])
        assert_params_close(record["params"], expected["params"], **param_tol)
    return records


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_dp2_ep2_matches_single_device(tmp_path, family):
    records = assert_matches_one_device(tmp_path, dp=2, ep=2, family=family)
    # tokens per expert: all ranks' assignments (2 layers routed for Mixtral/Qwen, 1 for DeepSeek), every step
    layers = 1 if family == "deepseek_v3" else 2
    for record in records:
        assert len(record["tokens"]) == STEPS
        for step in record["tokens"]:
            assert sum(v for k, v in step.items() if k[-1].isdigit()) == 2 * 2 * SEQ * 2 * layers
            assert step["tokens_per_expert/imbalance"] >= 1.0


@pytest.mark.timeout(120)
def test_ep2_expert_without_tokens_matches_single_device(tmp_path):
    records = assert_matches_one_device(tmp_path, dp=2, ep=2, only_two_experts=True)
    for step in records[0]["tokens"]:
        assert step["tokens_per_expert/2"] == step["tokens_per_expert/3"] == 0


@pytest.mark.timeout(120)
def test_ep2_with_activation_checkpointing_matches_single_device(tmp_path):
    assert_matches_one_device(tmp_path, dp=2, ep=2, family="qwen3_moe", checkpointing=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp,ep,tp", [(2, 2, 1), (2, 2, 2), (1, 1, 2)])
def test_moe_model_built_on_the_meta_device_matches_single_device(tmp_path, dp, ep, tp):
    # lp-train's default build: each rank materialises the experts of its TP shard (TP splits the experts
    # module's parameters in place: they are replayed whole, then cut once), then keeps its own experts
    records = assert_matches_one_device(tmp_path, dp=dp, ep=ep, tp=tp, meta=True)
    experts = 4 // ep
    assert records[0]["local"].get("model.model.layers.0.mlp.experts.down_proj", (4,))[0] == experts


@pytest.mark.timeout(120)
def test_dp4_ep2_matches_single_device(tmp_path):
    # each expert on two replicas: its gradient summed over them, divided by all four
    assert_matches_one_device(tmp_path, dp=4, ep=2)


@pytest.mark.timeout(120)
def test_tp2_dp2_ep2_matches_single_device(tmp_path):
    # every expert split over the TP pair by its intermediate features, whole experts over the EP pair
    records = assert_matches_one_device(tmp_path, dp=2, ep=2, tp=2)
    for record in records:  # 2 of 4 experts, half of each expert's 32 intermediate features
        assert record["local"]["model.model.layers.0.mlp.experts.gate_up_proj"] == (2, 32, 32)
        assert record["local"]["model.model.layers.0.mlp.experts.down_proj"] == (2, 32, 16)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp,zero_stage", [(2, 0), (4, 0), (4, 1)])
def test_ep2_with_clipping_and_accumulation_matches_single_device(tmp_path, dp, zero_stage):
    # the global norm sums the experts' squares over the EP ranks; accumulation holds both synchronizers back.
    # SGD (lr 10): each step is 10x the clipped gradient, ~1e-3 per element, so a norm missing the other
    # rank's experts (a coefficient off by a few %) is off by ~1e-5, ten times the tolerance of 1e-6
    assert_matches_one_device(tmp_path, dp=dp, ep=2, sgd=True, param_tol=dict(atol=1e-6, rtol=1e-5),
                              zero_stage=zero_stage, gradient_clip_val=0.05, accumulate_grad_batches=2)


@pytest.mark.timeout(120)
def test_ep2_with_zero1_matches_single_device(tmp_path):
    # ZeRO-1 shards the dense parameters' optimizer state over DP; the experts' stays whole on their ranks
    assert_matches_one_device(tmp_path, dp=4, ep=2, zero_stage=1)
