"""Pipeline schedules as data: for each rank, the ordered list of actions of one training step.

A schedule is a list of ``Action``s per rank, each an operation (``Op``: forward ``F``, backward
``B``, weight pass ``W``, or a send or receive around them) on one micro-batch of one (virtual)
stage. Which rank holds which stage is ``placement``'s business: stage ``s`` on rank ``s % P`` for
all but the V-shaped schedules.

Schedules (all flush the pipeline once per step, so the update equals one device's), by name in
``registry``:

* ``gpipe``, ``1f1b``, ``interleaved_1f1b`` (``classic``): GPipe (Huang et al. 2019, arXiv
  1811.06965), PipeDream-Flush (Narayanan et al. 2021, arXiv 2006.09503) and its interleaved form
  with ``V`` model chunks per rank (arXiv 2104.04473 §2.2).
* ``zb_h1``, ``zbv``, ``dualpipev`` (``zero_bubble``): schedules with weight passes (Qi et al. 2023,
  arXiv 2401.10241; DeepSeek-AI 2024, arXiv 2412.19437).

Sends are asynchronous and receives block; ``validation.validate`` proves under exactly these
semantics that a set of rank schedules is complete, matched and deadlock-free. ``simulator``
replays them on an ideal machine (step time, bubble, micro-batches in flight), and ``execution``
chooses the actions of a step and works out what a rank needs to run its own list (``RankPlan``).

Files, each importing only those above it: ``actions``, ``placement``, ``classic``,
``zero_bubble``, ``validation``, ``registry``, ``execution``, ``simulator``.
"""

from lightning_parallel.pipeline.schedules.actions import Action, Op, matching_receive
from lightning_parallel.pipeline.schedules.classic import (
    schedule_1f1b,
    schedule_flush,
    schedule_forward_only,
    schedule_gpipe,
    schedule_interleaved_1f1b,
)
from lightning_parallel.pipeline.schedules.execution import (
    RankPlan,
    communication_runs,
    send_completion_points,
    step_schedules,
)
from lightning_parallel.pipeline.schedules.placement import (
    PLACEMENTS,
    rank_of_stage,
    stages_of_rank,
)
from lightning_parallel.pipeline.schedules.registry import (
    REGISTRY,
    SCHEDULES,
    ScheduleSpec,
    all_ranks,
    build_schedule,
    chunks_per_rank,
    placement_of,
    schedule_spec,
    validate_schedule,
)
from lightning_parallel.pipeline.schedules.simulator import (
    Interval,
    Simulation,
    simulate,
)
from lightning_parallel.pipeline.schedules.validation import replay, validate
from lightning_parallel.pipeline.schedules.zero_bubble import (
    defer_last_weight_pass,
    schedule_dualpipev,
    schedule_zb_h1,
    schedule_zbv,
)

__all__ = [
    "Action",
    "Interval",
    "Op",
    "PLACEMENTS",
    "REGISTRY",
    "RankPlan",
    "SCHEDULES",
    "ScheduleSpec",
    "Simulation",
    "all_ranks",
    "build_schedule",
    "chunks_per_rank",
    "communication_runs",
    "defer_last_weight_pass",
    "matching_receive",
    "placement_of",
    "rank_of_stage",
    "replay",
    "schedule_1f1b",
    "schedule_dualpipev",
    "schedule_flush",
    "schedule_forward_only",
    "schedule_gpipe",
    "schedule_interleaved_1f1b",
    "schedule_spec",
    "schedule_zb_h1",
    "schedule_zbv",
    "send_completion_points",
    "simulate",
    "stages_of_rank",
    "step_schedules",
    "validate",
    "validate_schedule",
]
