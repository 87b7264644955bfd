"""Back to one device: a checkpoint directory written at TP=2 x PP=2 loads where Lightning reads
checkpoint files (``MyModule.load_from_checkpoint(dir)``, a one-device ``Trainer``'s ``ckpt_path``)
exactly as its consolidated file does (``lightning_hooks.read_checkpoint_directories``).

Both sides read the same consolidated tensors and run the same one-device arithmetic, so weights,
metrics, predictions and the losses of a resumed fit are compared for exact equality.
"""

from __future__ import annotations

import subprocess
import sys

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_parallel.checkpoint.consolidate import load_directory
from lightning_parallel.cli.consolidate import main as consolidate_main
from lightning_parallel.models.gpt import GPT
from tests.checkpoint.test_checkpoint import (  # noqa: F401 - tp2pp2_checkpoint: a fixture
    DATASET,
    GLOBAL_BATCH,
    HALF,
    tp2pp2_checkpoint,
    train,
)


class EvaluatedGPT(GPT):
    """The test GPT with the test and predict steps a user adds (its ``__init__`` is GPT's)."""

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory, tp2pp2_checkpoint):
    path = tmp_path_factory.mktemp("plain") / "plain.ckpt"
    consolidate_main([str(tp2pp2_checkpoint), str(path)])
    return path


def one_device() -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def held_out() -> DataLoader:
    return DataLoader(torch.utils.data.Subset(DATASET, range(HALF * GLOBAL_BATCH, (HALF + 1) * GLOBAL_BATCH)),
                      batch_size=GLOBAL_BATCH)


@pytest.mark.timeout(60)
def test_load_from_checkpoint_reads_a_split_directory_as_its_consolidated_file(tp2pp2_checkpoint, consolidated):
    assert tp2pp2_checkpoint.is_dir()
    from_dir, from_file = GPT.load_from_checkpoint(tp2pp2_checkpoint), GPT.load_from_checkpoint(consolidated)
    assert from_dir.hparams == from_file.hparams
    expected = from_file.state_dict()
    assert from_dir.state_dict().keys() == expected.keys()
    assert all(torch.equal(t, expected[n]) for n, t in from_dir.state_dict().items())
    # map_location naming a device is honoured (the only other device here: meta)
    assert all(t.is_meta for t in load_directory(tp2pp2_checkpoint, map_location="meta")["state_dict"].values())


@pytest.mark.timeout(60)
def test_one_device_trainer_tests_and_predicts_from_a_split_directory(tp2pp2_checkpoint, consolidated):
    model = EvaluatedGPT(**GPT.load_from_checkpoint(consolidated).hparams)
    metrics = [one_device().test(model, held_out(), ckpt_path=path, verbose=False) for path in
               (tp2pp2_checkpoint, consolidated)]
    assert metrics[0] == metrics[1]
    predictions = [one_device().predict(model, held_out(), ckpt_path=path)
                   for path in (tp2pp2_checkpoint, consolidated)]
    assert torch.equal(predictions[0][0], predictions[1][0])


@pytest.mark.timeout(60)
def test_one_device_fit_resumes_from_a_split_directory_as_from_its_consolidated_file(
        tmp_path, tp2pp2_checkpoint, consolidated):
    from_dir = train(tmp_path / "dir", ckpt_path=tp2pp2_checkpoint)[0]
    from_file = train(tmp_path / "file", ckpt_path=consolidated)[0]
    assert from_dir["global_step"] == from_file["global_step"] and from_dir["losses"] == from_file["losses"]
    assert all(torch.equal(p, from_file["params"][n]) for n, p in from_dir["params"].items())


def test_other_directories_are_read_by_lightning_as_before(tmp_path):
    (tmp_path / "meta.pt").write_bytes(b"")  # as Lightning's FSDP writes: not ours, so not consolidated
    with pytest.raises(IsADirectoryError):
        GPT.load_from_checkpoint(tmp_path)


@pytest.mark.timeout(60)
def test_reader_is_extended_when_lightning_is_imported_after_the_package():
    code = ("import lightning_parallel, sys; assert 'lightning.pytorch' not in sys.modules; "
            "import lightning.pytorch.core.saving as saving; print(saving.pl_load._lp_reads_directories)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.stdout.strip() == "True", result.stderr
