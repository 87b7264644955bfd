"""The setup probe of a tensor-parallel model (``checks/split_values.py``).

A model whose forward breaks once its layers are sharded is refused at setup, with one message on
every rank, before the first training step; a model that trains under TP trains exactly as it would
without the probe (bit for bit: the probe restores random generators, buffers and metric states, so
there is no tolerance to justify).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel.strategy.parallel as strategy_module
from lightning_parallel.checks.split_values import refusal
from lightning_parallel.errors import LaunchError
from lightning_parallel.models.gpt import GPT
from lightning_parallel.strategy import ParallelStrategy
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


class MarkSteps(Callback):
    """Leaves ``<out>/step<rank>`` when the Trainer starts a training step."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        (self.out / f"step{trainer.global_rank}").touch()


class RecordingStrategy(ParallelStrategy):
    """Writes the error its setup raises to ``<out>/rank<r>.txt``, then raises it on."""

    def __init__(self, out: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out

    def setup(self, trainer) -> None:
        try:
            super().setup(trainer)
        except LaunchError as err:
            (self.out / f"rank{self.global_rank}.txt").write_text(str(err))
            raise


def refused_messages(module: Regression, out: Path) -> list[str]:
    """Fit ``module`` with TP=2 and return what setup raised on each rank; no step may have run. The
    float64 check of the split (``test_verify_split.py``) is off: these tests are about the probes."""
    strategy = RecordingStrategy(out, tensor_parallel=2, start_method="fork", timeout=timedelta(seconds=30),
                                 tp_plan={"body.up": "colwise", "body.down": "rowwise"}, verify_split=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[MarkSteps(out)])
    with pytest.raises(Exception):
        trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, 4, 32)), batch_size=4))
    assert not list(out.glob("step*")), "a training step ran before the refusal"
    return [(out / f"rank{r}.txt").read_text() for r in range(2)]


@pytest.mark.timeout(90)
def test_forward_that_fails_after_sharding_is_refused_at_setup_on_every_rank(tmp_path):
    messages = refused_messages(Regression(), tmp_path)
    assert messages[0] == messages[1]
    assert "on ranks 0, 1: RuntimeError: shape" in messages[0].splitlines()[0]
    assert "(in body, HardCodedWidth; sharded inside it: up colwise, down rowwise)" in messages[0]
    assert "leaves body whole" in messages[0] and "tensor_parallel=1" in messages[0]


@pytest.mark.timeout(90)
def test_failure_on_one_rank_only_is_refused_on_every_rank_without_a_hang(tmp_path):
    messages = refused_messages(Regression(fail_on_rank=1), tmp_path)
    assert messages[0] == messages[1]
    assert "on rank 1: RuntimeError: rank 1 only" in messages[0].splitlines()[0]
    assert "on some ranks only" in messages[0]


@pytest.mark.timeout(90)
def test_split_that_runs_but_computes_other_values_is_refused_at_setup_on_every_rank(tmp_path):
    messages = refused_messages(Regression(fail_on_rank=-2), tmp_path)
    assert messages[0] == messages[1]
    assert "training_step computes other values once the model's layers are split" in messages[0]
    assert "training_step's result is [" in messages[0] and "tensor_parallel=1" in messages[0]


def test_refusal_names_ranks_with_the_same_error_together_in_rank_order():
    text = refusal([None, "E: b (in x, X)", "E: a (in y, Y)", "E: b (in x, X)"], "training_step", 4)
    assert "on ranks 1, 3: E: b (in x, X)\n  and on rank 2: E: a (in y, Y)\n" in text
    assert "leaves x whole" in text
    assert refusal([None, None], "training_step", 2) is None


def without_probe(monkeypatch) -> None:
    monkeypatch.setattr(strategy_module, "refuse_failing_split", lambda strategy, trainer, reference=None: None)


def counting_probe(monkeypatch, out: Path) -> None:
    """The real probe, leaving one file per rank that ran it (fork-started ranks share no memory)."""
    real = strategy_module.refuse_failing_split

    def probe(strategy, trainer, reference=None):
        (out / f"probed{strategy.global_rank}").touch()
        real(strategy, trainer, reference)

    monkeypatch.setattr(strategy_module, "refuse_failing_split", probe)


def tiny_gpt_with_dropout():  # the probe draws random numbers that must not shift the first step's masks
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, dropout=0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "build, sequence_parallel",
    # sequence parallelism: the probe's local all-gather and reduce-scatter must keep the real shapes
    [(tiny_gpt_with_dropout, False), (tiny_gpt_with_dropout, True), (LlamaModule, False)],
    ids=["gpt", "gpt_sequence_parallel", "hf_llama"],
)
def test_probe_leaves_tp2_training_bit_for_bit_unchanged(build, sequence_parallel, tmp_path, monkeypatch):
    def strategy():
        return ParallelStrategy(tensor_parallel=2, sequence_parallel=sequence_parallel, start_method="fork")

    counting_probe(monkeypatch, tmp_path)
    probed = fit(build, tmp_path / "probed.pt", strategy())
    assert sorted(p.name for p in tmp_path.glob("probed?")) == ["probed0", "probed1"]
    without_probe(monkeypatch)
    plain = fit(build, tmp_path / "plain.pt", strategy())
    assert len(probed["losses"]) == STEPS
    assert probed["losses"] == plain["losses"]
    for name, p in probed["params"].items():
        assert torch.equal(p, plain["params"][name]), name


@pytest.mark.timeout(120)
def test_probe_leaves_validation_metrics_unchanged(tmp_path, monkeypatch):
    """GPT's ``validation_step`` updates a torchmetrics ``MeanMetric`` and logs with ``sync_dist``."""

    def validate():
        L.seed_everything(0)
        model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)
        data = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1))
        loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
        trainer = L.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                            enable_model_summary=False,
                            strategy=ParallelStrategy(tensor_parallel=2, start_method="fork"))
        return trainer.validate(model, loader, verbose=False)

    counting_probe(monkeypatch, tmp_path)
    probed = validate()
    assert sorted(p.name for p in tmp_path.glob("probed?")) == ["probed0", "probed1"]
    without_probe(monkeypatch)
    assert probed == validate()
