"""One Trainer, every entry point: ``fit``, then ``validate``, ``test``, ``predict`` and a second
``fit(ckpt_path="last")``, on every layout, give the metrics of the same sequence on one device.

The calls after the first ``fit`` must see the trained weights: in the same processes (popen,
torchrun) the strategy reuses the split it made; under fork and spawn the workers' full weights
come back to the parent (``launcher.py``), which starts the next call's workers from them.

Tolerance: after four AdamW steps the split runs' parameters differ from one device's by ~1e-6
(sums reordered by sharding, ~1e-7 relative per op; see test_tp_training.py), which moves a mean
cross-entropy of ~5.4 by well under 1e-4. Evaluating the untrained weights instead is off by
~0.14, and a model trained two steps less by ~0.05: both hundreds of times the tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.models.gpt import GPT
from lightning_parallel.strategy import ParallelStrategy
from tests.helpers.parity import ReplicaBatches

TOL = dict(rel=1e-4, abs=1e-5)
LAYOUTS = {
    "dp2": (2, dict()),
    "tp2": (2, dict(tensor_parallel=2)),
    "pp2": (2, dict(pipeline_parallel=2, micro_batches=2)),
    "dp2_tp2_pp2": (8, dict(data_parallel=2, tensor_parallel=2, pipeline_parallel=2, micro_batches=2)),
    "cp2": (2, dict(context_parallel=2)),
    "dp2_zero2": (2, dict(zero_stage=2)),
    "dp2_zero3": (2, dict(zero_stage=3)),
    "dp2_pp2_zero3": (4, dict(pipeline_parallel=2, micro_batches=2, zero_stage=3)),
}


class EvaluatedGPT(GPT):
    """The default GPT with a test and a predict step (what a user adds to evaluate)."""

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).transpose(1, 2), y, reduction="none").mean(1)  # per sample


def make_model() -> EvaluatedGPT:
    torch.manual_seed(0)
    return EvaluatedGPT(n_layer=2, n_embd=32, n_head=2, block_size=16)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randint(0, 256, (32, 16), generator=g), torch.randint(0, 256, (32, 16), generator=g))
    return DataLoader(data, batch_size=8)


class PredictionFile(Callback):
    """Writes rank 0's predictions to a file: fork and spawn return none to the parent process."""

    def __init__(self, path: str):
        self.path, self.outputs = path, []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        assert outputs.shape == (len(batch[0]),)  # the whole batch's, also when pipelined in micro-batches
        self.outputs += outputs.tolist()

    def on_predict_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump(self.outputs, f)
        trainer.strategy.barrier()  # under popen every rank reads the file next


def make_trainer(root, devices: int = 1, strategy="auto", use_distributed_sampler: bool = False) -> L.Trainer:
    # by default every rank reads every batch in order (no DistributedSampler), so all runs see the
    # reference's batches
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, logger=False,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_last=True),
                   PredictionFile(os.path.join(root, "predictions.json"))],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=use_distributed_sampler, default_root_dir=str(root),
    )


