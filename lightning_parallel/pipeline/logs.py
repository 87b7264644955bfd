"""Make what the last stage logs reach every rank of the pipeline.

Only the last stage gets to the end of the user's step, so its ``self.log`` calls are the real
ones. During the schedule they are recorded instead of logged (a ``sync_dist=True`` collective
inside the schedule would deadlock against stages waiting on point-to-point messages); after it,
the engine broadcasts the records of the last stage and every rank replays them, in the same
order, through the real ``self.log``. Values of one key are combined over micro-batches as the
call's ``reduce_fx`` says, so a step's value equals the full batch's: the mean (the default) with
the micro-batch weights the engine gives per key (the loss's shares of the targets for the loss,
shares of the samples for the rest, see ``targets``), ``"sum"`` summed, ``"max"`` / ``"min"`` the
largest / smallest, any other callable applied to the stacked values.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_parallel.compat import attached_trainer
from lightning_parallel.pipeline.errors import PipelineConfigError

Record = tuple[str, Any, dict]


def _check(name: str, value: Any) -> None:
    if not isinstance(value, (torch.Tensor, int, float)):
        raise PipelineConfigError(
            f"self.log({name!r}, {type(value).__name__}) inside a pipelined step: only tensors and numbers can be "
            "sent to the other stages; log metric.compute() or a tensor instead"
        )


class LogCapture:
    """Records ``module.log`` calls made inside ``recording()``, each with ``microbatch``, the index of the
    micro-batch whose step is running."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.microbatch = 0
        self._calls: dict[str, tuple[dict, list[tuple[int, Any]]]] = {}

    def _record(self, name: str, value: Any, **kwargs) -> None:
        _check(name, value)
        if isinstance(value, torch.Tensor):
            # stays on the device: ``records`` moves all of a step's values to the host in one copy
            value = value.detach()
            value = value.to(torch.promote_types(value.dtype, torch.float32))  # float64 stays float64
        self._calls.setdefault(name, (kwargs, []))[1].append((self.microbatch, value))

    @contextmanager
    def recording(self) -> Iterator["LogCapture"]:
        self._calls = {}
        self.module.log = self._record  # instance attribute shadows LightningModule.log
        try:
            yield self
        finally:
            del self.module.log

    @contextmanager
    def suppressed(self) -> Iterator[list[tuple[str, Any]]]:
        """``self.log`` checks its value and logs nothing: for the setup trace, whose step is no real one.
        Yields the list of ``(name, value)`` pairs the step logged."""
        logged: list[tuple[str, Any]] = []

        def log(name: str, value: Any, **kwargs: Any) -> None:
            _check(name, value)
            logged.append((name, value))

        self.module.log = log
        try:
            yield logged
        finally:
            del self.module.log

    def logged(self, microbatch: int) -> list[tuple[str, Any]]:
        """The ``(name, value)`` pairs recorded so far for ``microbatch``."""
        return [(name, value) for name, (_, values) in self._calls.items() for mb, value in values if mb == microbatch]

    def records(self, weight: Callable[[str, int], float] = lambda name, microbatch: 1.0) -> list[Record]:
        """One record per key: its values over the micro-batches that logged it, combined by ``reduce_fx``,
        a mean with ``weight(name, microbatch)``.

        Tensor values are combined where they are and reach the host together, one copy per dtype
        (a host copy from a GPU waits for the queued kernels; one per logged value would wait each time).
        """
        return _on_host([(name, combine([(weight(name, mb), v) for mb, v in values], kwargs.get("reduce_fx", "mean")),
                          kwargs) for name, (kwargs, values) in self._calls.items()])


def combine(values: list[tuple[float, Any]], reduce_fx: Any) -> Any:
    """One step's value of a key from its ``(micro-batch weight, value)`` pairs, as Lightning would
    reduce them (``reduce_fx`` of ``self.log``: "mean", "sum", "max", "min" or a callable)."""
    kind = _REDUCTIONS.get(reduce_fx, reduce_fx)
    if kind == "mean":
        # a micro-batch of weight 0 (no targets) may have logged NaN: it takes no part, as on one device
        values = [(w, v) for w, v in values if w] or [(1.0, v) for _, v in values]
        return sum(w * v for w, v in values) / sum(w for w, _ in values)
    if kind == "sum":
        return sum(v for _, v in values)
    tensors = [torch.as_tensor(v) for _, v in values]
    if kind in ("max", "min"):
        stacked = torch.stack([t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors])
        return stacked.amax(0) if kind == "max" else stacked.amin(0)
    return kind(torch.stack(tensors))


_REDUCTIONS = {"mean": "mean", "avg": "mean", torch.mean: "mean", "sum": "sum", torch.sum: "sum",
               "max": "max", torch.max: "max", "min": "min", torch.min: "min"}


def _on_host(records: list[Record]) -> list[Record]:
    """The records with their tensor values moved to the CPU, one concatenated copy per dtype."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, value, _) in enumerate(records):
        if isinstance(value, torch.Tensor):
            by_dtype.setdefault(value.dtype, []).append(i)
    records = list(records)
    for indices in by_dtype.values():
        tensors = [records[i][1] for i in indices]
        flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
        for i, t, part in zip(indices, tensors, flat.split([t.numel() for t in tensors])):
            name, _, kwargs = records[i]
            records[i] = (name, part.view(t.shape), kwargs)
    return records


def replay(module: nn.Module, records: list[Record]) -> None:
    """Log the records through the module's real ``self.log`` (on every rank, same order).

    A module driven without a Trainer (the engine used directly) has nowhere to log to.
    """
    if attached_trainer(module) is None:
        return
    for name, value, kwargs in records:
        module.log(name, value, **kwargs)
