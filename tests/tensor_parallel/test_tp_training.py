"""Training parity: a model sharded by ``parallelize`` trains, step by step, to the losses and
parameters of the same model on one process (same seed, same data, AdamW).

Tolerance: float32 on CPU. Sharding reorders the sums inside matmuls and all-reduces (~1e-7
relative per op); a few AdamW steps normalise gradients by their running RMS, which can amplify
such differences on elements whose gradient is near zero (observed: ~1e-5 on one element in
thousands). Losses are compared at rtol 1e-5 / atol 1e-6 and parameters at rtol 1e-4 / atol 1e-4:
an AdamW step moves every element by about lr = 1e-2 whatever its gradient, so a wrong shard or a
missing reduction is off by ~1e-2, a hundred times the tolerance.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.models.gpt import GPT
from lightning_parallel.strategy import ParallelStrategy
from lightning_parallel.tensor_parallel import parallelize, sync_sequence_parallel_grads
from tests.helpers.parity import assert_param_close, full_parameters
from tests.helpers.processes import make_mesh, run_distributed

LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=1e-4)
STEPS, BATCH, SEQ, VOCAB = 4, 4, 16, 64


def tiny_gpt() -> nn.Module:
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)


def gpt_loss(model, x, y):
    return model._loss((x, y))


class TinyLlama(nn.Module):
    """A Hugging Face Llama with grouped KV heads (4 query heads, 2 KV heads), random init."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
        )
        self.model = LlamaForCausalLM(config)


def hf_causal_lm_loss(model, x, y):
    return model.model(input_ids=x, labels=x).loss


class TinyGPT2(nn.Module):
    """A Hugging Face GPT-2 (Conv1D layers, fused QKV, tied head): no plan of its own, built-in table."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_embd=32,
            n_head=4,
            n_layer=2,
            vocab_size=VOCAB,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.model = GPT2LMHeadModel(config)


class EncoderLM(nn.Module):
    """A causal language model built from nn.TransformerEncoderLayer (nn.MultiheadAttention inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)


def encoder_loss(model, x, y):
    mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
    logits = model.head(model.encoder(model.embed(x), mask=mask, is_causal=True))
    return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))


MODELS = {
    "gpt": (tiny_gpt, gpt_loss),
    "llama": (TinyLlama, hf_causal_lm_loss),
    "gpt2": (TinyGPT2, hf_causal_lm_loss),
    "encoder": (EncoderLM, encoder_loss),
}


def batches():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def train(model_name, mesh=None, sequence_parallel=False):
    """Per-step losses and final full parameters; with a mesh, the batch is split over DP."""
    build, loss_fn = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    if mesh is not None:
        parallelize(model, mesh, sequence_parallel=sequence_parallel)
    # eps=1e-6: a key bias has an exactly zero true gradient (softmax ignores a constant added to
    # every key logit), and with the default 1e-8 AdamW would blow its ~1e-10 float noise up to
    # steps of size lr, differently on each layout.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    dp = mesh.dp_size if mesh else 1
    losses = []
    for x, y in batches():
        if mesh is not None:
            x, y = x.chunk(dp)[mesh.dp_rank], y.chunk(dp)[mesh.dp_rank]
        loss = loss_fn(model, x, y)
        loss.backward()
        if mesh is not None and dp > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=mesh.dp_group)
                p.grad /= dp
            dist.all_reduce(loss := loss.detach().clone(), group=mesh.dp_group)
            loss /= dp
        if sequence_parallel:
            sync_sequence_parallel_grads(model, mesh)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_parameters(model, mesh)


def _worker(rank, world, model_name, tp, sequence_parallel):
    mesh = make_mesh(rank, world, tp=tp)
    losses, params = train(model_name, mesh, sequence_parallel)
    return losses, {n: p.numpy() for n, p in params.items()}  # numpy: tensors would travel as shared fds


def assert_matches_single_process(model_name, world, tp, sequence_parallel=False):
    expected_losses, expected_params = train(model_name)
    results = run_distributed(_worker, world, model_name, tp, sequence_parallel, timeout=90)
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **LOSS_TOL)
        assert params.keys() == expected_params.keys()
        for name, p in params.items():
            assert_param_close(torch.from_numpy(p), expected_params[name], **PARAM_TOL, name=name)
    # replicated parameters (LayerNorm gains, row-parallel biases) stay bit-identical across ranks
    for _, params in results[1:]:
        for name, p in params.items():
            assert (p == results[0][1][name]).all(), f"{name} drifted apart across ranks"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_gpt_matches_single_process(sequence_parallel):
    assert_matches_single_process("gpt", 2, 2, sequence_parallel)


@pytest.mark.timeout(60)
def test_tp4_gpt_matches_single_process():
    assert_matches_single_process("gpt", 4, 4)


@pytest.mark.timeout(60)
def test_tp2_dp2_gpt_matches_single_process():
    assert_matches_single_process("gpt", 4, 2)


@pytest.mark.timeout(60)
def test_tp2_hf_llama_with_grouped_kv_heads_matches_single_process():
    assert_matches_single_process("llama", 2, 2)


@pytest.mark.timeout(60)
def test_tp2_hf_gpt2_with_conv1d_and_tied_head_matches_single_process():
    assert_matches_single_process("gpt2", 2, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [2, 4])
def test_transformer_encoder_model_matches_single_process(tp):
    assert_matches_single_process("encoder", tp, tp)


# ---- through Lightning's Trainer and ParallelStrategy -----------------------------------------


class LlamaModule(L.LightningModule):
    """A user's LightningModule around a tiny HF Llama (hidden 64, 4 heads, 2 KV heads, vocab 128)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_hidden_layers=2,
                vocab_size=128,
                max_position_embeddings=SEQ,
            )
        )

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)  # eps: see train()


class Record(Callback):
    """Per-step losses, then the full parameters (gathered over TP) saved by rank 0."""

    def __init__(self, path) -> None:
        self.path, self.losses = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def on_train_end(self, trainer, pl_module):
        params = full_parameters(pl_module, getattr(trainer.strategy, "mesh", None))
        if trainer.global_rank == 0:
            torch.save({"losses": self.losses, "params": params}, self.path)


def fit(build, path, strategy=None):
    L.seed_everything(0)
    model = build()
    vocab = 128 if isinstance(model, LlamaModule) else VOCAB
    data = torch.randint(0, vocab, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2 if strategy else 1,
        strategy=strategy or "auto",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record(path)],
        # Lightning's distributed sampler always shuffles training data; with one replica (dp=1)
        # every TP rank must read the batches in the single-device order instead
        use_distributed_sampler=False,
    )
    trainer.fit(model, loader)
    return torch.load(path)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "build",
    [lambda: GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32), LlamaModule],
    ids=["gpt", "hf_llama"],
)
def test_trainer_with_tp2_strategy_matches_single_device(build, tmp_path):
    expected = fit(build, tmp_path / "single.pt")
    got = fit(build, tmp_path / "tp2.pt", ParallelStrategy(tensor_parallel=2, start_method="fork"))
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), **LOSS_TOL)
    assert got["params"].keys() == expected["params"].keys()
    for name, p in got["params"].items():
        assert_param_close(p, expected["params"][name], **PARAM_TOL, name=name)
