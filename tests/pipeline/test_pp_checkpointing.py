"""Activation checkpointing inside pipeline stages: recomputed blocks see the stage's real input."""

import warnings

import pytest
import torch
import torch.utils.checkpoint as checkpoint

from lightning_parallel.models.gpt import GPT
from tests.helpers.processes import make_mesh, run_distributed
from tests.pipeline.test_pp_training import (
    assert_matches,
    batches,
    llama,
    single_device,
    train_pipeline,
)


class CheckpointedGPT(GPT):
    """nanoGPT-style forward that checkpoints every block, as users write it."""

    reentrant = False

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.lm_head(self.transformer.ln_f(x))


def checkpointed_gpt():
    torch.manual_seed(0)
    return CheckpointedGPT(n_layer=8, n_embd=32, n_head=2, block_size=16)


def _counting(make_model, counted):
    """``make_model`` whose block ``counted`` counts the calls of its MLP (forward + recomputation)."""
    calls = []

    def build():
        model = make_model()
        blocks = model.transformer.h if hasattr(model, "transformer") else model.model.model.layers
        blocks[counted].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        return model

    return build, calls


def _checkpointed(rank, world, make_model, vocab):
    warnings.filterwarnings("ignore")
    build, calls = _counting(make_model, counted=-1)
    result = train_pipeline(make_mesh(rank, world, pp=world), build, batches(vocab=vocab), 4, "1f1b")
    return result, len(calls)


@pytest.mark.timeout(60)
def test_checkpointed_blocks_recompute_on_their_stage_and_match_single_device():
    results = run_distributed(_checkpointed, 2, checkpointed_gpt, 256)
    assert_matches(single_device(checkpointed_gpt, batches()), [r for r, _ in results])
    # the last block lives on the last stage: 3 steps x 4 micro-batches, each run forward and again in backward
    assert results[1][1] >= 2 * 3 * 4


def checkpointed_llama():
    model = llama()
    model.model.gradient_checkpointing_enable()
    model.train()
    return model


@pytest.mark.timeout(60)
def test_hugging_face_gradient_checkpointing_matches_single_device_at_pp2():
    results = run_distributed(_checkpointed, 2, checkpointed_llama, 128)
    assert_matches(single_device(llama, batches(vocab=128)), [r for r, _ in results])
    assert results[1][1] >= 2 * 3 * 4


class ReentrantGPT(CheckpointedGPT):
    reentrant = True


def _reentrant(rank, world):
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    try:
        train_pipeline(make_mesh(rank, world, pp=world), lambda: ReentrantGPT(n_layer=8, n_embd=32, n_head=2,
                                                                              block_size=16), batches(), 4, "1f1b")
    except Exception as error:  # noqa: BLE001 - the message is what is tested
        return str(error)
    return ""


@pytest.mark.timeout(60)
def test_reentrant_checkpointing_is_refused_with_the_setting_that_works():
    messages = run_distributed(_reentrant, 2)
    assert any("use_reentrant=False" in m for m in messages)
