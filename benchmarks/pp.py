"""Pipeline parallelism: each of our schedules against its torch.distributed.pipelining peer.

Every pair trains the same GPT (``--layers`` blocks, d=128, T=64, tied embedding and head) cut
into the same stages (equal blocks per stage; the embeddings on the first stage, the final norm
and head on the last), from the same initial weights, on the same batch split into the same
micro-batches, with the same AdamW, on ``--stages`` local CPU processes (gloo, fork, one thread
each). The peers drive plain stage modules holding the GPT's own submodules:

=================  ==================================  =====================================
ours               torch peer                          model chunks per rank
=================  ==================================  =====================================
gpipe              ScheduleGPipe                       1
1f1b               Schedule1F1B                        1
interleaved_1f1b   ScheduleInterleaved1F1B             2, looped (rank r: stages r, r + P)
zb_h1              ScheduleInterleavedZeroBubble       1 (see below)
zbv                ScheduleZBVZeroBubble               2, V-shaped (rank r: r, 2P - 1 - r)
dualpipev          ScheduleDualPipeV                   2, V-shaped
=================  ==================================  =====================================

torch has no zero-bubble schedule written for one chunk per rank; its
``ScheduleInterleavedZeroBubble`` (Qi et al. 2023, arXiv 2401.10241) given one stage per rank
runs 1F1B's warm-up with the input and weight gradients split and each rank's weight passes
deferred behind its input-gradient passes, which is ZB-H1, so it is zb_h1's peer. At P=2 and P=4
with 8 micro-batches every peer orders the forwards, backwards and weight passes of each rank
exactly as ours does (``same order``: the peer's recorded intervals against our schedule), so a
pair differs only in how the step is executed; ours also splits the last backward of the schedules without weight
passes (``defer_last_weight_pass``). Both sides sum the tied embedding/head gradient every step
(on one rank when the V placement puts the first and last stage together, where the two stage
modules share the parameter). The loss of the last step of every run is compared between the
pair (``loss diff``): the same work was done.

Printed per pair: training steps per second of each (the inverse of the median step time on
rank 0 in a run, then the median over repeats) and their ratio (the median of the per-repeat
ratios ours / peer's; each repeat runs the two back to back, in alternating order, so a change in
machine load hits both alike), with the smallest and largest of those ratios (``min-max``: what machine
noise does to a single pair); the bubble of each, measured from the forward, input-gradient and
weight-gradient intervals of one step (idle share of ranks x step time,
``pipeline.timeline.bubble_fraction``); our bubble as the schedule simulator predicts it from the
mean F, B and W durations of that same step (``pipeline.schedules.simulator``); and the peak resident
memory per rank during a step above what the rank held once model, optimizer and pipeline were
built, measured in separate processes whose allocator returns every freed large tensor to the OS,
so buffers kept from step to step count as well as those allocated within one. Then our fastest
schedule against torch's ``Schedule1F1B``. A schedule ours does not have yet prints "not built".
``--timelines DIR`` saves one picture per schedule of ours (simulated step above, measured step
below) as ``DIR/timeline_<schedule>.png``.

Usage (the defaults take about five minutes on an idle two-core machine)::

    python benchmarks/pp.py                                   # P=2, 8 blocks, batch 64, M=8
    python benchmarks/pp.py --steps 10 --repeats 5 --timelines docs
    python benchmarks/pp.py --stages 4 --schedules 1f1b zb_h1 zbv
    python benchmarks/pp.py --steps 2 --repeats 1             # quick check that everything runs
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
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.models.gpt import GPT
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline import PipelineEngine
from lightning_parallel.pipeline.schedules import (
    REGISTRY,
    SCHEDULES,
    Interval,
    Op,
    defer_last_weight_pass,
    simulate,
    stages_of_rank,
    validate_schedule,
)
from lightning_parallel.pipeline.timeline import bubble_fraction, render

# ours -> torch's class of the same schedule
PEERS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zb_h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
TORCH_V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # torch places their stages with style="v"
SEQUENCE = 64


def chunks(schedule: str) -> int:
    """Model chunks per rank: the schedule's own number, 2 for interleaved 1F1B (which takes any from 2)."""
    return REGISTRY[schedule].chunks or 2


