"""Run a function on N fork-started gloo processes and collect each rank's result.

Fork costs about 0.1 s where spawn costs 10-20 s (torch + lightning re-import), so every
multi-process test uses it. A short process-group timeout turns a hang into a failure.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_parallel.mesh import ParallelMesh

PG_TIMEOUT = timedelta(seconds=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
        result = fn(rank, world_size, *args)
        # serialise to bytes: torch's queue pickler would share tensors through file descriptors
        # that vanish when this process exits
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def make_mesh(rank: int, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> ParallelMesh:
    """A mesh with its process groups, inside a ``run_distributed`` worker."""
    return ParallelMesh(world_size, tensor_parallel=tp, pipeline_parallel=pp,
                        context_parallel=cp).init_process_groups(rank)


def start_ranks(fn: Callable[[int], Any], world_size: int, logs: str) -> list[mp.Process]:
    """Start ``fn(rank)`` on ``world_size`` fork-started processes that see torchrun's variables (each
    builds its own Trainer; Lightning launches nothing and no parent watches them), each writing its
    output to ``logs/rank<r>.log``; a process ends with code 1 when ``fn`` raises (traceback logged)."""
    def worker(rank: int, port: int) -> None:
        log = os.open(os.path.join(logs, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
        torch.set_num_threads(1)
        try:
            fn(rank)
        except BaseException:  # noqa: BLE001 - logged for the test to read
            traceback.print_exc()
            os._exit(1)
        os._exit(0)

    os.makedirs(logs, exist_ok=True)
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port)) for r in range(world_size)]
    for p in procs:
        p.start()
    return procs
