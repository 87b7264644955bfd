"""Draw a measured pipeline step under the simulated one: the default GPT on local CPU processes.

Each of ``--stages`` local processes (gloo, fork, one thread each) trains the default GPT
(``4 x`` chunks-per-rank blocks, batches of ``4 x`` micro-batches sequences of 64 tokens) with the
pipeline engine for three steps and records the intervals of the last one
(``PipelineEngine.timeline``); ``pipeline.timeline.render`` draws them below the simulator's ideal
schedule of the same pipeline. The picture goes to ``--out`` (default: the system's temporary
folder).

    python benchmarks/timeline.py --stages 2 --micro-batches 8 --out timeline.png
"""

from __future__ import annotations

import os
import socket
import tempfile
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.models.gpt import GPT
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline import PipelineEngine
from lightning_parallel.pipeline.schedules import Interval, chunks_per_rank
from lightning_parallel.pipeline.timeline import TimelineError, arguments, render


def _record(rank: int, stages: int, micro_batches: int, schedule: str, virtual_stages: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore", message=".*self.log.*")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=stages)
    torch.manual_seed(0)
    model = GPT(n_layer=4 * virtual_stages)
    mesh = ParallelMesh(stages, pipeline_parallel=stages).init_process_groups(rank)
    engine = PipelineEngine(model, mesh, ParallelOptions(micro_batches=micro_batches, schedule=schedule,
                                                     virtual_stages=virtual_stages))
    engine.partition()
    batch = (torch.randint(0, 256, (4 * micro_batches, 64)), torch.randint(0, 256, (4 * micro_batches, 64)))
    for step in range(3):  # the last step is recorded, after warm-up
        engine.timeline = [] if step == 2 else None
        dist.barrier()
        engine.training_step(batch, step)
    torch.save(engine.timeline, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def measure(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> list[Interval]:
    """Intervals of one training step of the default GPT on ``stages`` local processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_record, (stages, micro_batches, schedule, virtual_stages, port, out),
                           nprocs=stages, start_method="fork")
        return [i for r in range(stages) for i in _load_rank(f"{out}/rank{r}.pt", r)]


def _load_rank(path: str, rank: int) -> list[Interval]:
    """One rank's recorded intervals; a clear error when the file is missing or empty."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        raise TimelineError(f"rank {rank} left no intervals in {path} (the file is missing or empty): its "
                            "training step did not finish; see that rank's error above")
    return torch.load(path, weights_only=False)  # written a moment ago by this run's own processes


def main(argv: Optional[list[str]] = None) -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    virtual_stages = chunks_per_rank(args.schedule, args.virtual_stages)
    try:
        measured = measure(args.stages, args.micro_batches, args.schedule, virtual_stages)
        render(args.out, args.stages, args.micro_batches, args.schedule, virtual_stages, measured)
    except TimelineError as err:
        parser.exit(1, f"timeline: {err}\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
