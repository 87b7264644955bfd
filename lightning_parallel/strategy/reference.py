"""``SingleDeviceReference``: one process on one device, reading the training data as every layout does.

`lp-train strategy=single` is the reference that every parallel layout reproduces. Lightning's own
single-device strategy hands the training loader to the loop as it is: a shuffling loader draws
its order from the global random state. Every distributed strategy (ours, and Lightning's DDP)
replaces the sampler with a ``DistributedSampler`` instead, shuffled from the seed alone
(``PL_GLOBAL_SEED``), so with a data module that shuffles (or with none: the injected sampler
shuffles training data either way) one device would read other batches than the layouts it is
compared with. This strategy asks Lightning for that same sampler, with one replica, and is
otherwise Lightning's single-device run: no process group, no wrapping, no collectives.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy


class SingleDeviceReference(ParallelStrategy):
    """One process, one device; the training batches in the order the parallel strategies read them."""

    @property
    def is_distributed(self) -> bool:
        # read by Lightning to inject the DistributedSampler (with the arguments below)
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[0]

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj
