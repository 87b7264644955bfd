"""One Trainer, every entry point, under expert parallelism: ``fit``, then ``validate``, ``test`` and a
second ``fit(ckpt_path="last")`` of a tiny Hugging Face Mixtral at DP2 x EP2 give the
metrics of the same sequence on one device (fork: the workers' trained experts come back to the
parent, gathered by their global ids, and the next call's workers place them again).

Tolerance as in ``tests/strategy/test_workflows.py``: after four AdamW steps parameters differ by ~1e-6
(expert outputs combined in another order), far under what untrained weights (~0.1 in the loss) or a
missing step would show.
"""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.strategy import ParallelStrategy
from tests.expert_parallel.test_ep_training import MoELM
from tests.strategy.test_workflows import TOL, loader, make_trainer


class EvaluatedMoE(MoELM):
    """A user's MoE module with a validation and a test step (targets: the batch's second tensor)."""

    def _loss(self, batch):
        x, y = batch
        logits = self.model(input_ids=x % 64).logits
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), y % 64)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)


def entry_points(trainer) -> dict:
    torch.manual_seed(0)
    model = EvaluatedMoE()
    trainer.fit(model, loader())
    out = {"validate": trainer.validate(model, loader(), verbose=False)[0]["val_loss"],
           "test": trainer.test(model, loader(), verbose=False)[0]["test_loss"]}
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(model, loader(), ckpt_path="last")
    out["validate_after_resume"] = trainer.validate(model, loader(), verbose=False)[0]["val_loss"]
    return out


@pytest.mark.timeout(240)
def test_ep2_fit_then_every_entry_point_matches_single_device(tmp_path):
    expected = entry_points(make_trainer(tmp_path / "one"))
    got = entry_points(make_trainer(tmp_path / "ep", 2, ParallelStrategy(expert_parallel=2, start_method="fork",
                                                                          timeout=60)))
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, **TOL), key
    assert expected["validate_after_resume"] < expected["validate"] - 1e-2  # training moved the loss
