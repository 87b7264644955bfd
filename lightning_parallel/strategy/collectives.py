"""Lightning's collectives for ``ParallelStrategy``, over the ranks that hold distinct values.

The ranks of one data-parallel replica (its TP shards, CP ranks and pipeline stages) hold the same
logged values, so ``self.log(sync_dist=True)`` and ``self.all_gather`` count each replica once, as
one device would; decisions (early stopping, checkpointing) and broadcasts span every rank.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import group as _group
from torch import Tensor
from typing_extensions import override

from lightning_parallel.compat import (
    _distributed_is_initialized,
    _sync_ddp_if_available,
)


class MeshCollectives:
    """``reduce``, ``all_gather``, ``reduce_boolean_decision``, ``barrier`` and ``broadcast`` on the mesh
    (mixed into ``ParallelStrategy``)."""

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        """Reduce over the data-parallel replicas (``self.log(..., sync_dist=True)`` comes here).

        The ranks of one replica's tensor, context and pipeline groups hold the same logged values
        (TP and CP ranks compute them alike, pipeline stages replay the last stage's), so reducing over
        every rank would count a ``reduce_fx="sum"`` value tp x cp x pp times; the mean, max and min are
        the same either way. An explicit ``group`` is used as given.
        """
        if isinstance(tensor, Tensor):
            if group is None and self.mesh is not None and _distributed_is_initialized():
                group = self.mesh.dp_group
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """``self.all_gather``: one entry per data-parallel replica (and pipeline stage), not per TP or CP rank.

        The TP and CP ranks of a replica hold the same values, as a model on one device would compute
        them once; gathering them all would repeat every sample ``tensor_parallel x context_parallel``
        times. A group other than the world is used as given.
        """
        gathered = super().all_gather(tensor, group, sync_grads)
        default = group is None or group is dist.group.WORLD  # LightningModule.all_gather passes WORLD
        mesh = self.mesh
        if not default or mesh is None or mesh.tp_size * mesh.cp_size == 1 or not _distributed_is_initialized():
            return gathered
        me = mesh.my_coords
        return gathered[[r for r in range(mesh.world_size) if (mesh.coords(r).tp, mesh.coords(r).cp) == (me.tp, me.cp)]]

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Whether every rank (``all``) or any rank decided so, over all ranks (early stopping, checkpoints)."""
        if not _distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]
