"""The split checked in the first step of a tensor-parallel model (``checks/first_step.py``).

A model whose forward breaks once its layers are sharded is refused in its first step, before any
optimizer step, with a message naming the module; a rank that fails alone ends the run without a hang;
a split that runs but computes other values is refused on every rank. A model that trains under TP
trains exactly as it would without the float64 comparison (bit for bit: the comparison restores the
random generators and runs outside the step, so there is no tolerance to justify).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.checks.first_step import failure
from lightning_parallel.models.gpt import GPT
from lightning_parallel.strategy import ParallelStrategy
from tests.helpers.refusals import RecordingStrategy, Stepped, refusals
from tests.tensor_parallel.test_tp_training import SEQ, STEPS, VOCAB, LlamaModule, fit


class HardCodedWidth(nn.Module):
    """An MLP whose forward reshapes the hidden layer with its full width (4 groups of 16): fine on one
    device, wrong once ``up`` is colwise (each rank holds 32 of the 64 features)."""

    def __init__(self, fail_on_rank: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.fail_on_rank = fail_on_rank

    def forward(self, x):
        h = self.up(x)
        if self.fail_on_rank == -2:  # runs once split, but each rank normalises only its half of the features
            h = torch.nn.functional.rms_norm(h, (h.shape[-1],))
        elif self.fail_on_rank < 0:
            h = h.view(*h.shape[:-1], 4, 16).relu().flatten(-2)
        elif torch.distributed.get_rank() == self.fail_on_rank:  # one rank only, before the all-reduce
            raise RuntimeError(f"rank {self.fail_on_rank} only")
        return self.down(h)


class Regression(L.LightningModule):
    def __init__(self, fail_on_rank: int = -1) -> None:
        super().__init__()
        self.body = HardCodedWidth(fail_on_rank)

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def refused_messages(module: Regression, out: Path, verify_split: bool = False) -> dict[int, str]:
    """Fit ``module`` with TP=2 and return what each rank raised (by rank, where it raised); no optimizer may
    have stepped. The float64 comparison is off unless ``verify_split``."""
    strategy = RecordingStrategy(out, tensor_parallel=2, start_method="fork", timeout=timedelta(seconds=30),
                                 tp_plan={"body.up": "colwise", "body.down": "rowwise"}, verify_split=verify_split)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Stepped(out)])
    with pytest.raises(Exception):
        trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, 4, 32)), batch_size=4))
    assert not list(out.glob("step*")), "an optimizer stepped before the refusal"
    return refusals(out, 2)


@pytest.mark.timeout(90)
def test_forward_that_fails_after_sharding_is_refused_in_the_first_step(tmp_path):
    messages = refused_messages(Regression(), tmp_path)
    assert messages, "no rank raised the refusal"
    for rank, text in messages.items():
        assert f"on rank {rank}: RuntimeError: shape" in text.splitlines()[0]
        assert "(in body, HardCodedWidth; sharded inside it: up colwise, down rowwise)" in text
        assert "leaves body whole" in text and "tensor_parallel=1" in text
        # the model's own line that reads the full width, not a frame of torch or of the strategy
        assert "the model code that fails: test_first_step.py:" in text
        assert "`h = h.view(*h.shape[:-1], 4, 16).relu().flatten(-2)`, which reads a split width" in text


@pytest.mark.timeout(90)
def test_failure_on_one_rank_only_ends_the_run_without_a_hang(tmp_path):
    messages = refused_messages(Regression(fail_on_rank=1), tmp_path)
    assert set(messages) == {1}  # rank 0's all-reduce fails on the closed connection, refused as nothing else
    assert "on rank 1: RuntimeError: rank 1 only" in messages[1].splitlines()[0]


@pytest.mark.timeout(90)
def test_split_that_runs_but_computes_other_values_is_refused_on_every_rank(tmp_path):
    messages = refused_messages(Regression(fail_on_rank=-2), tmp_path, verify_split=True)
    assert set(messages) == {0, 1} and messages[0] == messages[1]
    assert "the split model computes other values than the whole one" in messages[0]
    assert "body (HardCodedWidth)" in messages[0] and "tensor_parallel=1" in messages[0]


def test_refusal_names_the_layout_the_rank_and_the_module_to_leave_whole():
    text = failure("training_step", "E: b (in x.3.y, X)", "x.3.y", tp=4, cp=1, rank=2)
    assert text.startswith("training_step fails once the model's layers are split over tensor_parallel=4 ranks, "
                           "on rank 2: E: b")
    assert "leaves x.*.y whole" in text
    text = failure("validation_step", "E: c", "", tp=1, cp=2, rank=0)
    assert "each sequence is split over context_parallel=2 ranks" in text and "context_parallel=1" in text


def tiny_gpt_with_dropout():  # the comparison must not shift the first step's dropout masks
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, dropout=0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "build, sequence_parallel",
    [(tiny_gpt_with_dropout, False), (tiny_gpt_with_dropout, True), (LlamaModule, False)],
    ids=["gpt", "gpt_sequence_parallel", "hf_llama"],
)
def test_first_step_check_leaves_tp2_training_bit_for_bit_unchanged(build, sequence_parallel, tmp_path):
    def strategy(verify_split):
        return ParallelStrategy(tensor_parallel=2, sequence_parallel=sequence_parallel, start_method="fork",
                                verify_split=verify_split)

    checked = fit(build, tmp_path / "checked.pt", strategy(True))
    plain = fit(build, tmp_path / "plain.pt", strategy(False))
    assert len(checked["losses"]) == STEPS
    assert checked["losses"] == plain["losses"]
    for name, p in checked["params"].items():
        assert torch.equal(p, plain["params"][name]), name


@pytest.mark.timeout(120)
def test_first_step_check_leaves_validation_metrics_unchanged():
    """GPT's ``validation_step`` updates a torchmetrics ``MeanMetric`` and logs with ``sync_dist``."""

    def validate(verify_split):
        L.seed_everything(0)
        model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)
        data = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1))
        loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
        trainer = L.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                            enable_model_summary=False,
                            strategy=ParallelStrategy(tensor_parallel=2, start_method="fork",
                                                      verify_split=verify_split))
        return trainer.validate(model, loader, verbose=False)

    assert validate(True) == validate(False)
