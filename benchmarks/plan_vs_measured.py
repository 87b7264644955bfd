"""How well the planner's cost model ranks layouts: predicted against measured step time.

Calibrates the rates on this machine (``planner/calibrate.py``: 8 processes, the default GPT's
hidden size), predicts the step time of each layout of ``benchmarks/3d.py`` (8 CPU processes, the
default GPT, global batch 64 x 64 tokens, 4 micro-batches and 1F1B where pipelined), then runs each
layout as ``3d.py`` does and reports the Spearman rank correlation between predicted and measured
step time, and whether the layout predicted best is within 10 % of the measured best.

Run: ``python benchmarks/plan_vs_measured.py [--steps 12] [--repeats 1]``. On a shared machine the
measured times are noisy; repeats are interleaved across layouts and their median is used.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path

import torch

from lightning_parallel.models.gpt import GPT
from lightning_parallel.planner import Cluster, Constraints, Workload, search
from lightning_parallel.planner.auto import device_memory
from lightning_parallel.planner.calibrate import measure


def _benchmark_3d():
    spec = importlib.util.spec_from_file_location("benchmark_3d", Path(__file__).with_name("3d.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            result[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return result


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def predict(layouts, global_batch: int, zero: int, rates) -> list[float]:
    with torch.device("meta"):
        model = GPT()
    cluster = Cluster(1, 8, device_memory("cpu", 8), rates, shared_compute=True)
    work = Workload(seq=64, global_batch=global_batch)
    times = []
    for dp, tp, pp in layouts:
        pinned = Constraints(tp=tp, pp=pp, dp=dp, micro_batches=4 if pp > 1 else None,
                             schedule="1f1b" if pp > 1 else None, virtual_stages=1,
                             zero=bool(zero) and dp > 1, recompute=(False,))
        times.append(search(model, cluster, work, pinned).best.prediction.step_time)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage for layouts with dp > 1")
    args = parser.parse_args()
    bench = _benchmark_3d()
    rates = measure(8, GPT().hparams.n_embd, "cpu")
    print(f"calibrated: {rates.flops / 1e9:.1f} GFLOP/s per process, all-reduce {rates.intra_bandwidth / 1e6:.0f} "
          f"MB/s, {rates.latency * 1e6:.0f} us per message, AdamW {rates.optimizer / 1e6:.1f}M parameters/s")
    predicted = predict(bench.LAYOUTS, args.global_batch, args.zero, rates)
    runs: dict[tuple, list[float]] = {layout: [] for layout in bench.LAYOUTS}
    for _ in range(args.repeats):
        for layout in bench.LAYOUTS:
            rate = bench.run_layout(*layout, args.steps, args.warmup, args.global_batch, args.zero)[0]
            runs[layout].append(1.0 / rate)
    measured = [statistics.median(runs[layout]) for layout in bench.LAYOUTS]

    print(f"\n{'layout':<16} {'predicted':>10} {'measured':>10} {'pred rank':>9} {'meas rank':>9}")
    for (dp, tp, pp), p, m, rp, rm in zip(bench.LAYOUTS, predicted, measured, ranks(predicted), ranks(measured)):
        print(f"{f'DP{dp} TP{tp} PP{pp}':<16} {p * 1e3:>8.1f}ms {m * 1e3:>8.1f}ms {rp:>9.1f} {rm:>9.1f}")
    rho = spearman(predicted, measured)
    best_predicted = measured[predicted.index(min(predicted))]
    gap = best_predicted / min(measured) - 1
    print(f"Spearman rank correlation: {rho:.2f} (target >= 0.8)")
    print(f"predicted best runs {gap:+.1%} slower than the measured best "
          f"({'within' if gap <= 0.10 else 'outside'} 10 %)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
