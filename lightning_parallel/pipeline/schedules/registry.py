"""The pipeline schedules by name: one table of what ``schedule=`` may say and how each is built.

Each entry (``ScheduleSpec``) holds the builder of one rank's action list, the stage placement the
schedule runs on and the stages per rank it needs, so that the engine, the launch checks, the
planner and the command line read these facts from one place. A new schedule is one builder in
``classic`` or ``zero_bubble`` and one line here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from lightning_parallel.pipeline.errors import PipelineConfigError
from lightning_parallel.pipeline.schedules.actions import Action
from lightning_parallel.pipeline.schedules.classic import (
    schedule_1f1b,
    schedule_gpipe,
    schedule_interleaved_1f1b,
)
from lightning_parallel.pipeline.schedules.validation import validate
from lightning_parallel.pipeline.schedules.zero_bubble import (
    schedule_dualpipev,
    schedule_zb_h1,
    schedule_zbv,
)

Builder = Callable[[int, int, int, int], list[Action]]  # (stages, micro_batches, rank, virtual_stages) -> actions


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule the engine runs.

    Fields:
        name: what ``schedule=`` says.
        build: one rank's actions for ``(stages, micro_batches, rank, virtual_stages)``.
        placement: which rank holds which stage (``placement.PLACEMENTS``): ``"v"`` for the V-shaped
            schedules, ``"loop"`` for the others.
        chunks: the stages per rank it runs (``virtual_stages``): 1, 2, or None for any number the
            builder accepts.
    """

    name: str
    build: Builder
    placement: str = "loop"
    chunks: Optional[int] = 1

    def check_chunks(self, virtual_stages: int) -> None:
        """Refuse ``virtual_stages`` stages per rank where this schedule runs a fixed number, saying what would work."""
        if self.chunks is None or virtual_stages == self.chunks:
            return
        if self.placement == "v":
            raise PipelineConfigError(
                f"{self.name} runs exactly 2 stages per rank (rank r holds stages r and 2P - 1 - r), got "
                f"virtual_stages={virtual_stages}; use virtual_stages=2"
            )
        raise PipelineConfigError(
            f"schedule {self.name!r} runs one stage per rank, got virtual_stages={virtual_stages}; "
            "use schedule='interleaved_1f1b' (or 'zbv' for 2) or virtual_stages=1"
        )


def _one_stage(schedule: Callable[[int, int, int], list[Action]]) -> Builder:
    return lambda stages, micro_batches, rank, virtual_stages: schedule(stages, micro_batches, rank)


REGISTRY: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec("gpipe", _one_stage(schedule_gpipe)),
    ScheduleSpec("1f1b", _one_stage(schedule_1f1b)),
    ScheduleSpec("interleaved_1f1b", schedule_interleaved_1f1b, chunks=None),
    ScheduleSpec("zb_h1", _one_stage(schedule_zb_h1)),
    ScheduleSpec("zbv", _one_stage(schedule_zbv), placement="v", chunks=2),
    ScheduleSpec("dualpipev", _one_stage(schedule_dualpipev), placement="v", chunks=2),
)}
SCHEDULES = tuple(REGISTRY)


def schedule_spec(name: str) -> ScheduleSpec:
    """The entry of schedule ``name``; a clear refusal naming the schedules for any other name."""
    if name not in REGISTRY:
        raise PipelineConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return REGISTRY[name]


def placement_of(schedule: str) -> str:
    """The stage placement schedule ``schedule`` runs on ("loop" for a name not in the table)."""
    spec = REGISTRY.get(schedule)
    return spec.placement if spec is not None else "loop"


def chunks_per_rank(schedule: str, virtual_stages: int) -> int:
    """Stages per rank that ``schedule`` runs with ``virtual_stages`` asked: a V holds two, so 1 reads as 2."""
    return 2 if placement_of(schedule) == "v" and virtual_stages == 1 else virtual_stages


def build_schedule(name: str, stages: int, micro_batches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """The action list of ``rank`` for schedule ``name`` (one of ``SCHEDULES``)."""
    spec = schedule_spec(name)
    spec.check_chunks(virtual_stages)
    return spec.build(stages, micro_batches, rank, virtual_stages)


def all_ranks(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """``build_schedule`` for every rank."""
    return [build_schedule(name, stages, micro_batches, r, virtual_stages) for r in range(stages)]


def validate_schedule(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """``all_ranks`` of schedule ``name``, validated on the placement it runs on."""
    every = all_ranks(name, stages, micro_batches, virtual_stages)
    validate(every, micro_batches, placement_of(name))
    return every
