"""Optimizer-state memory per rank with ZeRO-1 at DP = 1, 2, 4 (default GPT, AdamW).

AdamW keeps two fp32 moments per parameter (8 bytes); ZeRO-1 (Rajbhandari et al. 2020) divides them
over the data-parallel ranks. Printed: bytes of optimizer state on the most loaded rank, against
the unsharded figure. Run: ``python benchmarks/zero.py``.
"""

from __future__ import annotations

import os
import tempfile

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_parallel import DataParallelStrategy
from lightning_parallel.data.text import TextDataModule
from lightning_parallel.models.gpt import GPT


class OptimizerStateBytes(L.Callback):
    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        n = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
        torch.save(n, os.path.join(self.out_dir, f"{trainer.global_rank}.pt"))


def state_bytes_per_rank(dp: int, zero: int) -> list[int]:
    L.seed_everything(0, verbose=False)
    data = TextDataModule(batch_size=8, block_size=64)
    data.setup("fit")
    loader = DataLoader(data.train_dataloader().dataset, batch_size=8)
    strategy = DataParallelStrategy(start_method="fork", zero_stage=zero) if dp > 1 else "auto"
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = L.Trainer(accelerator="cpu", devices=dp, strategy=strategy, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, callbacks=[OptimizerStateBytes(out_dir)])
        trainer.fit(GPT(), loader)
        return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(dp)]


def main() -> None:
    rows = {"DP1": max(state_bytes_per_rank(1, 0))}
    for dp in (2, 4):
        rows[f"DP{dp} ZeRO-1"] = max(state_bytes_per_rank(dp, 1))
    print(f"\n{'layout':<12} {'optimizer state, largest rank':>30} {'vs unsharded':>13}")
    for name, n in rows.items():
        print(f"{name:<12} {n / 2**20:>26.2f} MiB {n / rows['DP1']:>12.2f}x")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
