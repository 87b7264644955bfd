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

    A batch of fewer samples than ``micro_batches`` (the last batch of an epoch without
    ``drop_last``) is split into one micro-batch per sample. Sizes differ by at most one
    (``torch.tensor_split``: 17 into 4 gives 5, 4, 4, 4). Weighting each micro-batch's mean loss by
    its share of samples makes the sum equal the full batch's mean loss, as one device computes it,
    whenever the loss is a mean over samples that each count alike (the same number of tokens in
    each). A loss averaged over a varying number of tokens per micro-batch (padding, ignored labels)
    becomes the sample-weighted mean of micro-batch means, as with gradient accumulation.
    """
    size = _first_tensor(batch).shape[0]
    if size == 0:
        raise PipelineConfigError("a pipelined batch must hold at least one sample along dim 0, got an empty batch")
    parts = min(size, micro_batches)
    sizes = [len(chunk) for chunk in torch.tensor_split(torch.arange(size), parts)]
    return _split(batch, parts), [s / size for s in sizes]


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
