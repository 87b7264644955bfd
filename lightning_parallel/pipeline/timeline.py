"""Draw a pipeline step as a timeline, ranks by time, so the bubble is visible.

The top panel is the simulator's ideal schedule (forward, input-gradient pass and weight pass cost
1 each, an unsplit backward 2); with ``--measure``
a second panel shows the intervals the engine recorded while training the default GPT on
``--stages`` local CPU processes (gloo). Forward intervals are light, backward dark, the weight
pass purple, each labelled with its micro-batch (the legend says which is which); white space is
the bubble. The picture goes to ``--out`` (default: the system's temporary folder).

    python -m lightning_parallel.pipeline.timeline --stages 4 --micro-batches 8 --schedule 1f1b \
        --measure --out timeline.png
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_parallel.errors import ConfigurationError
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline.schedules import (
    SCHEDULES,
    Interval,
    Op,
    all_ranks,
    chunks_per_rank,
    simulate,
)

# (chunk 0, other chunks); W is a weight-gradient pass split off its backward (``backward_split``)
_COLOURS = {Op.F: ("#9ecae1", "#6baed6"), Op.B: ("#3182bd", "#08519c"), Op.W: ("#756bb1", "#54278f")}
_LABELS = {Op.F: "forward", Op.B: "backward", Op.W: "weight-gradient pass"}
DEFAULT_OUT = os.path.join(tempfile.gettempdir(), "pipeline_timeline.png")


class TimelineError(ConfigurationError):
    """Nothing to draw; the message says why and what to run instead."""


def bubble_fraction(intervals: list[Interval], ranks: int) -> float:
    """Idle share of ``ranks`` x step time, the step spanning the earliest start to the latest end."""
    step = max(i.end for i in intervals) - min(i.start for i in intervals)
    return 1.0 - sum(i.end - i.start for i in intervals) / (ranks * step)


def _draw(ax, intervals: list[Interval], ranks: int, title: str, unit: str) -> None:
    from matplotlib.patches import Patch

    for i in intervals:
        colour = _COLOURS[i.op][0 if i.stage < ranks else 1]
        ax.barh(i.rank, i.end - i.start, left=i.start, height=0.8, color=colour, edgecolor="black", linewidth=0.4)
        ax.text((i.start + i.end) / 2, i.rank, str(i.microbatch), ha="center", va="center", fontsize=7,
                color="black" if i.op is Op.F else "white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(f"{title}: bubble {bubble_fraction(intervals, ranks):.1%} of the step")
    ops = [op for op in _COLOURS if any(i.op is op for i in intervals)]
    chunked = any(i.stage >= ranks for i in intervals)
    handles = [Patch(color=_COLOURS[op][0], label=_LABELS[op] + (" (chunk 0; later chunks darker)" if chunked else ""))
               for op in ops]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="white: idle",
              title_fontsize=8)


def render(path: str, stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1,
           measured: Optional[list[Interval]] = None) -> None:
    """Save the simulated (and, if given, measured) timeline of one step to ``path``."""
    if measured is not None and not measured:
        raise TimelineError("the measured run recorded no intervals, so there is nothing to draw; "
                            "draw the simulated schedule alone by leaving out --measure")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cost = 1 / virtual_stages  # a chunk is 1/V of a stage; F = B = W (an unsplit backward costs B + W)
    sim = simulate(all_ranks(schedule, stages, micro_batches, virtual_stages), cost, cost, cost)
    panels = 2 if measured else 1
    fig, axes = plt.subplots(panels, 1, figsize=(12, 1.2 + 0.55 * stages * panels), squeeze=False)
    name = f"{schedule}, P={stages}, M={micro_batches}" + (f", V={virtual_stages}" if virtual_stages > 1 else "")
    _draw(axes[0][0], sim.intervals, stages, f"simulated {name} (F = B = W, unsplit backward = 2 x forward)", "time (forward units)")
    if measured:
        t0 = min(i.start for i in measured)
        shifted = [Interval(i.rank, i.op, i.microbatch, i.stage, (i.start - t0) * 1e3, (i.end - t0) * 1e3) for i in measured]
        _draw(axes[1][0], shifted, stages, f"measured {name}, default GPT on CPU", "time (ms)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _record(rank: int, stages: int, micro_batches: int, schedule: str, virtual_stages: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore", message=".*self.log.*")
    from lightning_parallel.mesh import ParallelMesh
    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.pipeline.engine import PipelineEngine

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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (2 for zbv, dualpipev)")
    parser.add_argument("--measure", action="store_true", help="also run the default GPT and draw what happened")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"PNG file to write (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    args.virtual_stages = chunks_per_rank(args.schedule, args.virtual_stages)
    try:
        measured = measure(args.stages, args.micro_batches, args.schedule, args.virtual_stages) if args.measure else None
        render(args.out, args.stages, args.micro_batches, args.schedule, args.virtual_stages, measured)
    except TimelineError as err:
        parser.exit(1, f"timeline: {err}\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