def peer_stages_of_rank(schedule: str, ranks: int, rank: int) -> list[int]:
    """The stages rank ``rank`` holds under the torch peer's placement of ``schedule``."""
    placement = "v" if PEERS[schedule] in TORCH_V_SHAPED else "loop"
    return stages_of_rank(rank, ranks, ranks * chunks(schedule), placement)


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


class PeerStage(nn.Module):
    """One stage of the GPT for torch's schedules, made of the GPT's own submodules (same weights).

    The first stage also embeds the tokens, the last applies the final norm and the head; with the
    V placement both sit on one rank and share the tied embedding/head parameter.
    """

    def __init__(self, gpt: GPT, blocks: range, first: bool, last: bool):
        super().__init__()
        t = gpt.transformer
        self.h = nn.ModuleList(t.h[i] for i in blocks)
        self.embed = nn.ModuleDict(dict(wte=t.wte, wpe=t.wpe, drop=t.drop)) if first else None
        self.head = nn.ModuleDict(dict(ln_f=t.ln_f, lm_head=gpt.lm_head)) if last else None

    def forward(self, x):
        if self.embed is not None:  # token ids (B, T) -> hidden states (B, T, C)
            x = self.embed.drop(self.embed.wte(x) + self.embed.wpe(torch.arange(x.size(1))))
        for block in self.h:
            x = block(x)
        if self.head is not None:  # (B, T, C) -> logits (B, T, vocab)
            x = self.head.lm_head(self.head.ln_f(x))
        return x


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The GPT's own optimizer (``GPT.configure_optimizers``) over ``params``: decay on matrices only."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95))


