"""Tensor parallelism against PyTorch's DTensor ``parallelize_module`` on the default GPT.

Runs, in one invocation: one process (the reference), our ``parallelize`` at TP=2, and DTensor TP=2
with ``ColwiseParallel``/``RowwiseParallel`` on the same blocks (``c_attn``, ``c_fc`` colwise;
``attn.c_proj``, ``mlp.c_proj`` rowwise). Each run trains the unchanged GPT (forward, backward,
AdamW) and reports steps/s as the median of repeats, plus the bytes that went through
collectives per step, counted the same way for both: for each collective, the size of the largest
tensor it touches (the full tensor of an all-reduce, the output of an all-gather, the input of a
reduce-scatter). Megatron's figure for comparison: 4 all-reduces of batch x seq x hidden per layer.

DTensor's ``ColwiseParallel`` on the fused ``c_attn`` splits rows ``[q; k; v]`` contiguously, so a
rank would get q and half of k; for a like-for-like (correct) peer its rows are first permuted so
each rank's slice holds its own heads of q, k and v. The permutation of a random init changes no cost.

    python benchmarks/tp.py [--steps 10 --repeats 5 --batch 8]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing as mp
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.models.gpt import GPT
from lightning_parallel.tensor_parallel import parallelize

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# data-moving ops only (DTensor's functional collectives also dispatch wait/wrap ops)
COLLECTIVE_NAMES = (
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "alltoall",
)


class CollectiveBytes(TorchDispatchMode):
    """Sums, over collectives, the bytes of the largest tensor each one touches."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in COLLECTIVE_NAMESPACES and any(n in func.__name__ for n in COLLECTIVE_NAMES):
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.bytes += max((t.numel() * t.element_size() for t in tensors), default=0)
        return out


# the blocks only, as the DTensor peer is sharded (the default plan also splits the tied vocabulary)
BLOCKS_PLAN = {
    "transformer.h.*.attn": "attention",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
}


def make_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=args.seq, n_layer=4, n_head=4, n_embd=128, dropout=0.0)


def interleave_qkv_rows(model: GPT, tp: int) -> None:
    """Reorder fused c_attn rows from [q; k; v] to [q0 k0 v0 | q1 k1 v1 ...] (rank r's heads)."""
    for block in model.transformer.h:
        layer = block.attn.c_attn
        for p in (layer.weight, layer.bias):
            parts = [t.chunk(tp) for t in p.data.chunk(3)]
            p.data.copy_(torch.cat([parts[b][r] for r in range(tp) for b in range(3)]))


def dtensor_parallelize(model: GPT, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    interleave_qkv_rows(model, world)
    mesh = init_device_mesh("cpu", (world,))
    plan = {
        "attn.c_attn": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    for block in model.transformer.h:
        parallelize_module(block, mesh, plan)


def run(kind: str, rank: int, world: int, args) -> tuple[float, int]:
    """Steps/s over ``args.steps`` steps and collective bytes of one step, for one way of parallelising."""
    model = make_model(args)
    if kind.startswith("ours"):
        mesh = ParallelMesh(world, tensor_parallel=world).init_process_groups(rank)
        with contextlib.redirect_stdout(io.StringIO()):  # the plan table, once per launch
            parallelize(model, mesh, BLOCKS_PLAN if kind == "ours_blocks" else None)
    elif kind == "dtensor":
        dtensor_parallelize(model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    batch = (data[:, :-1].contiguous(), data[:, 1:].contiguous())

    def step():
        loss = model._loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    counter = CollectiveBytes()
    with counter:
        step()
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    return args.steps / (time.perf_counter() - start), counter.bytes


def _worker(kind, rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    result = run(kind, rank, world, args)
    queue.put((rank, result))
    dist.destroy_process_group()


def launch(kind: str, world: int, args) -> tuple[float, int]:
    """Steps/s (rank 0) and bytes per step of ``kind`` on ``world`` fork-started processes."""
    if world == 1:
        torch.set_num_threads(1)
        return run(kind, 0, 1, args)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(kind, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join()
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    # the runs alternate, repeat after repeat, so that load from elsewhere on the machine hits all alike
    runs = {"single": 1, "ours": 2, "ours_blocks": 2, "dtensor": 2}
    results: dict[str, list[tuple[float, int]]] = {kind: [] for kind in runs}
    for _ in range(args.repeats):
        for kind, world in runs.items():
            results[kind].append(launch(kind, world, args))
    rate = {k: statistics.median(r for r, _ in results[k]) for k in runs}
    nbytes = {k: results[k][0][1] for k in runs}
    megatron = 4 * 4 * args.batch * args.seq * 128 * 4  # 4 layers x 4 all-reduces of b*s*h float32
    labels = {
        "single": "one process",
        "ours": "ours TP=2",
        "ours_blocks": "ours TP=2, blocks only",
        "dtensor": "DTensor TP=2, blocks",
    }
    print(
        f"default GPT (4 layers, d=128, vocab 256), batch {args.batch} x seq {args.seq}, "
        f"median of {args.repeats} x {args.steps} steps"
    )
    print(f"{'run':<26}{'steps/s':>9}{'vs 1 proc':>11}{'vs DTensor':>12}{'MB/step':>9}")
    for kind, label in labels.items():
        print(
            f"{label:<26}{rate[kind]:>9.2f}{rate[kind] / rate['single']:>11.2f}"
            f"{rate[kind] / rate['dtensor']:>12.2f}{nbytes[kind] / 1e6:>9.2f}"
        )
    print(f"Megatron's 4 all-reduces of b*s*h per layer, 4 layers: {megatron / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
