"""Lightning's model summary counting the whole model, not the shard or stage one rank holds.

Lightning's ``ModelSummary`` callback counts ``pl_module.parameters()`` on rank 0 once fitting
starts, which under tensor or pipeline parallelism is rank 0's TP shard of its own stage. Lightning
offers a strategy no hook for it (DeepSpeed's ZeRO-3 summary is chosen by an ``isinstance`` in the
callback), so the strategy counts every module's parameters before it splits the model and hands
the callbacks a summary that reports those counts: the table and the totals read as on one device.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn

from lightning_parallel.compat import replace_summary


def parameters_per_module(module: nn.Module) -> dict[str, tuple[int, int]]:
    """``name -> (parameters, trainable parameters)`` of every submodule (``""`` is the whole model),
    each shared parameter counted once per module; works on the meta device."""
    counts = {}
    for name, sub in module.named_modules():
        params = list(sub.parameters())
        counts[name] = (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))
    return counts


class WholeModelSummary(ModelSummary):
    """A ``ModelSummary`` whose parameter counts are those recorded before the split."""

    def __init__(self, model: Any, counts: dict[str, tuple[int, int]], max_depth: int = 1) -> None:
        self._counts = counts
        super().__init__(model, max_depth=max_depth)

    @property
    def param_nums(self) -> list[int]:
        return [self._counts.get(name, (layer.num_parameters, 0))[0] for name, layer in self._layer_summary.items()]

    @property
    def total_parameters(self) -> int:
        return self._counts[""][0]

    @property
    def trainable_parameters(self) -> int:
        return self._counts[""][1]


def report_whole_model(callbacks: list, counts: dict[str, tuple[int, int]]) -> None:
    """Make every model-summary callback among ``callbacks`` (``ModelSummary``, ``RichModelSummary``)
    summarise with ``counts``."""
    from lightning.pytorch.callbacks import ModelSummary as SummaryCallback

    for callback in callbacks:
        if isinstance(callback, SummaryCallback):
            replace_summary(callback, lambda pl_module, depth: WholeModelSummary(pl_module, counts, max_depth=depth))
