"""torchmetrics states summed once per model replica under tensor and context parallelism.

A ``torchmetrics.Metric`` syncs its states over every rank by default. The TP and CP ranks of one
replica see the same batch and update their metrics alike (CP ranks compute the loss on the whole,
gathered sequence), so a ``SumMetric`` (or any "sum" state) would be counted ``tensor_parallel x
context_parallel`` times; ratios such as accuracy hide it, counts and sums do not. Pipeline stages
need nothing: only the last stage reaches the metric's update, the others keep its initial state
(zeros, empty lists), which adds nothing. So each metric gathers from every rank as usual and keeps
the states of the ranks in its own TP and CP position only: one copy per replica and stage.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_parallel.mesh import ParallelMesh


def one_copy_per_replica(mesh: ParallelMesh) -> Callable:
    """A ``dist_sync_fn`` for torchmetrics: gather over the world, keep the ranks with this rank's TP and CP
    indices."""
    from torchmetrics.utilities.distributed import gather_all_tensors

    me = mesh.my_coords
    keep = [r for r in range(mesh.world_size) if (mesh.coords(r).tp, mesh.coords(r).cp) == (me.tp, me.cp)]

    def gather(result: torch.Tensor, group: Optional[Any] = None) -> list[torch.Tensor]:
        gathered = gather_all_tensors(result, group)
        return gathered if group is not None else [gathered[r] for r in keep]
    return gather


def sync_metrics_per_replica(module: nn.Module, mesh: ParallelMesh) -> int:
    """Give every torchmetrics metric of ``module`` without its own sync function or group the one above;
    returns how many were set. Nothing to do without tensor or context parallelism, or torchmetrics."""
    if mesh.tp_size * mesh.cp_size == 1:
        return 0
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - Lightning depends on torchmetrics
        return 0
    gather = one_copy_per_replica(mesh)
    count = 0
    for metric in module.modules():
        if isinstance(metric, Metric) and metric.dist_sync_fn is None and metric.process_group is None:
            metric.dist_sync_fn = gather
            count += 1
    return count
