"""Pipeline schedules as data: for each rank, the ordered list of actions of one training step.

An action is a forward ``F``, a backward ``B`` or a weight pass ``W`` of one micro-batch on one
(virtual) stage, or the point-to-point traffic around it: ``recv_f``/``send_f`` move the hidden
state from stage ``s`` to ``s + 1``, ``recv_b``/``send_b`` move its gradient back. Where a
schedule has a ``W`` for a micro-batch and stage, its ``B`` computes only the input gradient and
the ``W`` the weight gradients (``backward_split``); without one, ``B`` computes both. Which rank
holds which stage is ``placement``'s business: stage ``s`` on rank ``s % P`` for all but the
V-shaped schedules.

Schedules (all flush the pipeline once per step, so the update equals one device's):

* ``gpipe``: every forward, then every backward (Huang et al. 2019, arXiv 1811.06965). Keeps
  the activations of all ``M`` micro-batches alive.
* ``1f1b``: PipeDream-Flush (Narayanan et al. 2021, arXiv 2006.09503) as written in Megatron-LM:
  ``min(P - r - 1, M)`` warm-up forwards, then one forward / one backward, then the cool-down
  backwards. At most ``P - r`` micro-batches are in flight on rank ``r``.
* ``interleaved_1f1b``: the same with ``V`` model chunks per rank (arXiv 2104.04473 §2.2): the
  bubble shrinks by ``V`` at the price of ``V`` times more messages.
* ``zb_h1``, ``zbv``, ``dualpipev``: schedules with weight passes (Qi et al. 2023, arXiv
  2401.10241; DeepSeek-AI 2024, arXiv 2412.19437), generated in ``zero_bubble``.

Sends are asynchronous and receives block; ``validate`` proves under exactly these semantics that
a set of rank schedules is complete, matched and deadlock-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lightning_parallel.pipeline.errors import PipelineConfigError
from lightning_parallel.pipeline.placement import (
    PLACEMENTS,
    placement_of,
    rank_of_stage,
    stages_of_rank,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")
COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: ``op`` on micro-batch ``microbatch`` of stage ``stage``."""

    op: str  # "F", "B", "W", "recv_f", "send_f", "recv_b", "send_b"
    microbatch: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.op}{self.microbatch}@{self.stage}"


def _forward(mb: int, stage: int, num_stages: int) -> list[Action]:
    """Receive the input (unless first stage), compute, send the output (unless last stage)."""
    acts = [] if stage == 0 else [Action("recv_f", mb, stage)]
    acts.append(Action("F", mb, stage))
    if stage < num_stages - 1:
        acts.append(Action("send_f", mb, stage))
    return acts


def _backward(mb: int, stage: int, num_stages: int) -> list[Action]:
    """Receive the output's gradient (unless last stage), compute, send the input's gradient."""
    acts = [] if stage == num_stages - 1 else [Action("recv_b", mb, stage)]
    acts.append(Action("B", mb, stage))
    if stage > 0:
        acts.append(Action("send_b", mb, stage))
    return acts


def _check(stages: int, micro_batches: int, rank: int, virtual_stages: int = 1) -> None:
    if stages < 1 or micro_batches < 1 or virtual_stages < 1:
        raise PipelineConfigError(
            f"stages ({stages}), micro_batches ({micro_batches}) and virtual_stages ({virtual_stages}) "
            "must all be at least 1"
        )
    if not 0 <= rank < stages:
        raise PipelineConfigError(f"rank {rank} is outside the {stages} pipeline stages (0..{stages - 1})")


def schedule_gpipe(stages: int, micro_batches: int, rank: int) -> list[Action]:
    """GPipe: all forwards in micro-batch order, then all backwards."""
    _check(stages, micro_batches, rank)
    acts: list[Action] = []
    for mb in range(micro_batches):
        acts += _forward(mb, rank, stages)
    for mb in range(micro_batches):
        acts += _backward(mb, rank, stages)
    return acts


def schedule_1f1b(stages: int, micro_batches: int, rank: int) -> list[Action]:
    """1F1B (PipeDream-Flush) with Megatron-LM's warm-up of ``min(P - rank - 1, M)`` forwards."""
    _check(stages, micro_batches, rank)
    warmup = min(stages - rank - 1, micro_batches)
    acts: list[Action] = []
    # warm-up: fill the pipeline
    for mb in range(warmup):
        acts += _forward(mb, rank, stages)
    # steady state: one forward, then the backward of the oldest micro-batch in flight
    for i in range(micro_batches - warmup):
        acts += _forward(warmup + i, rank, stages)
        acts += _backward(i, rank, stages)
    # cool-down: drain the backwards still owed
    for mb in range(micro_batches - warmup, micro_batches):
        acts += _backward(mb, rank, stages)
    return acts


