"""Gradient accumulation under data parallelism keeps every gradient of the window.

A parameter may be used in any subset of an accumulation window's micro-batches and by any subset of
the replicas (a Mixture-of-Experts expert that gets no token in the last micro-batch, a branch taken
for some samples only). Its gradient must be the sum over the window's micro-batches, averaged over
the replicas, exactly as on one device; and a parameter no replica used in the whole window keeps
``grad=None`` (AdamW then leaves it alone, where a zero gradient would still move it).

Every run is compared with one process reading the same global batches AND with Lightning's
``DDPStrategy(find_unused_parameters=True)`` (PyTorch DDP), for plain DP and ZeRO-1.

Tolerances (float32, CPU): the runs differ only in how sums are associated (a global-batch mean
against the mean of per-replica means), ~1e-7 per value; after two AdamW steps, whose update is
normalised, parameters agree to 1e-5 and losses to 1e-6 (measured: 3e-8 and 9e-8 against one
process, bit-identical to DDP). A lost micro-batch gradient moves a parameter by O(lr) = 1e-2
(measured before the fix: ``skipped`` unused last and ``one_replica`` moved 0.0 under DP=2 and
ZeRO-1, 2.0e-2 on one process).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_parallel import DataParallelStrategy
from tests.helpers.parity import (
    TensorDataset,
    assert_close_series,
    assert_params_close,
    fit_and_record,
    mean_over_ranks,
)

WINDOW, PER_RANK, STEPS = 3, 4, 2
LOSS_ATOL, PARAM_ATOL = 1e-6, 1e-5


class SometimesUsed(L.LightningModule):
    """A trunk and four branches, each used by a different subset of micro-batches and replicas:

    - ``skipped``: every micro-batch but the one at position ``skip_at`` of each window;
    - ``one_replica``: flagged samples only; only replica 0 reads them, and never in the last
      micro-batch of a window (an expert that gets no token there);
    - ``first_window``: the micro-batches of the first window only (no replica uses it afterwards);
    - ``unused``: never.
    """

    def __init__(self, skip_at: int):
        super().__init__()
        self.skip_at = skip_at
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.skipped = nn.Linear(8, 4)
        self.one_replica = nn.Linear(8, 4)
        self.first_window = nn.Linear(8, 4)
        self.unused = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        x, y, flag = batch
        out = self.trunk(x)
        if batch_idx % WINDOW != self.skip_at:
            out = out + self.skipped(x)
        if batch_idx < WINDOW:
            out = out + self.first_window(x)
        sel = flag.bool()
        if sel.any():
            out = out.clone()
            out[sel] = out[sel] + self.one_replica(x[sel])
        return F.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def replica0_flagged_data(replicas: int = 2) -> TensorDataset:
    """One epoch of ``STEPS`` windows; flagged samples only where the shuffling DistributedSampler
    (seed ``PL_GLOBAL_SEED`` = 0, epoch 0) sends them to replica 0: every 6th of its samples, so its
    micro-batches 0, 1, 3 and 4 (of 4 samples) hold one and 2 and 5, the last of each window, none."""
    n = STEPS * WINDOW * PER_RANK * replicas
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    flag = torch.zeros(n, dtype=torch.long)
    flag[perm[0::replicas][::6]] = 1
    return TensorDataset(x, y, flag)


def run(tmp_path, name, module, strategy):
    kwargs = dict(max_steps=STEPS, accumulate_grad_batches=WINDOW)
    data = replica0_flagged_data()
    if strategy is None:
        return fit_and_record(module, data, batch_size=2 * PER_RANK, out_dir=str(tmp_path / name),
                              emulate_replicas=2, **kwargs)
    return fit_and_record(module, data, batch_size=PER_RANK, out_dir=str(tmp_path / name), devices=2,
                          strategy=strategy, **kwargs)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("skip_at", [0, 1, 2], ids=["unused-first", "unused-middle", "unused-last"])
def test_dp2_accumulation_keeps_gradients_of_partly_used_parameters(tmp_path, skip_at):
    L.seed_everything(0)
    module = SometimesUsed(skip_at)
    one = run(tmp_path, "one", module, None)[0]
    ddp = run(tmp_path, "ddp", module, DDPStrategy(start_method="fork", find_unused_parameters=True))
    ours = {
        "dp": run(tmp_path, "dp", module, DataParallelStrategy(start_method="fork", bucket_size_mb=60 * 4 / 2**20)),
        "zero1": run(tmp_path, "zero1", module, DataParallelStrategy(start_method="fork", zero_stage=1,
                                                                     bucket_size_mb=60 * 4 / 2**20)),
    }
    # the reference really exercises every case: each branch moved, except the never-used one
    initial = dict(module.named_parameters())
    for name in ("skipped.weight", "one_replica.weight", "first_window.weight"):
        assert (one["params"][name] - initial[name]).abs().max() > 1e-3, name
    torch.testing.assert_close(one["params"]["unused.weight"], initial["unused.weight"].detach(), atol=0, rtol=0)
    assert_close_series(mean_over_ranks(ddp), one["losses"], atol=LOSS_ATOL)
    for kind, records in ours.items():
        assert_close_series(mean_over_ranks(records), one["losses"], atol=LOSS_ATOL)
        assert_close_series(mean_over_ranks(records), mean_over_ranks(ddp), atol=LOSS_ATOL)
        for record in records:
            assert record["global_step"] == STEPS
            assert_params_close(record["params"], one["params"], atol=PARAM_ATOL)
            assert_params_close(record["params"], ddp[0]["params"], atol=PARAM_ATOL)
            torch.testing.assert_close(record["params"]["unused.weight"], initial["unused.weight"].detach(),
                                       atol=0, rtol=0)
