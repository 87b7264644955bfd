"""Replay rank schedules on an ideal machine: step time, bubble and micro-batches in flight.

Every forward of one stage costs ``forward_cost``; a backward split into an input-gradient pass
``B`` and a weight pass ``W`` costs ``backward_cost`` and ``weight_cost`` (Qi et al. 2023, arXiv
2401.10241, whose bubbles assume all three equal), an unsplit ``B`` (no ``W`` for it in the
schedule) the sum of both, so with the defaults a forward costs 1 and a whole backward 2. Each cost
may instead be a mapping from stage to cost, for stages that differ (the first stage has no input
gradient to compute; the last also computes the loss). A message to another rank arrives
``message_cost`` after its send; one between two stages of the same rank at once. A rank starts its next compute as soon as the inputs it waits for exist. The
bubble is the idle share of all ranks' time over the step (Narayanan et al. 2021,
arXiv 2104.04473 §2.2 call ``(P - 1) / M`` of the ideal time; of the whole step it is
``(P - 1) / (M + P - 1)`` for GPipe and 1F1B with equal stages). A micro-batch is in flight on a
stage from its forward until the pass that ends its backward (``W`` where split): the activations
its weight gradients need live until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

from lightning_parallel.pipeline.schedules.actions import Action, Op, matching_receive
from lightning_parallel.pipeline.schedules.validation import replay


@dataclass
class Interval:
    """One compute action on one rank, in simulated or measured time."""

    rank: int
    op: Op  # F, B or W
    microbatch: int
    stage: int
    start: float
    end: float


@dataclass
class Simulation:
    """The ideal step: its length, the idle share of all ranks' time, the peak micro-batches in flight
    per rank, and every compute action's interval."""

    step_time: float
    bubble_fraction: float
    peak_in_flight: list[int]
    intervals: list[Interval]


Cost = Union[float, Mapping[int, float]]


def simulate(schedules: list[list[Action]], forward_cost: Cost = 1.0, backward_cost: Cost = 1.0,
             weight_cost: Cost = 1.0, message_cost: float = 0.0) -> Simulation:
    """Run the schedules (assumed valid) and measure the ideal step."""
    costs = {Op.F: forward_cost, Op.B: backward_cost, Op.W: weight_cost}
    holder = {a.stage: rank for rank, acts in enumerate(schedules) for a in acts}

    def cost_of(op: Op, stage: int) -> float:
        cost = costs[op]
        return cost[stage] if isinstance(cost, Mapping) else cost

    split = {a.unit for acts in schedules for a in acts if a.op is Op.W}
    ready_at: dict[Action, float] = {}  # receive -> when its message arrives
    clock = [0.0] * len(schedules)
    in_flight = [0] * len(schedules)
    peak = [0] * len(schedules)
    intervals: list[Interval] = []

    def visit(rank: int, _: int, a: Action) -> None:
        if a.op.is_receive:
            clock[rank] = max(clock[rank], ready_at[a])
        elif a.op.is_send:
            receive = matching_receive(a)
            ready_at[receive] = clock[rank] + (message_cost if holder[receive.stage] != rank else 0.0)
        else:
            whole = a.op is Op.B and a.unit not in split
            cost = cost_of(a.op, a.stage) + (cost_of(Op.W, a.stage) if whole else 0.0)
            intervals.append(Interval(rank, a.op, a.microbatch, a.stage, clock[rank], clock[rank] + cost))
            clock[rank] += cost
            in_flight[rank] += 1 if a.op is Op.F else -1 if a.op is Op.W or whole else 0
            peak[rank] = max(peak[rank], in_flight[rank])

    replay(schedules, visit)
    step = max(clock)
    busy = sum(i.end - i.start for i in intervals)
    return Simulation(step, 1.0 - busy / (step * len(schedules)), peak, intervals)
