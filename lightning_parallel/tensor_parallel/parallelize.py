"""Entry point the strategy calls: detect or read a plan, check it, shard the model in place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from torch import nn

from .apply import apply_plan
from .detect import detect_plan
from .lora import rowwise_lora_layers, shard_lora_dropout
from .plan import parse_plan
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
    rng = TPRandom(mesh.tp_rank)
    before = {a.name: dict(a.module.named_parameters(recurse=False)) for a in assignments}
    rowwise_lora = rowwise_lora_layers(module, assignments)
    apply_plan(module, assignments, mesh, sequence_parallel, rng)
    _retie(module, {id(p): getattr(a.module, n, None) for a in assignments for n, p in before[a.name].items()})
    shard_lora_dropout(module, rowwise_lora, rng)
    if mesh.tp_rank == 0 and mesh.dp_rank == 0:
        print_plan(assignments, mesh.tp_size, sequence_parallel)


def _retie(root: nn.Module, sharded: dict[int, nn.Parameter]) -> None:
    """Point every container that also registers a sharded parameter at its shard, so a tie
    survives (BERT registers its output bias both as ``decoder.bias`` and as ``predictions.bias``).
    Layers that compute with the parameter (an embedding tied to a sharded head) are left alone:
    a shard would not fit their forward."""
    for module in root.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        for name, param in list(module._parameters.items()):
            new = sharded.get(id(param)) if param is not None else None
            if new is not None and new is not param:
                module._parameters[name] = new
