"""DP under PP: each stage's data-parallel buckets start during its own last backward, and training
still equals one device.

The overlap changes when each bucket's all-reduce starts, not what it sums, so the tolerances are
those of the other pipeline x data-parallel tests (``test_pp_training``): float32 reassociation,
~1e-6 on losses, Adam-amplified rounding up to ~3e-5 on parameters. A bucket launched before its
gradients were final (a tied weight before the stage sum, a window's first step under
accumulation) would move losses by >1e-3.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from lightning_parallel.data_parallel import GradientSynchronizer
from tests.helpers.parity import TensorDataset, fit_and_record
from tests.pipeline.test_pp_training import (
    assert_records_match,
    pp_strategy,
    small_gpt,
    token_data,
)


class LaunchLog(L.Callback):
    """Per optimizer step, on each rank: how many buckets started inside the pipelined step (by the
    hooks of a stage's last backward) and how many only in ``finish()``."""

    def __init__(self, out_dir: str):
        self.out_dir, self.steps, self.finishing = out_dir, [], False

    def setup(self, trainer, pl_module, stage):
        sync_cls, log = GradientSynchronizer, self
        launch, finish = sync_cls._launch, sync_cls.finish

        def logged_launch(sync, bucket):
            log.steps[-1]["finish" if log.finishing else "backward"] += 1
            return launch(sync, bucket)

        def logged_finish(sync):
            log.finishing = True
            try:
                return finish(sync)
            finally:
                log.finishing = False

        sync_cls._launch, sync_cls.finish = logged_launch, logged_finish  # forked workers: this process only

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append({"backward": 0, "finish": 0})

    def on_train_end(self, trainer, pl_module):
        deferred = len(trainer.strategy.grad_sync._deferred)
        torch.save({"steps": self.steps, "deferred": deferred}, os.path.join(self.out_dir, f"launch{trainer.global_rank}.pt"))


def _reference(data, tmp_path, **kwargs):
    # both replicas' shards of step k as one batch, as in test_pp_training's DP x PP test
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(int(os.getenv("PL_GLOBAL_SEED", 0))))
    shards = [perm[r::2] for r in range(2)]
    order = torch.cat([shards[r][8 * k : 8 * k + 8] for k in range(len(data) // 16) for r in range(2)])
    return fit_and_record(small_gpt(), TensorDataset(*(t[order] for t in data.tensors)), 16, str(tmp_path / "ref"),
                          max_steps=2, **kwargs)[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("zero_stage,schedule", [(0, "1f1b"), (1, "zbv")])
def test_stage_buckets_start_in_the_last_backward_and_training_matches_one_device(tmp_path, zero_stage, schedule):
    data = token_data()
    kwargs = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    reference = _reference(data, tmp_path, **kwargs)
    log = LaunchLog(str(tmp_path))
    # several buckets a stage; under zbv each rank holds two stages, the tied embedding and head on rank 0
    strategy = pp_strategy(micro_batches=2, bucket_size_mb=0.005, zero_stage=zero_stage, schedule=schedule)
    records = fit_and_record(small_gpt(), data, 8, str(tmp_path / "pp"), devices=4, strategy=strategy, max_steps=2,
                             callbacks=[log], **kwargs)
    assert_records_match(reference, records, replicas=2)
    deferred = []
    for rank in range(4):
        launches = torch.load(str(tmp_path / f"launch{rank}.pt"))
        steps, deferred = launches["steps"], deferred + [launches["deferred"]]
        assert len(steps) == 4  # two optimizer steps of two batches
        for first, last in zip(steps[::2], steps[1::2]):
            assert first == {"backward": 0, "finish": 0}  # inside the window nothing is reduced
            assert last["backward"] > 0  # the stage's own buckets started during its last backward
            # only buckets holding the tied embedding/head (summed over the stages first) wait for finish()
            assert (last["finish"] > 0) == (launches["deferred"] > 0)
            assert last["finish"] <= launches["deferred"]
    assert max(deferred) >= 1
