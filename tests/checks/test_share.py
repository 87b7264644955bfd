"""How much of the model each rank holds (``checks/share.py``): in the run's start block and in
``lp-plan``, and a tensor-parallel split that keeps nearly all of the model on every rank refused."""

from __future__ import annotations

import logging
from datetime import timedelta

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.checks.model import check_model
from lightning_parallel.checks.share import planned_share
from lightning_parallel.cli.launch_plan import build_plan, format_plan
from lightning_parallel.cli.overrides import compose_config
from lightning_parallel.cli.run_summary import RunSummary
from lightning_parallel.errors import LaunchError
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.models.gpt import GPT
from lightning_parallel.options import ParallelOptions
from lightning_parallel.planner.estimate import tp_sharded_parameters
from lightning_parallel.strategy import ParallelStrategy
from lightning_parallel.tensor_parallel.detect import detect_plan
from lightning_parallel.tensor_parallel.resolve import resolve_plan


def gpt() -> GPT:
    return GPT(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32)


class MostlyRecurrent(nn.Module):
    """A big recurrent layer tensor parallelism has no style for, and a small MLP it can split."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(64, 64, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(64, 16), nn.GELU(), nn.Linear(16, 64))

    def forward(self, x):
        return self.mlp(self.rnn(x)[0])


def test_planned_share_counts_shards_once_per_rank():
    model = gpt()
    assignments = resolve_plan(model, detect_plan(model), 2, False)
    sharded = tp_sharded_parameters(assignments)
    params = list(model.parameters())
    expected = sum(p.numel() // 2 if id(p) in sharded else p.numel() for p in params)
    share = planned_share(model, assignments, 2, None)
    assert (share.largest, share.whole) == (expected, sum(p.numel() for p in params))
    assert 0.5 < share.fraction < 0.6  # layer norms, biases of row-parallel layers and positions stay whole


def test_split_keeping_90_percent_on_every_rank_is_refused_with_its_share():
    with pytest.raises(LaunchError) as refused:
        check_model(MostlyRecurrent(), ParallelMesh(2, tensor_parallel=2), ParallelOptions(tensor_parallel=2))
    message = str(refused.value)
    assert "tensor_parallel=2 would leave 9" in message and "% of the parameters on every rank" in message
    assert "Nothing worth splitting" in message and "rnn (" in message and "strategy.tp_plan" in message


def test_split_the_user_asked_for_is_not_refused():
    plan = {"mlp.0": "colwise", "mlp.2": "rowwise"}
    assignments, _ = check_model(MostlyRecurrent(), ParallelMesh(2, tensor_parallel=2),
                                 ParallelOptions(tensor_parallel=2, tp_plan=plan))
    assert [a.name for a in assignments] == ["mlp.0", "mlp.2"]


def test_lp_plan_prints_the_share_of_the_largest_rank():
    plan = build_plan(compose_config(["strategy=tp", "trainer.devices=2"]), env={})
    assert 0.5 < plan.share.fraction < 0.6
    assert f"holds: {100 * plan.share.fraction:.1f}% of the parameters on the largest rank (pp rank 0: " in \
        format_plan(plan)


@pytest.mark.timeout(120)
def test_start_block_says_what_the_largest_rank_holds(tmp_path):
    """Measured on the split model, equal to what lp-plan computes from the plan; the start block is what
    reaches train.log under lp-train."""
    log_file = tmp_path / "start.log"
    handler = logging.FileHandler(log_file)  # fork-started ranks inherit it
    logger = logging.getLogger("lightning_parallel")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        L.seed_everything(0)
        tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[RunSummary()],
                            strategy=ParallelStrategy(tensor_parallel=2, start_method="fork",
                                                      timeout=timedelta(seconds=30)))
        trainer.fit(gpt(), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))
    finally:
        logger.removeHandler(handler)
    model = gpt()
    planned = planned_share(model, resolve_plan(model, detect_plan(model), 2, False), 2, None)
    text = log_file.read_text()
    assert f"holds        {100 * planned.fraction:.1f}% of the parameters on the largest rank (rank " in text
    assert "verified     split checked against the whole model in float64: 3 module kind(s)" in text