def every_entry_point(trainer: L.Trainer) -> dict:
    """fit -> validate -> test -> predict -> fit on from the last checkpoint -> validate."""
    model = make_model()
    trainer.fit(model, loader())
    out = {
        "validate": trainer.validate(model, loader(), verbose=False)[0]["val_loss"],
        "test": trainer.test(model, loader(), verbose=False)[0]["test_loss"],
    }
    trainer.predict(model, loader())
    with open(os.path.join(trainer.default_root_dir, "predictions.json")) as f:
        out["predict"] = json.load(f)
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(model, loader(), ckpt_path="last")
    out["validate_after_resume"] = trainer.validate(model, loader(), verbose=False)[0]["val_loss"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return every_entry_point(make_trainer(tmp_path_factory.mktemp("reference")))


def assert_matches(got: dict, reference: dict) -> None:
    for key, expected in reference.items():
        assert got[key] == pytest.approx(expected, **TOL), key
    assert len(reference["predict"]) == 32
    # guard against a vacuous pass: training moved the loss far more than the tolerance
    assert reference["validate_after_resume"] < reference["validate"] - 1e-2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fit_then_every_entry_point_matches_single_device(layout, reference, tmp_path):
    devices, sizes = LAYOUTS[layout]
    strategy = ParallelStrategy(start_method="fork", timeout=60, **sizes)
    assert_matches(every_entry_point(make_trainer(tmp_path, devices, strategy)), reference)


@pytest.mark.timeout(240)
def test_fit_then_test_under_spawn_evaluates_the_trained_weights(reference, tmp_path):
    trainer = make_trainer(tmp_path, 2, ParallelStrategy(tensor_parallel=2, start_method="spawn", timeout=60))
    model = make_model()
    trainer.fit(model, loader())
    assert trainer.test(model, loader(), verbose=False)[0]["test_loss"] == pytest.approx(reference["test"], **TOL)


def fit_then_test_on_meta(root, devices: int, **sizes) -> float:
    """fit then test a model built under ``trainer.init_module(empty_init=True)`` (the parent's
    module stays on the meta device; the workers materialise only their part)."""
    trainer = make_trainer(root, devices, ParallelStrategy(start_method="fork", timeout=60, **sizes))
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True):
        model = EvaluatedGPT(n_layer=2, n_embd=32, n_head=2, block_size=16)
    trainer.fit(model, loader())
    assert not any(p.is_meta for p in model.parameters())  # the trained weights came back
    return trainer.test(model, loader(), verbose=False)[0]["test_loss"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sizes", [{}, {"pipeline_parallel": 2, "micro_batches": 2}], ids=["dp2", "pp2"])
def test_fit_then_test_of_a_model_built_on_the_meta_device_matches_one_device(sizes, tmp_path):
    # one device materialises through the same function, so all runs start from the same values
    expected = fit_then_test_on_meta(tmp_path / "one", 1)
    assert fit_then_test_on_meta(tmp_path / "two", 2, **sizes) == pytest.approx(expected, **TOL)


POPEN_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root_dir!r})
    from tests.strategy.test_workflows import ParallelStrategy, every_entry_point, make_trainer

    if __name__ == "__main__":
        strategy = ParallelStrategy(pipeline_parallel=2, micro_batches=2, timeout=60)  # start_method="popen"
        out = every_entry_point(make_trainer({root!r}, 2, strategy))
        if strategy.global_rank == 0:
            with open({result!r}, "w") as f:
                json.dump(out, f)
""")


@pytest.mark.timeout(300)
def test_fit_then_every_entry_point_under_popen_reuses_the_split_model(reference, tmp_path):
    # popen re-runs the command of the main process for the other ranks, so it runs as a script
    script, result = tmp_path / "popen_run.py", tmp_path / "result.json"
    script.write_text(POPEN_SCRIPT.format(root_dir=str(Path(__file__).parents[2]), root=str(tmp_path), result=str(result)))
    # a fresh launch: no rendezvous variables left by the fork-launched tests of this session
    launched = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")
    env = {k: v for k, v in os.environ.items() if k not in launched} | {"OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280, env=env)
    failed = [line for line in run.stderr.splitlines() if "Error" in line]
    assert run.returncode == 0, "\n".join(failed[-20:]) + run.stderr[-2000:]
    assert_matches(json.loads(result.read_text()), reference)


# ---- manual optimisation -----------------------------------------------------------------------
class ManualGPT(EvaluatedGPT):
    """The same model stepping its optimizer itself (``automatic_optimization = False``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self._loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        return loss


def fit_manually(root, data: DataLoader, devices: int = 1, strategy="auto", distributed_sampler: bool = False) -> dict:
    """The parent's weights after four manual steps (under fork they come back from the workers)."""
    torch.manual_seed(0)
    model = ManualGPT(n_layer=2, n_embd=32, n_head=2, block_size=16)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    make_trainer(root, devices, strategy, distributed_sampler).fit(model, data)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert max((trained[n] - initial[n]).abs().max() for n in initial) > 1e-3  # four steps moved the weights
    return trained


@pytest.mark.timeout(240)
def test_manual_optimization_under_dp2_matches_single_device(tmp_path):
    # each replica reads its own shard (Lightning's DistributedSampler); the reference reads both
    # shards of a step as one batch, so a missing gradient average changes the update
    data = loader().dataset
    expected = fit_manually(tmp_path / "reference", DataLoader(data, batch_sampler=ReplicaBatches(len(data), 2, 4)))
    got = fit_manually(tmp_path / "dp2", DataLoader(data, batch_size=4), 2,
                       ParallelStrategy(start_method="fork", timeout=60), distributed_sampler=True)
    assert_same_parameters(got, expected)


@pytest.mark.timeout(240)
def test_manual_optimization_under_tp2_matches_single_device(tmp_path):
    expected = fit_manually(tmp_path / "reference", loader())
    strategy = ParallelStrategy(tensor_parallel=2, start_method="fork", timeout=60)
    got = fit_manually(tmp_path / "tp2", loader(), 2, strategy)
    assert_same_parameters(got, expected)


def assert_same_parameters(got: dict, expected: dict) -> None:
    # the tolerance of test_tp_training.py: AdamW moves every element by about lr per step whatever
    # its gradient, so a wrong shard or a missing reduction is off far beyond it
    assert got.keys() == expected.keys()
    for name, param in got.items():
        torch.testing.assert_close(param, expected[name], rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
