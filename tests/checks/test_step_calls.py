"""The user's steps run exactly as often as under Lightning's ``ddp``, at every layout that checks its
split in the first step (``checks/first_step.py``): a step that prints, counts, updates metrics or logs to
an outside service sees no call the user did not ask for.

Each rank appends one line per call of ``training_step`` / ``validation_step`` to its own file (fork-started
ranks share no memory); the counts must equal ``ddp``'s on the same Trainer settings, on every rank.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import DataParallelStrategy, ParallelStrategy
from lightning_parallel.models.gpt import GPT

STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 64


class CountingGPT(GPT):
    """The embedded GPT, each step call written to ``<out>/calls<pid>``."""

    def __init__(self, out: str) -> None:
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)
        self.out = out

    def _note(self, step: str) -> None:
        with open(os.path.join(self.out, f"calls{os.getpid()}"), "a") as file:
            file.write(step + "\n")

    def training_step(self, batch, batch_idx):
        self._note("training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self._note("validation_step")
        return super().validation_step(batch, batch_idx)


def calls(strategy, out: Path, devices: int = 2) -> list[Counter]:
    """Per process, how often each step ran in a fit of ``STEPS`` steps with a validation loader."""
    out.mkdir()
    L.seed_everything(0)
    data = torch.randint(0, VOCAB, (4 * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=1, val_check_interval=2)
    trainer.fit(CountingGPT(str(out)), loader, loader)
    return [Counter(path.read_text().splitlines()) for path in sorted(out.glob("calls*"))]


@pytest.mark.timeout(120)
def test_each_layout_runs_the_users_steps_as_often_as_ddp(tmp_path):
    ddp = calls(DataParallelStrategy(start_method="fork"), tmp_path / "dp")
    # 3 training steps; validation: 2 sanity-check batches of the one allowed, so 1, then 1 after step 2
    assert ddp == [Counter(training_step=STEPS, validation_step=2)] * 2
    layouts = {
        "tp2": ParallelStrategy(tensor_parallel=2, start_method="fork"),
        "tp2_sequence_parallel": ParallelStrategy(tensor_parallel=2, sequence_parallel=True, start_method="fork"),
        "cp2": ParallelStrategy(context_parallel=2, start_method="fork"),
        "zero3": DataParallelStrategy(zero_stage=3, start_method="fork"),
    }
    for name, strategy in layouts.items():
        assert calls(strategy, tmp_path / name) == ddp, name
