"""Draw a pipeline step as a timeline, ranks by time, so the bubble is visible.

The top panel is the simulator's ideal schedule (forward, input-gradient pass and weight pass cost
1 each, an unsplit backward 2); given intervals the engine recorded (``PipelineEngine.timeline``), a
second panel shows what happened. ``benchmarks/timeline.py`` records them while training the
default GPT on local CPU processes (gloo), so the library itself needs no model. Forward intervals
are light, backward dark, the weight pass purple, each labelled with its micro-batch (the legend
says which is which); white space is the bubble. The picture goes to ``--out`` (default: the
system's temporary folder).

    python -m lightning_parallel.pipeline.timeline --stages 4 --micro-batches 8 --schedule 1f1b \
        --out timeline.png
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Optional

from lightning_parallel.errors import ConfigurationError
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
                            "draw the simulated schedule alone with python -m lightning_parallel.pipeline.timeline")
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


def arguments(description: str) -> argparse.ArgumentParser:
    """The command line of a timeline: the pipeline to draw and where to write the picture."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (2 for zbv, dualpipev)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"PNG file to write (default {DEFAULT_OUT})")
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    render(args.out, args.stages, args.micro_batches, args.schedule,
           chunks_per_rank(args.schedule, args.virtual_stages))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
