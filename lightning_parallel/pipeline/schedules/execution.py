"""What a rank executes in one step, and what it needs to know about it beforehand.

``step_schedules`` chooses every rank's actions for a step (the schedule's own, or a fallback where
the step is short or runs no backward); ``RankPlan.of`` gathers, for one rank: the rank's actions, the runs of communication actions posted together,
the points where a send is known delivered (so its buffer can be freed early), and the actions that
complete each stage's weight gradients (where the data-parallel reduction of those gradients can
start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_parallel.pipeline.errors import PipelineConfigError
from lightning_parallel.pipeline.schedules.actions import Action, Op, matching_receive
from lightning_parallel.pipeline.schedules.classic import (
    schedule_flush,
    schedule_forward_only,
)
from lightning_parallel.pipeline.schedules.registry import (
    placement_of,
    validate_schedule,
)
from lightning_parallel.pipeline.schedules.validation import replay, validate
from lightning_parallel.pipeline.schedules.zero_bubble import defer_last_weight_pass


def step_schedules(name: str, stages: int, micro_batches: int, virtual_stages: int, training: bool,
                   short: bool = False) -> list[list[Action]]:
    """Every rank's actions in one step of ``micro_batches`` of schedule ``name``.

    Training runs the schedule, validated, with each rank's last backward split where it has no
    weight passes (``defer_last_weight_pass``); a ``short`` step (a last batch with fewer samples than
    the micro-batches asked) that the schedule cannot split runs in GPipe order on the same stages
    (``schedule_flush``). Evaluation runs the forwards alone (``schedule_forward_only``).
    """
    placement = placement_of(name)
    if not training:
        return [schedule_forward_only(stages, micro_batches, r, virtual_stages, placement) for r in range(stages)]
    try:
        every = validate_schedule(name, stages, micro_batches, virtual_stages)
    except PipelineConfigError:
        if not short:
            raise
        every = [schedule_flush(stages, micro_batches, r, virtual_stages, placement) for r in range(stages)]
        validate(every, micro_batches, placement)
    return [defer_last_weight_pass(acts) for acts in every]


@dataclass(frozen=True)
class RankPlan:
    """One rank's actions in a step, with what executing them needs (the engine's ``_schedule``).

    Fields:
        actions: the rank's schedule.
        delivered_by: index of a send -> index of the first later action by which the send is known
            received (``send_completion_points``); sends absent there are waited at the end of the step.
        runs: ``[start, stop)`` ranges of consecutive communication actions, each posted as one exchange
            (``communication_runs``).
        split: the ``(micro-batch, stage)`` pairs whose backward a ``W`` completes: their ``B`` computes
            the input gradient alone.
        last_weight_split: index of an action -> the stage whose weight gradients it last adds to, when
            backwards run split as the schedule says (the last ``W``, or the last ``B`` the schedule has
            no ``W`` for).
        last_weight_whole: the same when every backward runs whole (the last ``B``): the engine's
            fallback for graphs a backward cannot be split in (``backward_split``).
    """

    actions: list[Action]
    delivered_by: dict[int, int]
    runs: list[tuple[int, int]]
    split: frozenset[tuple[int, int]]
    last_weight_split: dict[int, int]
    last_weight_whole: dict[int, int]

    @classmethod
    def of(cls, schedules: list[list[Action]], rank: int) -> RankPlan:
        """The plan of ``rank`` from every rank's schedule (all are needed to know when sends are delivered)."""
        mine = schedules[rank]
        split = frozenset(a.unit for a in mine if a.op is Op.W)
        last_b = {a.stage: i for i, a in enumerate(mine) if a.op is Op.B}
        last_w = {a.stage: i for i, a in enumerate(mine) if a.op is Op.W or (a.op is Op.B and a.unit not in split)}
        return cls(mine, send_completion_points(schedules)[rank], communication_runs(mine), split,
                   {i: s for s, i in last_w.items()}, {i: s for s, i in last_b.items()})

    def completes_weights(self, index: int, split: bool) -> Optional[int]:
        """The stage whose weight gradients action ``index`` last adds to (None if it is not such an
        action), with backwards split as the schedule says (``split``) or all whole."""
        return (self.last_weight_split if split else self.last_weight_whole).get(index)


def send_completion_points(schedules: list[list[Action]]) -> list[dict[int, int]]:
    """For each rank, send index -> index of its first later action that proves the send was received.

    A send is known delivered once its rank has received a message sent after the matching
    receive happened (vector clocks over the schedules, Lamport 1978). Waiting on the send there
    returns at once and frees its buffer; without it a transport may keep every sent activation
    alive until the end of the step (gloo marks a send complete only when it is waited on). Sends
    never proven delivered (the last ones of a step) are absent: they are waited at the end.
    """
    ranks = len(schedules)
    clocks: list[list[list[int]]] = [[] for _ in range(ranks)]  # clocks[r][p]: what rank r knows after action p
    current = [[0] * ranks for _ in range(ranks)]
    message_clock: dict[Action, list[int]] = {}  # receive -> the clock its message carries
    received_at: dict[Action, tuple[int, int]] = {}  # receive -> (rank, position)

    def visit(rank: int, p: int, a: Action) -> None:
        if a.op.is_receive:
            current[rank] = [max(x, y) for x, y in zip(current[rank], message_clock[a])]
            received_at[a] = (rank, p)
        current[rank][rank] = p + 1
        if a.op.is_send:
            message_clock[matching_receive(a)] = list(current[rank])
        clocks[rank].append(list(current[rank]))

    replay(schedules, visit)
    points: list[dict[int, int]] = [{} for _ in range(ranks)]
    for rank, acts in enumerate(schedules):
        for p, a in enumerate(acts):
            if not a.op.is_send:
                continue
            peer, k = received_at[matching_receive(a)]
            later = next((j for j in range(p + 1, len(acts)) if clocks[rank][j][peer] > k), None)
            if later is not None:
                points[rank][p] = later
    return points


def communication_runs(actions: list[Action]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` index ranges of consecutive communication actions, in order.

    Each run is posted as one batch; the receives of the run after it may be posted ahead.
    """
    runs: list[tuple[int, int]] = []
    for index, action in enumerate(actions):
        if action.op.is_compute:
            continue
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs
