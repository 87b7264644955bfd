"""Proof that a set of rank schedules is one correct training step, under the engine's semantics.

Sends are asynchronous and receives block. ``replay`` executes all ranks' action lists under
exactly these semantics; ``validate`` proves with it that the schedules are complete, matched and
deadlock-free before a single message is posted, so a wrong schedule is refused at setup instead of
hanging a run.
"""

from __future__ import annotations

from typing import Callable

from lightning_parallel.pipeline.errors import PipelineConfigError
from lightning_parallel.pipeline.schedules.actions import Action, Op, matching_receive
from lightning_parallel.pipeline.schedules.placement import PLACEMENTS, rank_of_stage


def validate(schedules: list[list[Action]], micro_batches: int, placement: str | None = None) -> None:
    """Raise ``PipelineConfigError`` unless the rank schedules form one correct training step.

    Complete: every (micro-batch, stage) is forwarded once and then backwarded once, on the rank
    that holds the stage (``placement``), with its receives before and its sends after the
    compute; a weight pass ``W``, where there is one, comes once, after its ``B``. Matched: each
    send has exactly one receive on the neighbouring stage. Deadlock-free: executing all ranks
    with asynchronous sends and blocking receives reaches the end of every list. ``placement``
    None: whichever of ``placement.PLACEMENTS`` the schedules' stages sit on ("loop" if neither).
    """
    ranks = len(schedules)
    total = 1 + max(a.stage for acts in schedules for a in acts)
    if placement is None:
        placement = next((p for p in PLACEMENTS if all(rank_of_stage(a.stage, ranks, total, p) == r
                                                       for r, acts in enumerate(schedules) for a in acts)), "loop")
    expected = {(mb, s) for mb in range(micro_batches) for s in range(total)}
    for rank, acts in enumerate(schedules):
        seen: dict[Action, int] = {}
        for pos, a in enumerate(acts):
            holder = rank_of_stage(a.stage, ranks, total, placement)
            if holder != rank:
                raise PipelineConfigError(f"rank {rank} runs {a}, but stage {a.stage} lives on rank {holder}")
            if a in seen:
                raise PipelineConfigError(f"rank {rank} runs {a} twice")
            seen[a] = pos
        mine = {(mb, s) for mb, s in expected if rank_of_stage(s, ranks, total, placement) == rank}
        for op in (Op.F, Op.B):
            got = {a.unit for a in seen if a.op is op}
            if got != mine:
                raise PipelineConfigError(f"rank {rank}: {op} missing for {sorted(mine - got)}, extra {sorted(got - mine)}")
        weights = {a.unit for a in seen if a.op is Op.W}
        if weights - mine:
            raise PipelineConfigError(f"rank {rank}: W of {sorted(weights - mine)} has no forward or backward")
        for mb, s in mine:
            f, b = seen[Action(Op.F, mb, s)], seen[Action(Op.B, mb, s)]
            # each message: the compute it belongs to, whether the stage has it, before ("<") or after (">")
            order = [(Op.RECV_F, f, s > 0, "<"), (Op.SEND_F, f, s < total - 1, ">"),
                     (Op.RECV_B, b, s < total - 1, "<"), (Op.SEND_B, b, s > 0, ">")]
            if f > b:
                raise PipelineConfigError(f"rank {rank}: backward of micro-batch {mb} stage {s} precedes its forward")
            if seen.get(Action(Op.W, mb, s), b) < b:
                raise PipelineConfigError(
                    f"rank {rank}: weight pass of micro-batch {mb} stage {s} precedes its backward"
                )
            for op, anchor, needed, side in order:
                pos = seen.get(Action(op, mb, s))
                if needed != (pos is not None) or (pos is not None and (pos < anchor) != (side == "<")):
                    raise PipelineConfigError(f"rank {rank}: {op} of micro-batch {mb} stage {s} is missing or misplaced")
    _run_to_completion(schedules)


def replay(schedules: list[list[Action]], visit: Callable[[int, int, Action], None] = lambda r, p, a: None) -> list[int]:
    """Advance every rank in turn until it blocks on a receive whose send has not run yet.

    ``visit(rank, position, action)`` is called for each action as it runs, sends before the
    receives they enable. Returns how far each rank got (its schedule's length when it finished).
    """
    sent: set[Action] = set()
    pos = [0] * len(schedules)
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(schedules):
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                if a.op.is_receive and a not in sent:
                    break
                visit(rank, pos[rank], a)
                if a.op.is_send:
                    sent.add(matching_receive(a))
                pos[rank] += 1
                progress = True
    return pos


def _run_to_completion(schedules: list[list[Action]]) -> None:
    pos = replay(schedules)
    stuck = {r: schedules[r][p] for r, p in enumerate(pos) if p < len(schedules[r])}
    if stuck:
        raise PipelineConfigError(f"schedule deadlocks: ranks wait forever at {stuck}")
