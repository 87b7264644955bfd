"""Data-parallel training speed: our bucketed all-reduce against torch DDP and a naive all-reduce.

Trains the default GPT on 2 CPU processes (gloo) with three gradient synchronisations, each in the
same Lightning loop on the same data:

- ``lightning_parallel``: ``DataParallelStrategy`` (flat buckets, all-reduce overlapped with backward);
- ``torch DDP``: Lightning's ``DDPStrategy`` (``torch.nn.parallel.DistributedDataParallel``);
- ``naive``: one blocking all-reduce per parameter after backward.

A second, convolutional row trains the ResNet-50-shaped module of ``tests/resnet.py`` (bottleneck
blocks with BatchNorm, tiny widths, 32x32 images) under ours and torch DDP only.

Steps per second are timed on rank 0 between two steps after a warm-up, repeated, and the medians
printed with the ratios. Run: ``python benchmarks/dp.py [--repeats 5] [--steps 40]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_parallel import DataParallelStrategy
from lightning_parallel.data.text import TextDataModule
from lightning_parallel.models.gpt import GPT


class NaiveAllReduce(DataParallelStrategy):
    """Per-parameter blocking all-reduce after backward (the textbook baseline)."""

    def setup(self, trainer):
        super().setup(trainer)
        if self.grad_sync is not None:
            self.grad_sync.remove()
            self.grad_sync = None

    def _finalize_gradients(self):
        world = dist.get_world_size()
        for p in self.lightning_module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)


class StepTimer(L.Callback):
    def __init__(self, warmup: int, out: str):
        self.warmup, self.out, self.start = warmup, out, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            rate = (trainer.global_step - self.warmup) / (time.perf_counter() - self.start)
            with open(self.out, "w") as f:
                f.write(str(rate))


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.helpers.resnet import ResNet, image_data  # noqa: E402 - the test model, shared with tests/test_trainer_flags.py


def text_loader(batch_size: int) -> DataLoader:
    data = TextDataModule(batch_size=batch_size, block_size=64)
    data.setup("fit")
    return DataLoader(data.train_dataloader().dataset, batch_size=batch_size, shuffle=True)


def image_loader(batch_size: int) -> DataLoader:
    return DataLoader(image_data(n=1024, size=32), batch_size=batch_size, shuffle=True)


def steps_per_second(strategy, steps: int, warmup: int, batch_size: int, model=GPT, loader=text_loader) -> float:
    L.seed_everything(0, verbose=False)
    loader = loader(batch_size)
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, callbacks=[StepTimer(warmup, out.name)],
        )
        trainer.fit(model(), loader)
        return float(open(out.name).read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DataParallelStrategy bucket size")
    args = parser.parse_args()
    variants = {
        "lightning_parallel": lambda: DataParallelStrategy(start_method="fork", bucket_size_mb=args.bucket_mb),
        "torch DDP": lambda: DDPStrategy(start_method="fork"),
        "naive": lambda: NaiveAllReduce(start_method="fork"),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleave the variants so drift hits all alike
        for name, make in variants.items():
            rates[name].append(steps_per_second(make(), args.steps, args.warmup, args.batch_size))
    params = sum(p.numel() for p in GPT().parameters())
    ours = statistics.median(rates["lightning_parallel"])
    print(f"\nGPT {params / 1e3:.0f}k params, 2 processes x batch {args.batch_size}, "
          f"{args.steps - args.warmup} timed steps, median of {args.repeats}")
    print(f"{'variant':<20} {'steps/s (min/med/max)':>26} {'ours / it':>10}")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:<20} {min(r):>8.2f} {med:>8.2f} {max(r):>8.2f} {ours / med:>10.2f}x")

    conv = {name: variants[name] for name in ("lightning_parallel", "torch DDP")}
    conv_rates: dict[str, list[float]] = {name: [] for name in conv}
    for _ in range(args.repeats):
        for name, make in conv.items():
            conv_rates[name].append(steps_per_second(make(), args.steps, args.warmup, args.batch_size,
                                                     model=ResNet, loader=image_loader))
    params = sum(p.numel() for p in ResNet().parameters())
    ours = statistics.median(conv_rates["lightning_parallel"])
    print(f"\nResNet-50-shaped (bottlenecks 3-4-6-3, BatchNorm) {params / 1e3:.0f}k params, 32x32 images, "
          f"2 processes x batch {args.batch_size}, median of {args.repeats}")
    for name, r in conv_rates.items():
        med = statistics.median(r)
        print(f"{name:<20} {min(r):>8.2f} {med:>8.2f} {max(r):>8.2f} {ours / med:>10.2f}x")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
