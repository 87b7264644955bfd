"""Entry point the strategy calls: detect or read a plan, check it, shard the model in place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
from torch import nn

from .apply import apply_plan
from .plan import detect_plan, parse_plan
from .random import TPRandom
from .report import print_plan
from .resolve import resolve_plan


def parallelize(module: nn.Module, mesh, plan: Optional[Mapping] = None, sequence_parallel: bool = False) -> None:
    """Shard ``module`` (usually the whole LightningModule) across ``mesh``'s TP group, in place.

    ``plan`` maps module-name globs, relative to ``module``, to styles (see ``plan.py``); None
    detects one. All checks run before any change, so a bad plan raises ``TensorParallelError``
    on every rank alike. The full weights must already be identical on all TP ranks. The plan
    in force is printed once per pipeline stage (TP and DP rank 0).
    """
    if mesh.tp_size == 1:
        return
    entries = parse_plan(plan) if plan is not None else detect_plan(module, sequence_parallel)
    assignments = resolve_plan(module, entries, mesh.tp_size, sequence_parallel)
    rng = TPRandom(torch.initial_seed(), mesh.tp_rank)
    apply_plan(module, assignments, mesh, sequence_parallel, rng)
    if mesh.tp_rank == 0 and mesh.dp_rank == 0:
        print_plan(assignments, mesh.tp_size, sequence_parallel)
