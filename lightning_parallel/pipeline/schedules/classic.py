"""The schedules without weight passes, each backward whole: GPipe, 1F1B and interleaved 1F1B.

All flush the pipeline once per step, so the update equals one device's:

* ``gpipe``: every forward, then every backward (Huang et al. 2019, arXiv 1811.06965). Keeps
  the activations of all ``M`` micro-batches alive.
* ``1f1b``: PipeDream-Flush (Narayanan et al. 2021, arXiv 2006.09503) as written in Megatron-LM:
  ``min(P - r - 1, M)`` warm-up forwards, then one forward / one backward, then the cool-down
  backwards. At most ``P - r`` micro-batches are in flight on rank ``r``.
* ``interleaved_1f1b``: the same with ``V`` model chunks per rank (arXiv 2104.04473 §2.2): the
  bubble shrinks by ``V`` at the price of ``V`` times more messages.

Beside them, two orders the engine falls back to on any placement: ``schedule_forward_only`` for
evaluation, and ``schedule_flush`` (GPipe) for a short last batch the chosen schedule cannot split.
"""

from __future__ import annotations

from lightning_parallel.pipeline.errors import PipelineConfigError
from lightning_parallel.pipeline.schedules.actions import (
    Action,
    backward_actions,
    check_sizes,
    forward_actions,
)
from lightning_parallel.pipeline.schedules.placement import stages_of_rank


def schedule_gpipe(stages: int, micro_batches: int, rank: int) -> list[Action]:
    """GPipe: all forwards in micro-batch order, then all backwards."""
    check_sizes(stages, micro_batches, rank)
    acts: list[Action] = []
    for mb in range(micro_batches):
        acts += forward_actions(mb, rank, stages)
    for mb in range(micro_batches):
        acts += backward_actions(mb, rank, stages)
    return acts


def schedule_1f1b(stages: int, micro_batches: int, rank: int) -> list[Action]:
    """1F1B (PipeDream-Flush) with Megatron-LM's warm-up of ``min(P - rank - 1, M)`` forwards."""
    check_sizes(stages, micro_batches, rank)
    warmup = min(stages - rank - 1, micro_batches)
    acts: list[Action] = []
    # warm-up: fill the pipeline
    for mb in range(warmup):
        acts += forward_actions(mb, rank, stages)
    # steady state: one forward, then the backward of the oldest micro-batch in flight
    for i in range(micro_batches - warmup):
        acts += forward_actions(warmup + i, rank, stages)
        acts += backward_actions(i, rank, stages)
    # cool-down: drain the backwards still owed
    for mb in range(micro_batches - warmup, micro_batches):
        acts += backward_actions(mb, rank, stages)
    return acts


def schedule_interleaved_1f1b(stages: int, micro_batches: int, rank: int, virtual_stages: int) -> list[Action]:
    """Interleaved 1F1B: ``V`` chunks per rank, micro-batches taken in groups of ``P``.

    Forwards visit (group, chunk, micro-batch) in that nesting order, backwards the same with the
    chunks reversed; the warm-up is Megatron-LM's ``2 (P - rank - 1) + (V - 1) P`` forwards.
    """
    check_sizes(stages, micro_batches, rank, virtual_stages)
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
        acts += forward_actions(mb, stage, total_stages)
    for i in range(total - warmup):
        acts += forward_actions(*forwards[warmup + i], total_stages)
        acts += backward_actions(*backwards[i], total_stages)
    for mb, stage in backwards[total - warmup :]:
        acts += backward_actions(mb, stage, total_stages)
    return acts


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
    return [a for mb, s in order for a in forward_actions(mb, s, total)]


def schedule_flush(stages: int, micro_batches: int, rank: int, virtual_stages: int = 1,
                   placement: str = "loop") -> list[Action]:
    """GPipe on any placement: the forwards of ``schedule_forward_only``, then every backward, the
    rank's later stages first. Runs any number of micro-batches, so a short last batch that the
    chosen schedule cannot split (interleaved 1F1B needs a multiple of P micro-batches, DualPipeV at
    least 2P) still trains on the same stages, holding its few micro-batches' activations at once."""
    total = stages * virtual_stages
    mine = stages_of_rank(rank, stages, total, placement)
    backwards = [a for s in sorted(mine, reverse=True) for mb in range(micro_batches)
                 for a in backward_actions(mb, s, total)]
    return schedule_forward_only(stages, micro_batches, rank, virtual_stages, placement) + backwards
