"""The rates of the cost model, measured on this machine in a few seconds, or nominal for a device kind.

``measure`` starts one process per local device (fork on CPU, spawn on CUDA), each first timing a
matmul of the model's hidden size (``tokens x h`` by ``h x 4h``, the MLP's first layer), then an
AdamW step, while all the others do the same, so the rate is what one device sustains when every
device computes (on a CPU the processes share its cores); then the processes time all-reduces over
gloo (CPU) or NCCL (CUDA) of two sizes, 256 KiB and 8 MiB (256 MiB on GPUs), through which a line
gives the latency of a ring step and the bus bandwidth
(``t = 2 (k - 1) latency + 2 (k - 1) / k * bytes / bandwidth``). Across nodes nothing is measured:
give ``--inter-bandwidth``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from lightning_parallel.planner.space import Rates

# nominal rates when nothing is measured (``Rates`` fields: FLOP/s per device, intra-node and
# inter-node all-reduce bus bandwidth in bytes/s, seconds per message, parameters per second of an
# AdamW step). CUDA: an H100-class GPU at ~40 % of its dense bf16 peak, NVLink, one 200 Gb/s NIC per
# GPU, AdamW at ~40 % of HBM bandwidth (28 bytes per parameter); CPU: 8 gloo processes sharing 2
# cores, as `measure` found them (benchmarks/plan_vs_measured.py prints its figures).
NOMINAL = {
    "cuda": Rates(4e14, 2e11, 2.5e10, 1e-5, 5e10),
    "cpu": Rates(1e10, 6e8, 6e8, 2e-3, 3e7),
}


def nominal(kind: str) -> Rates:
    """The rates in ``NOMINAL`` for ``"cuda"`` or ``"cpu"`` (any other device kind reads as CPU)."""
    return NOMINAL.get(kind, NOMINAL["cpu"])


def matmul_rate(hidden: int, device: torch.device, seconds: float = 0.5, tokens: int = 2048) -> float:
    """FLOP/s of ``(tokens, h) @ (h, 4h)`` repeated for about ``seconds``."""
    a = torch.randn(tokens, hidden, device=device)
    b = torch.randn(hidden, 4 * hidden, device=device)
    (a @ b).sum().item()  # warm-up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        c = a @ b
        count += 1
    c.sum().item()  # waits for the device
    return 2 * tokens * hidden * 4 * hidden * count / (time.perf_counter() - start)


def optimizer_rate(device: torch.device, seconds: float = 0.3, numel: int = 2**20) -> float:
    """Parameters per second that ``torch.optim.AdamW`` updates (its default implementation)."""
    param = torch.nn.Parameter(torch.randn(numel, device=device))
    param.grad = torch.randn(numel, device=device)
    optimizer = torch.optim.AdamW([param])
    optimizer.step()  # creates the state
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        optimizer.step()
        count += 1
    param.sum().item()
    return numel * count / (time.perf_counter() - start)


# the smaller of the two all-reduces timed: the size of a small model's activations (gloo, like other
# libraries, takes another algorithm for a few bytes, whose latency is far lower than a ring step's)
SMALL_BYTES = 256 * 2**10


def _timed_allreduce(tensor: torch.Tensor, repeats: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(tensor)
    tensor.sum().item()
    return (time.perf_counter() - start) / repeats


def _worker(rank: int, world: int, port: int, hidden: int, kind: str, large_bytes: int, queue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        device = torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")
        if kind == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world)
        dist.barrier()
        flops = matmul_rate(hidden, device)
        dist.barrier()
        updates = optimizer_rate(device)
        latency = bandwidth = float("inf")
        if world > 1:  # t(n) = 2 (k - 1) latency + 2 (k - 1) / k * n / bandwidth, through two sizes
            small, large = (_timed_allreduce(torch.ones(n // 4, device=device), repeats)
                            for n, repeats in ((SMALL_BYTES, 10), (large_bytes, 3)))
            ring = 2 * (world - 1) / world
            # timing noise can make the line slope down: then the large size alone gives the bandwidth
            slope = (large - small) / (large_bytes - SMALL_BYTES) if large > small else large / large_bytes
            bandwidth = ring / slope
            latency = max(0.0, small - ring * SMALL_BYTES / bandwidth) / (2 * (world - 1))
        queue.put((rank, flops, latency, bandwidth, updates))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        queue.put((rank, None, repr(err), None, None))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(processes: int, hidden: int, kind: str = "cpu", timeout: float = 120.0) -> Rates:
    """Rates measured by ``processes`` local processes on devices of ``kind`` (median over them).

    One process measures compute only; the bandwidths are then the nominal ones of ``kind``.
    """
    ctx = mp.get_context("spawn" if kind == "cuda" else "fork")
    queue = ctx.Queue()
    port = _free_port()
    large = 256 * 2**20 if kind == "cuda" else 8 * 2**20
    procs = [ctx.Process(target=_worker, args=(r, processes, port, hidden, kind, large, queue))
             for r in range(processes)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failed = [r for r in results if r[1] is None]
    if failed:
        raise RuntimeError(f"calibration failed on rank {failed[0][0]}: {failed[0][2]}")
    flops = statistics.median(r[1] for r in results)
    updates = statistics.median(r[4] for r in results)
    base = nominal(kind)
    if processes == 1:
        return Rates(flops, base.intra_bandwidth, base.inter_bandwidth, base.latency, updates)
    bandwidth = statistics.median(r[3] for r in results)
    latency = statistics.median(r[2] for r in results)
    return Rates(flops, bandwidth, base.inter_bandwidth, latency, updates)
