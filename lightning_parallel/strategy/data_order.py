"""Which order the training batches come in, said once when training starts.

A strategy that Lightning treats as distributed (``is_distributed``, as ours are) gets its training
loaders rewritten: Lightning puts a ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)`` (over
the data-parallel replicas, one for TP/PP-only layouts) in place of the loader's sampler, exactly as
under its own ``ddp``. A loader that reads in order on one device is then read in a seeded shuffled
order, so the first loss of a TP or PP run differs from the same module on one device, although both
compute the same function: the run reproduces Lightning's ``ddp`` with as many devices as replicas,
not one device reading the loader as written. ``Trainer(use_distributed_sampler=False)`` keeps the
loader's order (each replica then reads every batch: with several replicas, give the loader a
``DistributedSampler(shuffle=False)`` over the replicas of its own, which Lightning keeps).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from torch.utils.data import DistributedSampler


def _sampler(loader: Any) -> Any:
    batch_sampler = getattr(loader, "batch_sampler", None)
    return getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)


def shuffled_by_lightning(loaders: Iterable[Any], distributed_sampler: bool) -> bool:
    """Whether a training loader among ``loaders`` reads through a shuffling ``DistributedSampler`` that
    Lightning put in (``distributed_sampler``: the Trainer's ``use_distributed_sampler``)."""
    return distributed_sampler and any(
        isinstance(sampler, DistributedSampler) and sampler.shuffle for sampler in map(_sampler, loaders)
    )


def data_order_note(loaders: Iterable[Any], distributed_sampler: bool, replicas: int) -> Optional[str]:
    """The start-of-training line saying that the training batches come in Lightning's shuffled order and
    how to keep the loader's own; None when they keep it."""
    if not shuffled_by_lightning(loaders, distributed_sampler):
        return None
    keep = ("Trainer(use_distributed_sampler=False)" if replicas == 1 else
            "DistributedSampler(dataset, shuffle=False, **trainer.distributed_sampler_kwargs) as the loader's "
            "sampler")
    return (f"data order   Lightning's DistributedSampler(shuffle=True) reads the training data over {replicas} "
            f"replica(s), as under strategy='ddp' on {replicas} device(s), not in the loader's own order (so the "
            f"first loss differs from one device reading the loader as written); to keep that order: {keep}")
