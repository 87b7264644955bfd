"""BatchNorm statistics of data-parallel replicas kept as DDP keeps them (``data_parallel/buffers.py``).

Each replica normalises different samples, so running statistics drift apart unless rank 0's are
broadcast before a forward, as ``DistributedDataParallel(broadcast_buffers=True)`` does. Every rank's
buffers after training, and those each replica validates with, must equal DDP's on the same rank:
the same values, up to the rounding of the averaged gradients the statistics depend on (float32,
measured ~1e-8; ``atol=1e-6``). Without the broadcast they differ by ~1e-2 after 4 steps.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.strategy import DataParallelStrategy, ParallelStrategy


class Normed(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Buffers(Callback):
    """Per rank: the BatchNorm buffers after training and those the first validation batch used."""

    def __init__(self, out: Path) -> None:
        self.out, self.seen = out, {}

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and trainer.state.fn == "fit":
            self.seen[f"validation{trainer.global_step}"] = {n: b.clone() for n, b in pl_module.named_buffers()}

    def on_train_end(self, trainer, pl_module):
        self.seen["end"] = {n: b.clone() for n, b in pl_module.named_buffers()}
        torch.save(self.seen, self.out / f"rank{trainer.global_rank}.pt")


def fit(strategy, out: Path, devices: int = 2) -> list[dict]:
    """4 steps (validation after the 2nd and 4th) on replicas that read different samples."""
    out.mkdir()
    L.seed_everything(0)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.5, 3, 64)[:, None]
    data = TensorDataset(x, x.sum(1, keepdim=True))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, val_check_interval=2,
                        limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Buffers(out)])
    trainer.fit(Normed(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    return [torch.load(out / f"rank{r}.pt") for r in range(devices)]


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a if a[n].is_floating_point())


@pytest.mark.timeout(180)
def test_replicas_keep_the_buffers_ddp_keeps(tmp_path):
    ddp = fit(DDPStrategy(start_method="fork"), tmp_path / "ddp")
    ours = fit(DataParallelStrategy(start_method="fork"), tmp_path / "ours")
    for rank in range(2):
        assert ours[rank].keys() == ddp[rank].keys() == {"validation2", "validation4", "end"}
        for when in ddp[rank]:
            assert largest_difference(ours[rank][when], ddp[rank][when]) < 1e-6, (rank, when)
    # every replica validates with the first replica's statistics
    for when in ("validation2", "validation4"):
        assert largest_difference(ours[0][when], ours[1][when]) == 0

    apart = fit(DataParallelStrategy(start_method="fork", broadcast_buffers=False), tmp_path / "apart")
    assert largest_difference(apart[1]["validation4"], ddp[1]["validation4"]) > 1e-3
    assert largest_difference(apart[0]["validation4"], apart[1]["validation4"]) > 1e-3


@pytest.mark.timeout(180)
def test_buffers_are_broadcast_over_the_data_parallel_group_only(tmp_path):
    """TP=2 x DP=2: each TP rank receives its own data-parallel group's first rank's buffers."""
    class Wide(Normed):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 64), nn.ReLU(),
                                     nn.Linear(64, 1))

    out = tmp_path / "tp"
    out.mkdir()
    L.seed_everything(0)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.5, 3, 64)[:, None]
    data = TensorDataset(x, x.sum(1, keepdim=True))
    trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=2, val_check_interval=2, limit_val_batches=1,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Buffers(out)],
                        strategy=ParallelStrategy(tensor_parallel=2, start_method="fork",
                                                  tp_plan={"net.3": "colwise", "net.5": "rowwise"}))
    trainer.fit(Wide(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    seen = [torch.load(out / f"rank{r}.pt")["validation2"] for r in range(4)]
    assert all(largest_difference(seen[0], s) == 0 for s in seen[1:])  # TP peers compute alike; DP peers receive
