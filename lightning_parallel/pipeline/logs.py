"""Make what the last stage logs reach every rank of the pipeline.

Only the last stage gets to the end of the user's step, so its ``self.log`` calls are the real
ones. During the schedule they are recorded instead of logged (a ``sync_dist=True`` collective
inside the schedule would deadlock against stages waiting on point-to-point messages); after it,
the engine broadcasts the records of the last stage and every rank replays them, in the same
order, through the real ``self.log``. Values of one key are averaged over micro-batches with the
micro-batch weights, so a step's value equals the full batch's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from lightning_parallel.pipeline.errors import PipelineConfigError

Record = tuple[str, Any, dict]


class LogCapture:
    """Records ``module.log`` calls made inside ``recording()``; ``weight`` is the current micro-batch's."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.weight = 1.0
        self._calls: dict[str, tuple[dict, list[tuple[float, Any]]]] = {}

    def _record(self, name: str, value: Any, **kwargs) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().float().cpu()
        elif not isinstance(value, (int, float)):
            raise PipelineConfigError(
                f"self.log({name!r}, {type(value).__name__}) inside a pipelined step: only tensors and numbers can be "
                "sent to the other stages; log metric.compute() or a tensor instead"
            )
        self._calls.setdefault(name, (kwargs, []))[1].append((self.weight, value))

    @contextmanager
    def recording(self) -> Iterator["LogCapture"]:
        self._calls = {}
        self.module.log = self._record  # instance attribute shadows LightningModule.log
        try:
            yield self
        finally:
            del self.module.log

    def records(self) -> list[Record]:
        """One record per key: the weighted mean of its values over the micro-batches that logged it."""
        out = []
        for name, (kwargs, values) in self._calls.items():
            total = sum(w for w, _ in values)
            out.append((name, sum(w * v for w, v in values) / total, kwargs))
        return out


def replay(module: nn.Module, records: list[Record]) -> None:
    """Log the records through the module's real ``self.log`` (on every rank, same order).

    A module driven without a Trainer (the engine used directly) has nowhere to log to.
    """
    if getattr(module, "_trainer", None) is None:
        return
    for name, value, kwargs in records:
        module.log(name, value, **kwargs)
