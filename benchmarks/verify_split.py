"""What the setup check of a tensor-parallel split costs (``lightning_parallel/checks/verify_split.py``).

Fits a GPT (``models/gpt.py``) built on the meta device, as ``lp-train`` builds it, with
``ParallelStrategy(tensor_parallel=2)`` on 2 fork-started CPU processes for zero steps: setup
materialises each rank's shards and runs the check (a forward of the step on 2 samples to record the
units' inputs, then the embedding, one block and the head whole and split in float64, forward and
backward). Per rank: the check's seconds, the bytes of its own tensors at their peak (``Verification``),
and the growth of the process's resident memory while it ran (sampled every 5 ms).

    python benchmarks/verify_split.py              # the default GPT of lp-train
    python benchmarks/verify_split.py --size 1b    # GPT with ~1.0B parameters (needs ~12 GB of host memory)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import threading
import time
from pathlib import Path

import lightning as L
import psutil
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel.strategy.parallel as strategy_module
from lightning_parallel.models.gpt import GPT
from lightning_parallel.strategy import ParallelStrategy

SIZES = {
    "default": dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),  # lp-train's model
    "1b": dict(vocab_size=50304, block_size=128, n_layer=18, n_head=16, n_embd=2048),
}


class PeakRSS:
    """The largest resident memory of this process while inside, sampled every 5 ms."""

    def __init__(self) -> None:
        self.process, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self):
        self.before = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


def measured(out: Path):
    """``check_split_against_whole`` that leaves ``out/rank<r>.json`` with what it cost."""
    real = strategy_module.check_split_against_whole

    def check(strategy, trainer, checker, reference):
        start = time.perf_counter()
        with PeakRSS() as rss:
            report = real(strategy, trainer, checker, reference)
        result = {"seconds": time.perf_counter() - start, "check_tensors_mib": report.bytes / 2**20,
                  "rss_growth_mib": (rss.peak - rss.before) / 2**20, "rss_before_mib": rss.before / 2**20,
                  "units": report.units, "skipped": report.skipped, "closest": report.closest}
        (out / f"rank{strategy.global_rank}.json").write_text(json.dumps(result))
        return report

    return check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--out", type=Path, default=Path("/tmp/verify_split"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    strategy_module.check_split_against_whole = measured(args.out)  # fork-started ranks inherit it
    config = dict(SIZES[args.size], block_size=max(SIZES[args.size]["block_size"], args.seq))
    with torch.device("meta"):
        parameters = sum(p.numel() for p in GPT(**config).parameters())
    tokens = torch.randint(0, config["vocab_size"], (4, args.seq + 1), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=ParallelStrategy(tensor_parallel=2, start_method="fork"))
    with trainer.init_module(empty_init=True):
        model = GPT(**config)
    start = time.perf_counter()
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))
    print(f"GPT {args.size}: {parameters / 1e6:,.0f}M parameters, TP=2, {args.seq} tokens per sample; "
          f"setup and fit {time.perf_counter() - start:.0f} s")
    for rank in range(2):
        print(f"rank {rank}: {(args.out / f'rank{rank}.json').read_text()}")


if __name__ == "__main__":
    main()
