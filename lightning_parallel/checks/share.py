"""How much of the model each rank holds, and refusing a tensor-parallel split that keeps nearly all of it.

A tensor-parallel plan splits attention heads, MLP hidden layers, embeddings and experts; what it
finds nothing to split in (a state-space mixer, a recurrent block, a custom layer) stays whole on
every rank. A model made mostly of such layers "splits" with every rank still holding nearly all
of it: the run costs the communication of tensor parallelism and gives back no memory, and nothing
said so. So the share of the model's parameters on the largest rank is reported (the run's start
block, ``lp-plan``, the zoo), and a split that leaves ``WORTHLESS`` (90%) or more of them on every
tensor-parallel rank is refused as nothing worth splitting, unless the user gave the plan
(``tp_plan``): then it is what they asked for.

Pure but for ``measured_share``, which counts what the ranks hold after the split (one collective).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch import nn

from lightning_parallel.errors import Fix, LaunchError
from lightning_parallel.mesh import local_part
from lightning_parallel.pipeline.partition import StagePlan
from lightning_parallel.planner.estimate import (
    held_elements,
    parameters_per_rank,
    tp_sharded_parameters,
)
from lightning_parallel.tensor_parallel.names import block_glob

WORTHLESS = 0.9


@dataclass(frozen=True)
class Share:
    """``largest`` parameter elements on the most loaded rank (``rank``: its global rank, or its
    pipeline rank in a plan) of ``whole`` in the unsplit model."""

    largest: int
    whole: int
    rank: int
    measured: bool = False

    @property
    def fraction(self) -> float:
        return self.largest / self.whole if self.whole else 1.0

    def describe(self) -> str:
        where = f"rank {self.rank}" if self.measured else f"pp rank {self.rank}"
        return (f"{100 * self.fraction:.1f}% of the parameters on the largest rank ({where}: "
                f"{_count(self.largest)} of {_count(self.whole)})")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def planned_share(model: nn.Module, assignments: list, tp: int, stages: Optional[StagePlan]) -> Share:
    """The share the plan gives the largest rank: its pipeline stages' parameters (all of them without
    pipelining), those the TP plan shards divided by ``tp``. Works on a model built on the meta device."""
    sharded = tp_sharded_parameters(assignments)
    whole = sum(p.numel() for p in model.parameters())
    if stages is None:
        held = [sum(held_elements(p, sharded, tp) for p in model.parameters())]
    else:
        held = parameters_per_rank(model, stages, sharded, tp)
    rank = max(range(len(held)), key=held.__getitem__)
    return Share(held[rank], whole, rank)


def measured_share(module: nn.Module, whole: int) -> Share:
    """What the ranks hold after the split (collective: every rank calls it); of a parameter sharded over
    the data-parallel replicas (ZeRO-2/3), this rank's rows."""
    held = sum(local_part(p).numel() for p in module.parameters())
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, held)
    rank = max(range(len(every)), key=every.__getitem__)
    return Share(every[rank], whole, rank, measured=True)


def refuse_nothing_worth_splitting(model: nn.Module, assignments: list, tp: int) -> None:
    """Refuse a detected TP plan that leaves ``WORTHLESS`` or more of the parameters on every TP rank."""
    share = planned_share(model, assignments, tp, None)
    if share.fraction < WORTHLESS:
        return
    sharded = tp_sharded_parameters(assignments)
    whole_modules: Counter = Counter()
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) not in sharded:
                whole_modules[block_glob(name) or type(model).__name__] += p.numel()
    largest = ", ".join(f"{n} ({100 * c / share.whole:.0f}%)" for n, c in whole_modules.most_common(3))
    split = sorted({a.glob for a in assignments if a.entry.style})
    raise LaunchError(
        f"tensor_parallel={tp} would leave {100 * share.fraction:.1f}% of the parameters on every rank: the plan "
        f"found for {type(model).__name__} splits only {', '.join(split[:4])}{', ...' if len(split) > 4 else ''}, "
        f"and the rest stays whole on each rank (the largest whole parts: {largest}). Nothing worth splitting: "
        "the run would pay for tensor parallelism and get no memory back. Give strategy.tp_plan to split it as "
        "you choose (a plan you give is used as given), or train with data or pipeline parallelism instead:",
        [Fix({"strategy.tensor_parallel": 1}, "no tensor parallelism")],
    )
