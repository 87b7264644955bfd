"""Measure activation memory instead of assuming it.

While ``ActivationMeter.tracking()`` is active, every tensor autograd saves for backward (other
than parameters) is counted until autograd frees it, and the engine adds each forward output until
the send that holds its storage is known delivered (the output itself keeps only its graph,
Megatron-LM's ``deallocate_output_tensor``). ``peak_bytes``
is the largest total alive at any moment of the step: what 1F1B bounds by ``P - rank``
micro-batches (Narayanan et al. 2021, arXiv 2104.04473 §2.2) and GPipe by ``M``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


class _Held:
    """A saved tensor; its storage counts as alive until the last holder of that storage is freed."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "ActivationMeter"):
        # detached: a saved output holding itself (and so its grad_fn, which holds this) would form a
        # cycle that only a backward releasing the graph breaks; a split backward keeps part of it
        self.tensor, self.meter = tensor.detach(), meter
        storage = tensor.untyped_storage()
        self.key = storage.data_ptr()
        meter.hold(self.key, storage.nbytes(), +1)

    def __del__(self):
        self.meter.hold(self.key, 0, -1)


class ActivationMeter:
    """Live and peak bytes of activations kept for backward (each storage counted once)."""

    def __init__(self, module: nn.Module):
        self.params = {p.data_ptr() for p in module.parameters()}
        self.holders: dict[int, list[int]] = {}  # storage address -> [bytes, holders]
        self.live = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def hold(self, key: int, nbytes: int, change: int) -> None:
        entry = self.holders.setdefault(key, [nbytes, 0])
        if entry[1] == 0:
            self.add(entry[0])
        entry[1] += change
        if entry[1] == 0:
            self.add(-entry[0])
            del self.holders[key]

    def _pack(self, t: torch.Tensor):
        if t.data_ptr() in self.params or t.untyped_storage().nbytes() == 0:
            return t
        return _Held(t, self)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    @contextmanager
    def tracking(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