def schedule_interleaved_1f1b(stages: int, micro_batches: int, rank: int, virtual_stages: int) -> list[Action]:
    """Interleaved 1F1B: ``V`` chunks per rank, micro-batches taken in groups of ``P``.

    Forwards visit (group, chunk, micro-batch) in that nesting order, backwards the same with the
    chunks reversed; the warm-up is Megatron-LM's ``2 (P - rank - 1) + (V - 1) P`` forwards.
    """
    _check(stages, micro_batches, rank, virtual_stages)
    if virtual_stages < 2:
        raise PipelineConfigError(f"interleaved_1f1b needs virtual_stages >= 2, got {virtual_stages}; use 1f1b")
    if micro_batches % stages:
        valid = [m for m in range(stages, 4 * stages + 1, stages)]
        raise PipelineConfigError(
            f"interleaved_1f1b needs micro_batches divisible by the {stages} pipeline stages, got "
            f"{micro_batches}; valid values include {valid}"
        )
    total_stages = stages * virtual_stages
    order = [
        (group * stages + i, chunk)
        for group in range(micro_batches // stages)
        for chunk in range(virtual_stages)
        for i in range(stages)
    ]
    forwards = [(mb, chunk * stages + rank) for mb, chunk in order]
    backwards = [(mb, (virtual_stages - 1 - chunk) * stages + rank) for mb, chunk in order]
    total = len(order)
    warmup = min(2 * (stages - rank - 1) + (virtual_stages - 1) * stages, total)
    acts: list[Action] = []
    for mb, stage in forwards[:warmup]:
        acts += _forward(mb, stage, total_stages)
    for i in range(total - warmup):
        acts += _forward(*forwards[warmup + i], total_stages)
        acts += _backward(*backwards[i], total_stages)
    for mb, stage in backwards[total - warmup :]:
        acts += _backward(mb, stage, total_stages)
    return acts


def build_schedule(name: str, stages: int, micro_batches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """The action list of ``rank`` for schedule ``name`` (one of ``SCHEDULES``)."""
    if name == "interleaved_1f1b":
        return schedule_interleaved_1f1b(stages, micro_batches, rank, virtual_stages)
    if name in ("zbv", "dualpipev"):
        from lightning_parallel.pipeline import zero_bubble  # it builds on this module

        if virtual_stages != 2:
            raise PipelineConfigError(
                f"{name} runs exactly 2 stages per rank (rank r holds stages r and 2P - 1 - r), got "
                f"virtual_stages={virtual_stages}; use virtual_stages=2"
            )
        v_shaped = {"zbv": zero_bubble.schedule_zbv, "dualpipev": zero_bubble.schedule_dualpipev}
        return v_shaped[name](stages, micro_batches, rank)
    if name not in SCHEDULES:
        raise PipelineConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if virtual_stages != 1:
        raise PipelineConfigError(
            f"schedule {name!r} runs one stage per rank, got virtual_stages={virtual_stages}; "
            "use schedule='interleaved_1f1b' (or 'zbv' for 2) or virtual_stages=1"
        )
    if name == "zb_h1":
        from lightning_parallel.pipeline.zero_bubble import (
            schedule_zb_h1,  # it builds on this module
        )

        return schedule_zb_h1(stages, micro_batches, rank)
    return (schedule_gpipe if name == "gpipe" else schedule_1f1b)(stages, micro_batches, rank)


def all_ranks(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """``build_schedule`` for every rank."""
    return [build_schedule(name, stages, micro_batches, r, virtual_stages) for r in range(stages)]


def validate_schedule(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """``all_ranks`` of schedule ``name``, validated on the placement it runs on."""
    every = all_ranks(name, stages, micro_batches, virtual_stages)
    validate(every, micro_batches, placement_of(name))
    return every


# ---- validation ------------------------------------------------------------------------------
_MATCH = {"send_f": ("recv_f", 1), "send_b": ("recv_b", -1)}


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
        seen: dict[tuple[str, int, int], int] = {}
        for pos, a in enumerate(acts):
            holder = rank_of_stage(a.stage, ranks, total, placement)
            if holder != rank:
                raise PipelineConfigError(f"rank {rank} runs {a}, but stage {a.stage} lives on rank {holder}")
            if (a.op, a.microbatch, a.stage) in seen:
                raise PipelineConfigError(f"rank {rank} runs {a} twice")
            seen[(a.op, a.microbatch, a.stage)] = pos
        mine = {(mb, s) for mb, s in expected if rank_of_stage(s, ranks, total, placement) == rank}
        for op in ("F", "B"):
            got = {(mb, s) for (o, mb, s) in seen if o == op}
            if got != mine:
                raise PipelineConfigError(f"rank {rank}: {op} missing for {sorted(mine - got)}, extra {sorted(got - mine)}")
        weights = {(mb, s) for (o, mb, s) in seen if o == "W"}
        if weights - mine:
            raise PipelineConfigError(f"rank {rank}: W of {sorted(weights - mine)} has no forward or backward")
        for mb, s in mine:
            f, b = seen[("F", mb, s)], seen[("B", mb, s)]
            order = [("recv_f", f, s > 0, "<"), ("send_f", f, s < total - 1, ">"),
                     ("recv_b", b, s < total - 1, "<"), ("send_b", b, s > 0, ">")]
            if f > b:
                raise PipelineConfigError(f"rank {rank}: backward of micro-batch {mb} stage {s} precedes its forward")
            if seen.get(("W", mb, s), b) < b:
                raise PipelineConfigError(
                    f"rank {rank}: weight pass of micro-batch {mb} stage {s} precedes its backward"
                )
            for op, anchor, needed, side in order:
                pos = seen.get((op, mb, s))
                if needed != (pos is not None) or (pos is not None and (pos < anchor) != (side == "<")):
                    raise PipelineConfigError(f"rank {rank}: {op} of micro-batch {mb} stage {s} is missing or misplaced")
    _run_to_completion(schedules)


def replay(schedules: list[list[Action]], visit: Callable[[int, int, Action], None] = lambda r, p, a: None) -> list[int]:
    """Advance every rank in turn until it blocks on a receive whose send has not run yet.

    ``visit(rank, position, action)`` is called for each action as it runs, sends before the
    receives they enable. Returns how far each rank got (its schedule's length when it finished).
    """
    sent: set[tuple[str, int, int]] = set()
    pos = [0] * len(schedules)
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(schedules):
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                if a.op in ("recv_f", "recv_b") and (a.op, a.microbatch, a.stage) not in sent:
                    break
                visit(rank, pos[rank], a)
                if a.op in _MATCH:
                    sent.add(matching_receive(a))
                pos[rank] += 1
                progress = True
    return pos


def matching_receive(send: Action) -> tuple[str, int, int]:
    """The (op, micro-batch, stage) key of the receive that ``send`` satisfies."""
    recv, step = _MATCH[send.op]
    return recv, send.microbatch, send.stage + step


def _run_to_completion(schedules: list[list[Action]]) -> None:
    pos = replay(schedules)
    stuck = {r: schedules[r][p] for r, p in enumerate(pos) if p < len(schedules[r])}
    if stuck:
        raise PipelineConfigError(f"schedule deadlocks: ranks wait forever at {stuck}")


def schedule_forward_only(stages: int, micro_batches: int, rank: int, virtual_stages: int = 1,
                          placement: str = "loop") -> list[Action]:
    """Evaluation: every micro-batch through each of the rank's stages, no backward.

    Looped stages take one micro-batch through all of the rank's stages at a time; V-shaped ones
    all micro-batches through the first chunk, then through the second (a micro-batch's second
    chunk waits for every later rank, which would otherwise leave the pipeline empty).
    """
    total = stages * virtual_stages
    mine = stages_of_rank(rank, stages, total, placement)
    order = [(mb, s) for s in mine for mb in range(micro_batches)] if placement == "v" else \
        [(mb, s) for mb in range(micro_batches) for s in mine]
    return [a for mb, s in order for a in _forward(mb, s, total)]


def schedule_flush(stages: int, micro_batches: int, rank: int, virtual_stages: int = 1,
                   placement: str = "loop") -> list[Action]:
    """GPipe on any placement: the forwards of ``schedule_forward_only``, then every backward, the
    rank's later stages first. Runs any number of micro-batches, so a short last batch that the
    chosen schedule cannot split (interleaved 1F1B needs a multiple of P micro-batches, DualPipeV at
    least 2P) still trains on the same stages, holding its few micro-batches' activations at once."""
    total = stages * virtual_stages
    mine = stages_of_rank(rank, stages, total, placement)
    backwards = [a for s in sorted(mine, reverse=True) for mb in range(micro_batches) for a in _backward(mb, s, total)]
    return schedule_forward_only(stages, micro_batches, rank, virtual_stages, placement) + backwards


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
    message_clock: dict[tuple[str, int, int], list[int]] = {}
    received_at: dict[tuple[str, int, int], tuple[int, int]] = {}

    def visit(rank: int, p: int, a: Action) -> None:
        key = (a.op, a.microbatch, a.stage)
        if a.op in ("recv_f", "recv_b"):
            current[rank] = [max(x, y) for x, y in zip(current[rank], message_clock[key])]
            received_at[key] = (rank, p)
        current[rank][rank] = p + 1
        if a.op in _MATCH:
            message_clock[matching_receive(a)] = list(current[rank])
        clocks[rank].append(list(current[rank]))

    replay(schedules, visit)
    points: list[dict[int, int]] = [{} for _ in range(ranks)]
    for rank, acts in enumerate(schedules):
        for p, a in enumerate(acts):
            if a.op not in _MATCH:
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
        if action.op in COMPUTE:
            continue
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


def defer_last_weight_pass(actions: list[Action]) -> list[Action]:
    """A schedule without weight passes, with its rank's last backward split: ``W`` at the very end.

    Where the last backward has an input gradient to send (stage > 0), its ``B`` now computes only
    that gradient, which leaves before the weight gradients are computed, so the earlier stages
    start their own last backward that much sooner and the flush at the end of the step shrinks
    by the weight-gradient work of every later stage (the backward split of Qi et al. 2023, arXiv
    2401.10241, applied to the one backward no other action waits behind).
    """
    if any(a.op == "W" for a in actions):
        return actions
    last = max((i for i, a in enumerate(actions) if a.op == "B"), default=None)
    if last is None or actions[last].stage == 0:
        return actions
    return actions + [Action("W", actions[last].microbatch, actions[last].stage)]
