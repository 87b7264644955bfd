"""Gradient finalisation: what happens between the last backward of a step and the optimizer step.

Megatron-LM gathers these steps in one function (``finalize_model_grads``); here they are one
object, which the strategy calls once per backward window (after every micro-batch's backward
under pipeline parallelism, after the window's last backward otherwise). The order, and why:

1. **weights tied between pipeline stages** (embedding and head): their gradients are summed over
   the stages that share them. First, because every stage holds the whole gradient only now;
   ZeRO-1 keeps just a slice of it after step 2.
2. **data parallelism**: gradients are averaged over the data-parallel group. The bucketed
   all-reduces were launched during backward and are only awaited here (``finish``). A pipeline
   runs every micro-batch's backward under ``no_sync`` except, at the end of the window, the last
   one of each stage (``overlapped``): its buckets start while the other stages drain the
   pipeline. Weights several stages share wait for step 1 and are launched here. With ZeRO-1 this
   is a reduce-scatter.
3. **ZeRO-1**: each rank's averaged slice becomes the gradient of the optimizer's piece
   (Rajbhandari et al. 2020, stage 1).
4. **sequence-parallel norms**: norm weights see only their sequence shard under sequence
   parallelism, so their gradients are summed over the tensor-parallel group (Korthikanti et al.
   2022, arXiv 2205.05198 §4.2.2), on whichever tensors hold gradients now (ZeRO-1's pieces when
   sharded).

Steps 1, 2 and 4 are sums or means over different groups of ranks, so they would commute on whole
gradients; the order matters only because of ZeRO-1's slicing.

Under ZeRO-2/3 (``data_parallel.fully_sharded``) step 2 comes first: the whole gradients exist only
until FSDP reduce-scatters them, during backward or (pipelined) when the window ends. Every stage of
a pipeline shards a tied weight alike, so step 1 then sums the shards, and step 4 likewise over the
TP ranks; a sum of means is the mean of sums.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional

from torch import nn

from lightning_parallel.data_parallel import GradientSynchronizer
from lightning_parallel.data_parallel.fully_sharded import FullySharded
from lightning_parallel.data_parallel.zero import ZeroOneSharding
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.tensor_parallel import sync_sequence_parallel_grads


class GradientFinalizer:
    """Completes one backward window's gradients, in the order of this module's docstring.

    Args:
        module: the (possibly split) LightningModule whose parameters hold the gradients.
        pipeline: the ``PipelineEngine`` under pipeline parallelism, else None.
        grad_sync: the data-parallel synchronizer when the data-parallel group has several ranks.
        zero: ZeRO-1's sharding when ``zero_stage=1``.
        sequence_parallel_mesh: the mesh when sequence parallelism is on with TP > 1, else None.
        fully_sharded: ZeRO-2/3's sharding, with no ``grad_sync`` nor ``zero``.
    """

    def __init__(
        self,
        module: nn.Module,
        pipeline: Optional[Any] = None,
        grad_sync: Optional[GradientSynchronizer] = None,
        zero: Optional[ZeroOneSharding] = None,
        sequence_parallel_mesh: Optional[ParallelMesh] = None,
        fully_sharded: Optional[FullySharded] = None,
    ) -> None:
        self.module, self.pipeline, self.grad_sync, self.zero = module, pipeline, grad_sync, zero
        self.sequence_parallel_mesh, self.fully_sharded = sequence_parallel_mesh, fully_sharded

    @contextmanager
    def overlapped(self, window_ends: bool) -> Iterator[None]:
        """Around a pipelined training step: when the step ends the accumulation window, each stage's
        last backward launches its data-parallel buckets (``GradientSynchronizer.syncing``)."""
        if self.pipeline is None or self.grad_sync is None or not window_ends:
            yield
            return
        sync = self.grad_sync
        self.pipeline.final_weight_context = lambda stage: sync.syncing()
        try:
            yield
        finally:
            self.pipeline.final_weight_context = lambda stage: nullcontext()

    def __call__(self) -> None:
        if self.fully_sharded is not None:
            self.fully_sharded.finish()
        if self.pipeline is not None:
            self.pipeline.sync_tied_grads()
        if self.grad_sync is not None:
            self.grad_sync.finish()
        if self.zero is not None:
            self.zero.attach_grads()
        if self.sequence_parallel_mesh is not None:
            holder = self.module if self.zero is None else self.zero.holder
            sync_sequence_parallel_grads(holder, self.sequence_parallel_mesh)


def shared_across_stages(module: nn.Module, pipeline: Any) -> list[nn.Parameter]:
    """Local parameters whose gradient is not final after one stage's last backward: those tied
    across pipeline ranks, those of modules on several of this rank's stages, and those of no stage."""
    stages_of: dict[int, set[int]] = {}
    local = set(pipeline.plan.stages_of_rank(pipeline.mesh.pp_rank))
    for module_name, stage in pipeline.plan.module_stages().items():
        if stage in local:
            for p in module.get_submodule(module_name).parameters():
                stages_of.setdefault(id(p), set()).add(stage)
    tied = {id(p) for p, _, _ in pipeline.tied}
    return [p for p in module.parameters() if id(p) in tied or len(stages_of.get(id(p), ())) != 1]
