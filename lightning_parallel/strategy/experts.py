"""Expert parallelism inside the strategy: experts placed after the split, gradients averaged over the right
replicas, tokens per expert logged.

The experts of every MoE layer are placed over the expert-parallel group (``expert_parallel/``) once the
model's values agree on every rank (and after a tensor-parallel split). Then:

- **gradients**: a dense parameter is averaged over all data-parallel ranks, as before; an expert
  parameter is held only by the ``dp / ep`` replicas with the same ``ep_rank`` (the expert-data-parallel
  group), and each of its gradients already sums the contributions of the tokens of all ``ep`` ranks it
  served (the all-to-all's backward). Each rank's loss is the mean of its own batch, so the sum over the
  expert-data-parallel group is divided by the whole data-parallel size ``dp`` (Megatron-LM scales expert
  gradients the same way). Two bucketed synchronizers, one per group, behave as one. Under ZeRO-1 the
  dense parameters' optimizer state is sharded over the data-parallel ranks; the experts' stays whole.
- **logging**: after each training step the assignments each expert received (summed over the layers and
  the data-parallel replicas, one all-reduce) are logged as ``tokens_per_expert/<e>``, and their imbalance
  (``max / mean``; 1 is a perfect balance) as ``tokens_per_expert/imbalance``.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.data_parallel import GradientSynchronizer
from lightning_parallel.expert_parallel import ExpertParallel, parallelize_experts
from lightning_parallel.mesh import ParallelMesh


def place_experts(module: nn.Module, mesh: ParallelMesh) -> Optional[ExpertParallel]:
    """Place ``module``'s experts over ``mesh``'s expert-parallel group (None without expert parallelism)."""
    if mesh.ep_size == 1:
        return None
    return parallelize_experts(module, mesh.ep_group, mesh.ep_size, mesh.ep_rank)


class ExpertAndDenseSync:
    """The dense parameters' synchronizer over all data-parallel ranks and the experts' over their replicas,
    used as one ``GradientSynchronizer`` (``no_sync``, ``syncing``, ``finish``, ``remove``)."""

    def __init__(self, dense: GradientSynchronizer, experts: GradientSynchronizer) -> None:
        self.parts = (dense, experts)

    def no_sync(self) -> ContextManager[None]:
        return self._each("no_sync")

    def syncing(self) -> ContextManager[None]:
        return self._each("syncing")

    @contextmanager
    def _each(self, name: str) -> Iterator[None]:
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(getattr(part, name)())
            yield

    def finish(self) -> None:
        for part in self.parts:
            part.finish()

    def remove(self) -> None:
        for part in self.parts:
            part.remove()


def gradient_synchronizer(module: nn.Module, mesh: ParallelMesh, bucket_size_mb: float, shard: bool,
                          deferred: Any, experts: Optional[ExpertParallel]) -> Any:
    """The data-parallel synchronizer of ``module``: one over ``mesh.dp_cp_group``, or, with experts placed,
    that one for the dense parameters beside one over the expert-data-parallel group for the experts."""
    if experts is None:
        return GradientSynchronizer(list(module.parameters()), mesh.dp_cp_group, bucket_size_mb, shard=shard,
                                    deferred=deferred)
    expert_params = {id(p) for p in experts.parameters()}
    dense = [p for p in module.parameters() if id(p) not in expert_params]
    return ExpertAndDenseSync(
        GradientSynchronizer(dense, mesh.dp_cp_group, bucket_size_mb, shard=shard),
        GradientSynchronizer(experts.parameters(), mesh.edp_group, bucket_size_mb, average_over=mesh.dp_size),
    )


def dense_part(sync: Any) -> GradientSynchronizer:
    """The synchronizer of the parameters every data-parallel rank holds: the one ZeRO-1 shards the
    optimizer state of (the experts' state stays whole on the ranks holding them)."""
    return sync.parts[0] if isinstance(sync, ExpertAndDenseSync) else sync


def log_tokens_per_expert(module: Any, experts: ExpertParallel, dp_group: Any) -> None:
    """Log the assignments each expert received in the step just run (summed over layers and replicas)."""
    counts = experts.tokens_per_expert()
    if not counts:
        return
    sizes = {c.numel() for c in counts.values()}
    if len(sizes) != 1:  # layers of different widths: per-expert totals would mix experts
        return
    total = torch.stack(list(counts.values())).sum(0).float()
    dist.all_reduce(total, group=dp_group)
    for e, n in enumerate(total):
        module.log(f"tokens_per_expert/{e}", n, on_step=True, on_epoch=False)
    module.log("tokens_per_expert/imbalance", total.max() / total.mean().clamp_min(1e-9), on_step=True,
               on_epoch=False)
