"""Split a batch into micro-batches along dim 0 (tensors, or tuples, lists and dicts of them), and
merge what the step returns for each micro-batch back into what it would return for the batch."""

from __future__ import annotations

from typing import Any

import torch

from lightning_parallel.pipeline.errors import PipelineConfigError


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    return [t for item in items for t in _tensors(item)]


def batch_size(batch: Any) -> int:
    """The number of samples: the leading size most of the batch's (non-scalar) tensors share, the
    first one's among equals; a per-batch table of another length does not decide it."""
    sizes = [t.shape[0] for t in _tensors(batch) if t.dim() > 0]
    if not sizes:
        raise PipelineConfigError(
            f"a pipelined batch must contain a tensor with a batch dimension to split, got {type(batch).__name__}"
        )
    return max(dict.fromkeys(sizes), key=sizes.count)


def whole_batch_values(batch: Any, path: str = "batch") -> list[str]:
    """Where ``batch`` holds 0-dim tensors: values every micro-batch receives whole (a count over the
    whole batch used to normalise a summed loss would then normalise each micro-batch's sum)."""
    if isinstance(batch, torch.Tensor):
        return [path] if batch.dim() == 0 else []
    if isinstance(batch, dict):
        return [p for k, v in batch.items() for p in whole_batch_values(v, f"{path}[{k!r}]")]
    if isinstance(batch, (tuple, list)):
        return [p for i, v in enumerate(batch) for p in whole_batch_values(v, f"{path}[{i}]")]
    return []


def _per_sample(items: Any, size: int) -> bool:
    """Whether a list holds one entry per sample (strings, numbers, variable-length tensors from a custom
    collate) rather than columns of the batch (``[inputs, targets]``, each with ``size`` rows)."""
    if hasattr(items, "_fields") or len(items) != size:
        return False
    return not all(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size for v in items)


def _split(batch: Any, bounds: list[tuple[int, int]], size: int) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] != size:  # a scalar or a per-batch table: every micro-batch
            return [batch] * len(bounds)
        return [batch[a:b] for a, b in bounds]
    if isinstance(batch, dict):
        columns = {k: _split(v, bounds, size) for k, v in batch.items()}
        return [type(batch)({k: columns[k][i] for k in batch}) for i in range(len(bounds))]
    if isinstance(batch, (tuple, list)):
        if _per_sample(batch, size):
            return [type(batch)(batch[a:b]) for a, b in bounds]
        columns = [_split(v, bounds, size) for v in batch]
        rows = [[c[i] for c in columns] for i in range(len(bounds))]
        if hasattr(batch, "_fields"):  # namedtuple
            return [type(batch)(*r) for r in rows]
        return [type(batch)(r) for r in rows]
    return [batch] * len(bounds)  # non-tensor values (flags, strings) go to every micro-batch


def split_batch(batch: Any, micro_batches: int) -> tuple[list[Any], list[float]]:
    """The micro-batches and their weights ``size_i / batch_size`` (``1 / M`` when the split is even).

    What is split along the samples: tensors whose leading size is the batch size (``batch_size``),
    and lists with one entry per sample (a default-collated list of strings, a custom collate's list
    of variable-length tensors). Scalars, tensors of another leading size and plain values go whole
    to every micro-batch. A batch of fewer samples than ``micro_batches`` (the last batch of an epoch
    without ``drop_last``) is split into one micro-batch per sample. Sizes differ by at most one
    (as ``torch.tensor_split``: 17 into 4 gives 5, 4, 4, 4). Weighting each micro-batch's mean loss
    by its share of samples makes the sum equal the full batch's mean loss, as one device computes
    it, whenever the loss is a mean over samples that each count alike (the same number of tokens in
    each). For a loss averaged over a varying number of tokens per micro-batch (padding, ignored
    labels) the engine weights by the targets instead where it can count them (``targets``).
    """
    size = batch_size(batch)
    if size == 0:
        raise PipelineConfigError("a pipelined batch must hold at least one sample along dim 0, got an empty batch")
    parts = min(size, micro_batches)
    sizes = [len(chunk) for chunk in torch.tensor_split(torch.arange(size), parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    bounds = [(a, a + n) for a, n in zip(starts, sizes)]
    return _split(batch, bounds, size), [n / size for n in sizes]


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


def merge_outputs(values: list[Any], sizes: list[int]) -> Any:
    """What a step would return for the whole batch, from its returns for micro-batches of ``sizes``.

    Tensors with a row per sample are concatenated along dim 0 (predictions, logits); scalar tensors
    and numbers are averaged with the micro-batches' shares of the samples (a mean loss); dicts,
    tuples and lists of the same structure merge entry by entry; anything else is kept when every
    micro-batch returned the same, and otherwise stays a list with one entry per micro-batch.
    """
    if len(values) == 1:
        return values[0]
    first = values[0]
    total = sum(sizes)
    if all(isinstance(v, torch.Tensor) for v in values):
        if all(v.dim() > 0 and v.shape[0] == n for v, n in zip(values, sizes)):
            return torch.cat(values, dim=0)
        if all(v.dim() == 0 for v in values) and all(v.is_floating_point() for v in values):
            return sum(v * (n / total) for v, n in zip(values, sizes))
        return list(values)
    if all(isinstance(v, float) for v in values):
        return sum(v * n for v, n in zip(values, sizes)) / total
    if isinstance(first, dict) and all(isinstance(v, dict) and v.keys() == first.keys() for v in values):
        return type(first)({k: merge_outputs([v[k] for v in values], sizes) for k in first})
    if (isinstance(first, (tuple, list)) and not hasattr(first, "_fields")
            and all(type(v) is type(first) and len(v) == len(first) for v in values)):
        return type(first)(merge_outputs([v[i] for v in values], sizes) for i in range(len(first)))
    if all(v is first or (not isinstance(v, torch.Tensor) and _equal(v, first)) for v in values):
        return first
    return list(values)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a plain equality
        return False
