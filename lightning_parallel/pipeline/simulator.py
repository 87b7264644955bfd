"""Replay rank schedules on an ideal machine: step time, bubble and micro-batches in flight.

Every forward of one stage costs ``forward_cost`` and every backward ``backward_cost``; messages
arrive instantly. A rank starts its next compute as soon as the inputs it waits for exist. The
bubble is the idle share of all ranks' time over the step (Narayanan et al. 2021,
arXiv 2104.04473 §2.2 call ``(P - 1) / M`` of the ideal time; of the whole step it is
``(P - 1) / (M + P - 1)`` for GPipe and 1F1B with equal stages).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.pipeline.schedules import Action, matching_receive, replay


@dataclass
class Interval:
    """One compute action on one rank, in simulated or measured time."""

    rank: int
    op: str
    microbatch: int
    stage: int
    start: float
    end: float


@dataclass
class Simulation:
    step_time: float
    bubble_fraction: float
    peak_in_flight: list[int]
    intervals: list[Interval]


def simulate(schedules: list[list[Action]], forward_cost: float = 1.0, backward_cost: float = 2.0) -> Simulation:
    """Run the schedules (assumed valid) and measure the ideal step."""
    ready_at: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(schedules)
    in_flight = [0] * len(schedules)
    peak = [0] * len(schedules)
    intervals: list[Interval] = []

    def visit(rank: int, _: int, a: Action) -> None:
        if a.op in ("recv_f", "recv_b"):
            clock[rank] = max(clock[rank], ready_at[(a.op, a.microbatch, a.stage)])
        elif a.op in ("send_f", "send_b"):
            ready_at[matching_receive(a)] = clock[rank]
        else:
            cost = forward_cost if a.op == "F" else backward_cost
            intervals.append(Interval(rank, a.op, a.microbatch, a.stage, clock[rank], clock[rank] + cost))
            clock[rank] += cost
            in_flight[rank] += 1 if a.op == "F" else -1
            peak[rank] = max(peak[rank], in_flight[rank])

    replay(schedules, visit)
    step = max(clock)
    busy = sum(i.end - i.start for i in intervals)
    return Simulation(step, 1.0 - busy / (step * len(schedules)), peak, intervals)
