"""Pipeline parallelism: our engine against torch.distributed.pipelining on the same split.

The default GPT (4 blocks, d=128, T=64) in 2 stages of 2 blocks, batch 64 in 8 micro-batches,
2 local CPU processes (gloo, fork, one thread each). Peers: ``Schedule1F1B`` and
``ScheduleGPipe`` driving hand-written stage modules with the same weights; as in ours, the
embedding on the first stage and the head on the last (one tied weight in the GPT) get their
gradients summed every step. For each we print
training steps per second and the bubble measured from the forward and backward intervals of one
step, with the default allocator, and, in separate processes whose allocator returns every freed
large tensor to the OS, the peak resident memory per rank during a step above what it held once
the model, optimizer and pipeline were built, so that buffers a pipeline keeps from step to step
count as well as those it allocates within one (medians over repeats).
Each repeat launches every implementation once, one after the other, so a change in machine load
hits all of them alike; the ratio is the median of the per-repeat ratios ours / peer's.

    python benchmarks/pp.py [--steps 5 --repeats 5 --batch 64 --micro-batches 8]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import statistics
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.models.gpt import GPT
from lightning_parallel.pipeline import PipelineEngine
from lightning_parallel.pipeline.simulator import Interval
from lightning_parallel.pipeline.timeline import bubble_fraction

STAGES = 2


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_growth(fn, base: int) -> int:
    """Largest resident memory above ``base`` while ``fn`` runs (sampled every 0.5 ms)."""
    peak, running = [0], [True]

    def sample():
        while running[0]:
            peak[0] = max(peak[0], rss_bytes() - base)
            time.sleep(0.0005)

    thread = threading.Thread(target=sample)
    thread.start()
    fn()
    running[0] = False
    thread.join()
    return peak[0]


class FirstStage(nn.Module):
    def __init__(self, gpt: GPT):
        super().__init__()
        t = gpt.transformer
        self.wte, self.wpe, self.drop, self.h = t.wte, t.wpe, t.drop, nn.ModuleList(t.h[:2])

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1))))
        for block in self.h:
            x = block(x)
        return x


class LastStage(nn.Module):
    def __init__(self, gpt: GPT):
        super().__init__()
        self.h, self.ln_f, self.lm_head = nn.ModuleList(gpt.transformer.h[2:]), gpt.transformer.ln_f, gpt.lm_head

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def cross_entropy(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def timed(fn, intervals, rank, op):
    """Record the compute intervals of the peer's stage (perf_counter is comparable across processes)."""
    def wrapper(chunk, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(chunk, *args, **kwargs)
        intervals.append(Interval(rank, op, chunk, rank, t0, time.perf_counter()))
        return out
    return wrapper


def build(impl: str, rank: int, micro_batches: int):
    """A ``step(batch)`` closure for ``impl`` and where it records its compute intervals."""
    torch.manual_seed(0)
    gpt = GPT()
    if impl.startswith("ours"):
        mesh = ParallelMesh(STAGES, pipeline_parallel=STAGES).init_process_groups(rank)
        engine = PipelineEngine(gpt, mesh, micro_batches, impl.split("-")[1])
        engine.partition()
        opt = gpt.configure_optimizers()

        def step(batch, record):
            engine.timeline = [] if record else None
            opt.zero_grad()
            engine.training_step(batch, 0)
            engine.sync_tied_grads()
            opt.step()
            return engine.timeline
        return step

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module = FirstStage(gpt) if rank == 0 else LastStage(gpt)
    stage = PipelineStage(module, rank, STAGES, torch.device("cpu"))
    kind = Schedule1F1B if impl == "torch-1f1b" else ScheduleGPipe
    schedule = kind(stage, micro_batches, loss_fn=cross_entropy)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    intervals = []
    stage.forward_one_chunk = timed(stage.forward_one_chunk, intervals, rank, "F")
    stage.backward_one_chunk = timed(stage.backward_one_chunk, intervals, rank, "B")

    tied = module.wte.weight if rank == 0 else module.lm_head.weight

    def step(batch, record):
        x, y = batch
        intervals.clear()
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        # the GPT ties its embedding to its head: each stage holds a copy whose gradient is the sum
        dist.all_reduce(tied.grad)
        opt.step()
        return list(intervals) if record else None
    return step


def release_freed_memory_to_the_os() -> None:
    """Make freed tensors leave the resident set, so RSS growth tracks live memory.

    glibc raises its mmap threshold after large frees and then keeps freed tensors in the heap;
    fixing the threshold at 64 KiB returns every larger tensor to the OS when it is freed.
    """
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    libc.malloc_trim(0)


def worker(rank, impl, args, port, out, measure):
    """Time steps (default allocator) or, in a fresh process, measure one step's memory growth."""
    warnings.filterwarnings("ignore")
    if measure == "memory":
        release_freed_memory_to_the_os()  # slows every large allocation, so timing runs without it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    step = build(impl, rank, args.micro_batches)
    built = rss_bytes()  # model, optimizer and pipeline built; everything a step adds counts, kept or not
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 256, (args.batch, 64), generator=g), torch.randint(0, 256, (args.batch, 64), generator=g))
    for _ in range(2):  # warm-up (the peer infers shapes on its first step)
        step(batch, False)
    dist.barrier()
    if measure == "memory":
        result = {"memory": peak_growth(lambda: step(batch, False), built)}
    else:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(batch, False)
        dist.barrier()
        rate = args.steps / (time.perf_counter() - t0)
        result = {"rate": rate, "intervals": [vars(i) for i in step(batch, True)]}
    torch.save(result, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def launch(impl: str, args, measure: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, (impl, args, port, out, measure), nprocs=STAGES, start_method="fork")
        return [torch.load(f"{out}/{r}.pt") for r in range(STAGES)]


def run(impl: str, args) -> dict:
    timed_ranks, memory_ranks = launch(impl, args, "time"), launch(impl, args, "memory")
    bubble = bubble_fraction([Interval(**i) for r in timed_ranks for i in r["intervals"]], STAGES)
    return {"rate": timed_ranks[0]["rate"], "bubble": bubble, "memory": [r["memory"] / 2**20 for r in memory_ranks]}


IMPLS = ("ours-1f1b", "torch-1f1b", "ours-gpipe", "torch-gpipe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
    for _ in range(args.repeats):
        for impl in IMPLS:
            runs[impl].append(run(impl, args))
    print(f"default GPT, {STAGES} stages, batch {args.batch}, {args.micro_batches} micro-batches, "
          f"{args.steps} timed steps per run, medians of {args.repeats} runs")
    print(f"{'schedule':<10}{'ours steps/s':>14}{'peer steps/s':>14}{'ratio':>8}{'ours bubble':>13}{'peer bubble':>13}"
          f"{'ours MB/rank':>16}{'peer MB/rank':>16}")

    def median(impl, key):
        return statistics.median(r[key] for r in runs[impl])

    def memory(impl):
        return "/".join(f"{statistics.median(r['memory'][k] for r in runs[impl]):.0f}" for k in range(STAGES))

    for schedule in ("1f1b", "gpipe"):
        ours, peer = f"ours-{schedule}", f"torch-{schedule}"
        ratio = statistics.median(o["rate"] / p["rate"] for o, p in zip(runs[ours], runs[peer]))
        print(f"{schedule:<10}{median(ours, 'rate'):>14.2f}{median(peer, 'rate'):>14.2f}{ratio:>7.2f}x"
              f"{median(ours, 'bubble'):>13.1%}{median(peer, 'bubble'):>13.1%}{memory(ours):>16}{memory(peer):>16}")


if __name__ == "__main__":
    main()
