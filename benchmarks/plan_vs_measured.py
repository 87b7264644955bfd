"""How well the planner's model of a module matches a run of it: peak memory per rank and step times.

**Memory** (``--part memory``): for six kinds of module (``plan_models.py``: dense, MoE, CNN,
encoder, ``nn.Transformer``, a module naming no sizes) at 2 and 4 processes, ``strategy=auto`` chooses
a layout (and, at 4 processes, PP 2 and TP 2 are pinned too where the model splits so), trains it,
and each rank measures its peak tensor memory in its third step (``tests/helpers/peak.py``): the bytes
of every tensor alive when the step starts, plus the most bytes of tensors created during the step
(forward, backward, optimizer) alive at once, counted by a ``TorchDispatchMode`` that follows every
operator's outputs until they are freed. The allocator of a CPU process cannot be asked for its peak,
and the resident set carries the interpreter and libraries; this counts what the estimate counts, and
the buffers and temporaries it does not. Printed beside the estimate of the busiest rank (``planner/estimate.py``).

**Step time** (``--part timing``): on three of the modules at 4 processes, every TP x PP layout the
model splits into is trained (the ZeRO stage the search picks, 1F1B with 4 micro-batches where
pipelined) and timed: the median step after two warm-up steps, over the sequences of a step (the
search ranks time per sequence). Printed: the Spearman rank correlation of predicted and measured
times (``planner/cost.py`` with the nominal CPU rates ``strategy=auto`` uses), and whether the layout
predicted fastest is within 10 % of the fastest measured.

``--part gpt8`` keeps the earlier comparison: the layouts of ``benchmarks/3d.py`` (8 processes, the
default GPT) with rates calibrated on this machine.

Run: ``python benchmarks/plan_vs_measured.py [--part all] [--steps 6]``. On a shared machine the timings
are noisy; run it on an idle one for a ranking to trust.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_parallel import ParallelStrategy
from lightning_parallel.models.gpt import GPT
from lightning_parallel.planner import Cluster, Constraints, Workload, search
from lightning_parallel.planner.auto import device_memory
from lightning_parallel.planner.calibrate import measure
from tests.helpers.peak import PeakProbe


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


def gpt8(args) -> None:
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


# ---- peak memory per rank -----------------------------------------------------------------------
def run(name: str, devices: int, sizes: dict, steps: int, batch: int = 8) -> list[dict]:
    """Train ``name`` on ``devices`` processes with ``sizes`` (numbers pin, "auto" searches); one dict per rank."""
    from benchmarks.plan_models import MODELS

    make_model, make_data = MODELS[name]
    L.seed_everything(0, verbose=False)
    options = {"tensor_parallel": "auto", "pipeline_parallel": "auto", "schedule": "auto", "virtual_stages": "auto",
               "zero_stage": "auto", **sizes}
    with tempfile.TemporaryDirectory() as out:
        trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=steps, logger=False,
                            strategy=ParallelStrategy(start_method="fork", **options), enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=[PeakProbe(out)])
        trainer.fit(make_model(), DataLoader(make_data(), batch_size=batch, shuffle=False))
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(devices)]


PIPELINED = {"pipeline_parallel": 2, "tensor_parallel": 1, "micro_batches": 2, "schedule": "1f1b", "virtual_stages": 1}
TENSOR_PARALLEL = {"tensor_parallel": 2, "pipeline_parallel": 1}


def memory(args) -> None:
    from benchmarks.plan_models import MODELS

    print(f"{'model':<12} {'procs':>5} {'layout':<34} {'predicted':>10} {'measured':>10} {'error':>7}")
    errors = []
    for name in MODELS:
        for devices, sizes in ((2, {}), (4, {}), (4, PIPELINED), (4, TENSOR_PARALLEL)):
            try:
                ranks = run(name, devices, sizes, steps=4)
            except Exception as err:  # noqa: BLE001 - a layout this model does not run: say so, go on
                pinned = f"tp={sizes['tensor_parallel']} pp={sizes['pipeline_parallel']} pinned"
                print(f"{name:<12} {devices:>5} {pinned:<34} refused: {str(err).splitlines()[0][:60]}")
                continue
            busiest = max(ranks, key=lambda r: r["measured"])
            error = busiest["predicted"] / busiest["measured"] - 1
            errors.append(abs(error))
            print(f"{name:<12} {devices:>5} {busiest['layout']:<34} {busiest['predicted'] / 2**20:>7.2f} MiB "
                  f"{busiest['measured'] / 2**20:>7.2f} MiB {error:>+7.1%}")
    within = sum(e <= 0.15 for e in errors)
    print(f"{within} of {len(errors)} runs within 15 % (median |error| {statistics.median(errors):.1%})")


# ---- step time over every layout ------------------------------------------------------------------
LAYOUTS = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)]  # (tp, pp) on 4 processes


def timing(args) -> None:
    for name in ("custom", "dense", "encoder"):
        predicted, measured, names = [], [], []
        for tp, pp in LAYOUTS:
            sizes = {"tensor_parallel": tp, "pipeline_parallel": pp, "virtual_stages": 1,
                     "schedule": "1f1b", "micro_batches": 4 if pp > 1 else None}
            try:
                ranks = run(name, 4, sizes, steps=args.steps, batch=16)
            except Exception as err:  # noqa: BLE001
                print(f"{name} tp={tp} pp={pp}: not run ({str(err).splitlines()[0][:70]})")
                continue
            # per sequence, as the search ranks: a layout with more replicas reads more sequences per step
            predicted.append(ranks[0]["predicted_step"] / ranks[0]["sequences"])
            measured.append(max(r["step"] for r in ranks) / ranks[0]["sequences"])
            names.append(f"tp={tp} pp={pp}")
        print(f"\n{name}: {'layout':<12} {'predicted':>10} {'measured':>10}  (per sequence)")
        for n, p, m in zip(names, predicted, measured):
            print(f"{'':<{len(name) + 2}}{n:<12} {p * 1e3:>8.2f}ms {m * 1e3:>8.2f}ms")
        chosen = measured[predicted.index(min(predicted))]
        gap = chosen / min(measured) - 1
        rho = spearman(predicted, measured) if len(names) > 2 else float("nan")
        print(f"{name}: Spearman {rho:.2f}; predicted best runs {gap:+.1%} vs the measured best "
              f"({'within' if gap <= 0.10 else 'outside'} 10 %)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("memory", "timing", "gpt8", "all"), default="all")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage for layouts with dp > 1 (gpt8)")
    args = parser.parse_args()
    if args.part in ("memory", "all"):
        memory(args)
    if args.part in ("timing", "all"):
        timing(args)
    if args.part == "gpt8":
        gpt8(args)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
