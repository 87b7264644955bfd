"""Split a batch into micro-batches along dim 0 (tensors, or tuples, lists and dicts of them)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_parallel.pipeline.errors import PipelineConfigError


def _first_tensor(batch: Any) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        try:
            return _first_tensor(item)
        except PipelineConfigError:
            continue
    raise PipelineConfigError(f"a pipelined batch must contain a tensor to split, got {type(batch).__name__}")


def _split(batch: Any, parts: int) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, parts, dim=0))
    if isinstance(batch, dict):
        columns = {k: _split(v, parts) for k, v in batch.items()}
        return [type(batch)({k: columns[k][i] for k in batch}) for i in range(parts)]
    if isinstance(batch, (tuple, list)):
        columns = [_split(v, parts) for v in batch]
        rows = [[c[i] for c in columns] for i in range(parts)]
        if hasattr(batch, "_fields"):  # namedtuple
            return [type(batch)(*r) for r in rows]
        return [type(batch)(r) for r in rows]
    return [batch] * parts  # non-tensor values (flags, strings) go to every micro-batch


def split_batch(batch: Any, micro_batches: int) -> tuple[list[Any], list[float]]:
    """The micro-batches and their weights ``size_i / batch_size`` (``1 / M`` when the split is even).

    Weighting each micro-batch's mean loss by its share of samples makes the sum equal the full
    batch's mean loss even when the batch size is not a multiple of ``micro_batches``.
    """
    size = _first_tensor(batch).shape[0]
    if size < micro_batches:
        raise PipelineConfigError(
            f"a batch of {size} samples cannot be split into micro_batches={micro_batches}; use micro_batches <= "
            f"{size} or a larger batch size (a multiple of {micro_batches} keeps micro-batches equal)"
        )
    sizes = [len(chunk) for chunk in torch.tensor_split(torch.arange(size), micro_batches)]
    return _split(batch, micro_batches), [s / size for s in sizes]


def signature(micro_batch: Any) -> tuple:
    """A hashable description of a micro-batch's structure: tensor shapes and dtypes, plain values.

    Every stage of a pipeline gets the same batch, so each computes the same signature locally. Two
    micro-batches with one signature give hidden states of one shape, which lets a stage reuse the
    shape it learned from an earlier step instead of receiving it again.
    """
    if isinstance(micro_batch, torch.Tensor):
        return ("T", tuple(micro_batch.shape), micro_batch.dtype)
    if isinstance(micro_batch, dict):
        return ("D", tuple((k, signature(v)) for k, v in micro_batch.items()))
    if isinstance(micro_batch, (tuple, list)):
        return ("S", tuple(signature(v) for v in micro_batch))
    if micro_batch is None or isinstance(micro_batch, (bool, int, float, str)):
        return ("V", micro_batch)
    return ("O", type(micro_batch).__qualname__)