def timed(fn, intervals: list[Interval], rank: int, stage: int, op: Op):
    """Record the compute intervals of a peer stage (perf_counter is comparable across processes)."""
    def wrapper(chunk, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(chunk, *args, **kwargs)
        intervals.append(Interval(rank, op, chunk, stage, t0, time.perf_counter()))
        return out
    return wrapper


def build_ours(schedule: str, rank: int, args):
    mesh = ParallelMesh(args.stages, pipeline_parallel=args.stages).init_process_groups(rank)
    gpt = GPT(n_layer=args.layers)
    count = args.stages * chunks(schedule)
    engine = PipelineEngine(gpt, mesh, ParallelOptions(micro_batches=args.micro_batches, schedule=schedule,
                                                   virtual_stages=chunks(schedule),
                                                   pipeline_layout=[args.layers // count] * count))
    engine.partition()
    opt = gpt.configure_optimizers()

    def step(batch, record):
        engine.timeline = [] if record else None
        opt.zero_grad()
        loss = engine.training_step(batch, 0)
        engine.sync_tied_grads()
        opt.step()
        return engine.timeline, float(loss)
    return step


def build_torch(schedule: str, rank: int, args):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    gpt = GPT(n_layer=args.layers)
    count = args.stages * chunks(schedule)
    per_stage = args.layers // count
    owners = {s: r for r in range(args.stages) for s in peer_stages_of_rank(schedule, args.stages, r)}
    mine = peer_stages_of_rank(schedule, args.stages, rank)
    modules = {s: PeerStage(gpt, range(s * per_stage, (s + 1) * per_stage), s == 0, s == count - 1) for s in mine}
    stages = [PipelineStage(modules[s], s, count, torch.device("cpu")) for s in mine]
    kind = getattr(torch_schedules, PEERS[schedule])
    M = args.micro_batches

    def loss_fn(logits, y):  # the mean over the batch, as ours computes it (scale_grads=False below)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()) / M

    one_stage = issubclass(kind, torch_schedules.PipelineScheduleSingle)  # GPipe, 1F1B take a stage, not a list
    peer = kind(stages[0] if one_stage else stages, M, loss_fn=loss_fn, scale_grads=False)
    intervals: list[Interval] = []
    for s, stage in zip(mine, stages):
        stage.forward_one_chunk = timed(stage.forward_one_chunk, intervals, rank, s, Op.F)
        # with full_backward=True (unsplit schedules) it computes both gradients, as our B does there
        stage.backward_one_chunk = timed(stage.backward_one_chunk, intervals, rank, s, Op.B)
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, intervals, rank, s, Op.W)
    compute_loss = peer._compute_loss

    def loss_in_forward(*a, **kw):  # ours computes the loss inside its forward: count it there too
        out = compute_loss(*a, **kw)
        intervals[-1].end = time.perf_counter()
        return out
    peer._compute_loss = loss_in_forward
    params = list({id(p): p for m in modules.values() for p in m.parameters()}.values())
    opt = adamw(params)
    # the tied embedding/head: its gradient is summed over the ranks of the first and last stage
    tied_ranks = sorted({owners[0], owners[count - 1]})
    tied_group = dist.new_group(tied_ranks) if len(tied_ranks) > 1 else None  # every rank creates it
    tied = gpt.lm_head.weight

    def step(batch, record):
        x, y = batch
        intervals.clear()
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        inputs = (x,) if 0 in mine else ()
        peer.step(*inputs, target=y if count - 1 in mine else None, losses=losses)
        if tied_group is not None and rank in tied_ranks:
            dist.all_reduce(tied.grad, group=tied_group)
        opt.step()
        return (list(intervals) if record else None), (float(sum(losses)) if losses else None)
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


def worker(rank, impl, schedule, args, port, out, measure):
    """Time steps (default allocator) or, in a fresh process, measure one step's memory growth."""
    warnings.filterwarnings("ignore")
    if measure == "memory":
        release_freed_memory_to_the_os()  # slows every large allocation, so timing runs without it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.stages)
    torch.manual_seed(0)
    step = (build_ours if impl == "ours" else build_torch)(schedule, rank, args)
    built = rss_bytes()  # model, optimizer and pipeline built; everything a step adds counts, kept or not
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, 256, (args.batch, SEQUENCE), generator=g) for _ in range(2))
    for _ in range(2):  # warm-up (the peer infers shapes on its first step)
        step(batch, False)
    dist.barrier()
    if measure == "memory":
        result = {"memory": peak_growth(lambda: step(batch, False), built)}
    else:
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(batch, False)
            times.append(time.perf_counter() - t0)
        rate = 1 / statistics.median(times)  # a step another process preempted counts as one of the slow ones
        dist.barrier()
        intervals, loss = step(batch, True)
        result = {"rate": rate, "intervals": [vars(i) for i in intervals], "loss": loss,
                  "message": message_time(rank, (args.batch // args.micro_batches, SEQUENCE, 128))}
    torch.save(result, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def message_time(rank: int, shape: tuple[int, ...], repeats: int = 20) -> float:
    """One-way time of a hidden state between ranks 0 and 1: half the median round trip."""
    buffer, times = torch.zeros(shape), []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2


def launch(impl: str, schedule: str, args, measure: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, (impl, schedule, args, port, out, measure), nprocs=args.stages, start_method="fork")
        # written a moment ago by this run's own processes (their intervals hold ``Op`` members)
        return [torch.load(f"{out}/{r}.pt", weights_only=False) for r in range(args.stages)]


def predicted_bubble(schedule: str, intervals: list[Interval], message: float, args) -> float:
    """The simulator's bubble for the actions our engine runs, costed per stage by the means of
    ``intervals``, each message between ranks taking ``message`` (measured apart, by ping-pong).

    Those actions are the schedule's, with the rank's last backward split where the schedule has no
    weight passes (``defer_last_weight_pass``). On each stage a weight pass costs its mean measured
    ``W``; an input-gradient pass the stage's mean backward of a micro-batch (``B`` plus its ``W``, if
    any) less that, so an unsplit ``B`` costs the mean whole backward. Stages differ: the first has
    no input gradient to compute (its ``B`` is empty, its ``W`` the whole backward), the last computes
    the loss.
    """
    plan = validate_schedule(schedule, args.stages, args.micro_batches, chunks(schedule))
    plan = [defer_last_weight_pass(acts) for acts in plan]

    forwards, weights = defaultdict(list), defaultdict(list)
    backward_of = defaultdict(float)  # (stage, micro-batch) -> its B plus its W
    for i in intervals:
        if i.op is Op.F:
            forwards[i.stage].append(i.end - i.start)
        else:
            backward_of[(i.stage, i.microbatch)] += i.end - i.start
            if i.op is Op.W:
                weights[i.stage].append(i.end - i.start)
    forward = {stage: statistics.fmean(d) for stage, d in forwards.items()}
    weight = {stage: statistics.fmean(weights[stage]) if weights[stage] else 0.0 for stage in forwards}
    backward = {stage: statistics.fmean(d for (s, _), d in backward_of.items() if s == stage) - weight[stage]
                for stage in forwards}
    return simulate(plan, forward, backward, weight, message).bubble_fraction


def same_order(schedule: str, intervals: list[Interval], args) -> bool:
    """Whether the peer ran each rank's forwards, backwards and weight passes in our schedule's order."""
    plan = validate_schedule(schedule, args.stages, args.micro_batches, chunks(schedule))
    for rank, actions in enumerate(plan):
        ran = sorted((i for i in intervals if i.rank == rank), key=lambda i: i.start)
        if [(i.op, i.microbatch, i.stage) for i in ran] != [(a.op, a.microbatch, a.stage) for a in actions
                                                              if a.op.is_compute]:
            return False
    return True


def run(impl: str, schedule: str, args) -> dict:
    timed_ranks, memory_ranks = launch(impl, schedule, args, "time"), launch(impl, schedule, args, "memory")
    intervals = [Interval(**i) for r in timed_ranks for i in r["intervals"]]
    return {
        "same order": same_order(schedule, intervals, args) if impl == "torch" and schedule in SCHEDULES else None,
        "rate": timed_ranks[0]["rate"],
        "bubble": bubble_fraction(intervals, args.stages),
        "predicted": predicted_bubble(schedule, intervals, timed_ranks[0]["message"], args) if impl == "ours" else None,
        "memory": [r["memory"] / 2**20 for r in memory_ranks],
        "loss": next(r["loss"] for r in timed_ranks if r["loss"] is not None),
        "intervals": intervals,
    }


def check(args, parser) -> None:
    """Refuse, before any process starts, sizes that some schedule of the run cannot split."""
    for schedule in args.schedules:
        count = args.stages * chunks(schedule)
        if args.layers % count:
            parser.error(f"{schedule} cuts the GPT into {count} stages of equal blocks, so --layers must be a "
                         f"multiple of {count}, got {args.layers}; use --layers {count * max(1, args.layers // count)}")
    if args.batch % args.micro_batches:
        parser.error(f"--batch ({args.batch}) must be a multiple of --micro-batches ({args.micro_batches})")
    if "interleaved_1f1b" in args.schedules and args.micro_batches % args.stages:
        parser.error(f"interleaved_1f1b needs --micro-batches ({args.micro_batches}) to be a multiple of "
                     f"--stages ({args.stages}), e.g. {args.stages * max(1, args.micro_batches // args.stages)}")
    if "dualpipev" in args.schedules and args.micro_batches < 2 * args.stages:
        parser.error(f"torch's ScheduleDualPipeV needs at least 2P = {2 * args.stages} micro-batches, got "
                     f"--micro-batches {args.micro_batches}")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2, help="pipeline ranks P (processes)")
    parser.add_argument("--layers", type=int, default=8, help="GPT blocks; a multiple of 2P for two chunks per rank")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every implementation, interleaved")
    parser.add_argument("--schedules", nargs="+", choices=list(PEERS), default=list(PEERS))
    parser.add_argument("--timelines", metavar="DIR", help="save DIR/timeline_<schedule>.png for each of ours")
    args = parser.parse_args(argv)
    check(args, parser)
    built = [s for s in args.schedules if s in SCHEDULES]
    runs: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for repeat in range(args.repeats):
        for schedule in args.schedules:
            impls = (["ours"] if schedule in built else []) + ["torch"]
            for impl in impls if repeat % 2 == 0 else impls[::-1]:
                runs[(impl, schedule)].append(run(impl, schedule, args))
    report(args, built, runs)
    if args.timelines:
        for schedule in built:
            path = os.path.join(args.timelines, f"timeline_{schedule}.png")
            measured = runs[("ours", schedule)][-1]["intervals"]
            render(path, args.stages, args.micro_batches, schedule, chunks(schedule), measured)
            print(f"wrote {path}")


COLUMNS = (("schedule", 17), ("torch peer", 30), ("ours/s", 10), ("peer/s", 7), ("ratio", 7), ("min-max", 11),
           ("bubble ours", 12),
           ("simulated", 10), ("bubble peer", 12), ("MB/rank ours", 14), ("MB/rank peer", 14), ("loss diff", 10),
           ("same order", 11))


def row(*cells: str) -> str:
    """One line of the table: the first two cells left-aligned, the figures right-aligned."""
    return "".join(f"{c:<{w}}" if k < 2 else f"{c:>{w}}" for k, (c, (_, w)) in enumerate(zip(cells, COLUMNS)))


def report(args, built: list[str], runs: dict) -> None:
    print(f"GPT of {args.layers} blocks (d=128, T={SEQUENCE}), {args.stages} ranks, batch {args.batch} in "
          f"{args.micro_batches} micro-batches, {args.steps} timed steps per run, medians of {args.repeats} repeats")
    print(row(*(name for name, _ in COLUMNS)))

    def median(key, impl, schedule):
        return statistics.median(r[key] for r in runs[(impl, schedule)])

    def memory(impl, schedule):
        return "/".join(f"{statistics.median(r['memory'][k] for r in runs[(impl, schedule)]):.0f}"
                        for k in range(args.stages))

    def ratios(ours, peer):
        return [o["rate"] / p["rate"] for o, p in zip(runs[ours], runs[peer])]

    def ratio(ours, peer):
        return statistics.median(ratios(ours, peer))

    for schedule in args.schedules:
        ours, peer = ("ours", schedule), ("torch", schedule)
        if schedule not in built:
            print(row(schedule, PEERS[schedule], "not built", f"{median('rate', *peer):.2f}", "", "", "", "",
                      f"{median('bubble', *peer):.1%}", "", memory(*peer), ""))
            continue
        diff = statistics.median(abs(o["loss"] - p["loss"]) for o, p in zip(runs[ours], runs[peer]))
        print(row(schedule, PEERS[schedule], f"{median('rate', *ours):.2f}", f"{median('rate', *peer):.2f}",
                  f"{ratio(ours, peer):.2f}x", f"{min(ratios(ours, peer)):.2f}-{max(ratios(ours, peer)):.2f}",
                  f"{median('bubble', *ours):.1%}", f"{median('predicted', *ours):.1%}",
                  f"{median('bubble', *peer):.1%}", memory(*ours), memory(*peer), f"{diff:.1e}",
                  "yes" if all(r["same order"] for r in runs[peer]) else "no"))
    if built and "1f1b" in args.schedules:
        best = max(built, key=lambda s: median("rate", "ours", s))
        print(f"our fastest, {best}, against torch's Schedule1F1B: {ratio(('ours', best), ('torch', '1f1b')):.2f}x")


if __name__ == "__main__":
    main()
