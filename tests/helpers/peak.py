"""Peak tensor memory of a rank in one training step, for comparing the planner's estimate with a run.

A CPU process's allocator cannot be asked for its peak, and its resident set carries the interpreter
and libraries, so this counts tensors: the bytes of every tensor alive when the step starts (the
parameters, gradients, optimizer state, the gradient buckets and whatever else a Python object holds,
found by the garbage collector; the data set's own tensors left out), plus the most bytes of tensors created during the step (forward,
backward, optimizer) alive at once, followed by a ``TorchDispatchMode`` through every operator's
outputs until they are freed (each storage once; an in-place update of an older storage is not new).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import weakref

import lightning as L
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensors(TorchDispatchMode):
    """Bytes of the storages that operators create inside it, alive at once (``peak``); storages in ``old``
    (those alive before) are not counted again when an operator returns them (in-place updates)."""

    def __init__(self, old: set[int]):
        super().__init__()
        self.old, self.holders, self.live, self.peak = old, {}, 0, 0

    def _drop(self, key: int) -> None:
        entry = self.holders[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.holders[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            key = StorageWeakRef(t.untyped_storage()).cdata
            if key in self.old:
                continue
            if key not in self.holders:
                self.holders[key] = [t.untyped_storage().nbytes(), 0]
                self.live += self.holders[key][0]
                self.peak = max(self.peak, self.live)
            self.holders[key][1] += 1
            weakref.finalize(t, self._drop, key)
        return out


def _storages(tensors) -> dict[int, int]:
    return {StorageWeakRef(t.untyped_storage()).cdata: t.untyped_storage().nbytes() for t in tensors}


class PeakProbe(L.Callback):
    """Each rank's peak tensor bytes in step ``at`` (module docstring) beside the estimate of the layout
    ``strategy=auto`` chose, and its median step time after two warm-up steps: ``<out_dir>/<rank>.pt``."""

    def __init__(self, out_dir: str, at: int = 2):
        self.out_dir, self.at, self.mode, self.times, self.start = out_dir, at, None, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start = time.perf_counter()
        if trainer.global_step != self.at:
            return
        gc.collect()
        data = _storages(getattr(trainer.train_dataloader.dataset, "tensors", ()))  # the data set: not the model's
        alive = _storages(t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.device.type == "cpu")
        self.base = {key: nbytes for key, nbytes in alive.items() if key not in data}
        self.mode = LiveTensors(set(self.base))
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.start)
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            search = trainer.strategy.layout_search
            mesh = trainer.strategy.mesh
            predicted = search.best.candidate.memory[mesh.coords(trainer.global_rank).pp].total_bytes
            result = {"measured": sum(self.base.values()) + self.mode.peak, "predicted": predicted,
                      "layout": search.best.candidate.layout.describe(),
                      "predicted_step": search.best.prediction.step_time, "sequences": search.best.sequences}
            self.mode = None
            torch.save(result, os.path.join(self.out_dir, f"{trainer.global_rank}.pt"))

    def on_train_end(self, trainer, pl_module):
        path = os.path.join(self.out_dir, f"{trainer.global_rank}.pt")
        result = torch.load(path, weights_only=False)
        result["step"] = statistics.median(self.times[2:]) if len(self.times) > 2 else float("nan")
        torch.save(result, path)
