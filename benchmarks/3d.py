"""Every layout of 8 processes on the default GPT: steps per second and per-rank memory.

Same model, same global batch (64 sequences of 64 bytes), same Lightning loop; only the layout
changes. Memory is measured per rank: model state (parameters + gradients + optimizer state held by
that rank, exact bytes) and how far the resident set grew above its level at the start of training
(peak ``VmHWM`` after resetting it with ``/proc/self/clear_refs``, minus ``VmRSS`` then), which leaves
out the interpreter and libraries every process carries.

Run: ``python benchmarks/3d.py [--steps 12] [--repeats 3]``. On 2 CPU cores 8 processes contend
for time, so compare layouts with each other, not with a GPU cluster.

``python benchmarks/3d.py --overlap`` instead times DP2 x PP2 (4 processes) with each stage's
data-parallel all-reduce started inside its last backward (the default) and with every bucket
reduced only after the pipeline step (the previous behaviour), paired repeat by repeat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_parallel import ParallelStrategy
from lightning_parallel.data.text import TextDataModule
from lightning_parallel.models.gpt import GPT
from lightning_parallel.strategy.gradients import GradientFinalizer

LAYOUTS = [  # (dp, tp, pp)
    (8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 2), (2, 4, 1), (2, 1, 4), (1, 2, 4),
]


class Probe(L.Callback):
    def __init__(self, warmup: int, out_dir: str):
        self.warmup, self.out_dir, self.start = warmup, out_dir, None

    def on_train_start(self, trainer, pl_module):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS counter
        self.rss0 = _status_kib("VmRSS")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        elapsed = time.perf_counter() - self.start
        params = list(pl_module.parameters())
        state = sum(p.numel() * p.element_size() for p in params)  # parameters
        state += sum(p.numel() * p.element_size() for p in params if p.requires_grad)  # gradients
        opt = trainer.optimizers[0]
        state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0)
        growth = _status_kib("VmHWM") - self.rss0
        rate = (trainer.global_step - self.warmup) / elapsed
        torch.save((rate, state, growth * 1024), os.path.join(self.out_dir, f"{trainer.global_rank}.pt"))


def _status_kib(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))


@contextmanager
def without_overlap():
    """Reduce every data-parallel bucket after the pipeline step (forked workers inherit the patch)."""
    overlapped = GradientFinalizer.overlapped
    GradientFinalizer.overlapped = lambda self, window_ends: nullcontext()
    try:
        yield
    finally:
        GradientFinalizer.overlapped = overlapped


def run_layout(dp: int, tp: int, pp: int, steps: int, warmup: int, global_batch: int, zero: int) -> tuple:
    L.seed_everything(0, verbose=False)
    devices = dp * tp * pp
    data = TextDataModule(batch_size=global_batch // dp, block_size=64)
    data.setup("fit")
    loader = DataLoader(data.train_dataloader().dataset, batch_size=global_batch // dp, shuffle=True)
    strategy = ParallelStrategy(data_parallel=dp, tensor_parallel=tp, pipeline_parallel=pp,
                                micro_batches=4 if pp > 1 else None, zero_stage=zero if dp > 1 else 0,
                                start_method="fork")
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, callbacks=[Probe(warmup, out_dir)])
        trainer.fit(GPT(), loader)
        per_rank = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(devices)]
    return per_rank[0][0], max(s for _, s, _ in per_rank), max(h for _, _, h in per_rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage for layouts with dp > 1")
    parser.add_argument("--overlap", action="store_true", help="DP2 x PP2 with and without the overlapped DP reduction")
    args = parser.parse_args()
    if args.overlap:
        return compare_overlap(args)
    results = {layout: [] for layout in LAYOUTS}
    for _ in range(args.repeats):
        for layout in LAYOUTS:
            results[layout].append(run_layout(*layout, args.steps, args.warmup, args.global_batch, args.zero))
    base = statistics.median(r[0] for r in results[LAYOUTS[0]])
    print(f"\nGPT {sum(p.numel() for p in GPT().parameters()) / 1e3:.0f}k params, 8 processes, global batch "
          f"{args.global_batch} x 64 tokens, ZeRO-{args.zero}, median of {args.repeats}")
    print(f"{'layout':<16} {'steps/s':>8} {'vs DP8':>7} {'model state/rank':>17} {'peak RSS growth/rank':>21}")
    for (dp, tp, pp), runs in results.items():
        rate = statistics.median(r[0] for r in runs)
        state = statistics.median(r[1] for r in runs)
        hwm = statistics.median(r[2] for r in runs)
        name = f"DP{dp} TP{tp} PP{pp}"
        print(f"{name:<16} {rate:>8.2f} {rate / base:>6.2f}x {state / 2**20:>14.2f} MiB {hwm / 2**20:>17.1f} MiB")


def compare_overlap(args) -> None:
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for overlap in (True, False):
            with nullcontext() if overlap else without_overlap():
                rates[overlap].append(run_layout(2, 1, 2, args.steps, args.warmup, args.global_batch, args.zero)[0])
    ratios = [a / b for a, b in zip(rates[True], rates[False])]
    print(f"\nDP2 x PP2 (4 processes), global batch {args.global_batch} x 64 tokens, 4 micro-batches, "
          f"ZeRO-{args.zero}, median of {args.repeats}")
    for overlap in (True, False):
        label = "overlapped with the flush" if overlap else "after the pipeline step"
        print(f"DP reduction {label:<27} {statistics.median(rates[overlap]):>6.2f} steps/s")
    print(f"ratio overlapped / after: {statistics.median(ratios):.3f}x (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
