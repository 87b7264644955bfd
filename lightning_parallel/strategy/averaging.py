"""Weight averaging of a split model: each rank averages the shards it holds.

Lightning's ``WeightAveraging`` / ``EMAWeightAveraging`` (an ``AveragedModel``: Polyak and Juditsky 1992's
average, or its exponential moving form) and ``StochasticWeightAveraging`` (Izmailov et al., "Averaging
Weights Leads to Wider Optima and Better Generalization", UAI 2018, arXiv 1803.05407) copy the
LightningModule in their ``setup`` hook, which Lightning calls before the strategy's: the copy is of the
whole model, as built. Every later use pairs the copy's parameters and buffers with the module's by
position (``zip(copy.parameters(), module.parameters())``) and combines them element by element.

Averaging is elementwise, so the average of the whole model, split like the model, is the average of
each rank's own part. Once the model is split (TP shards, its pipeline stage, ZeRO-2/3 rows as
DTensors), the strategy gives each averaging callback a new copy of what this rank holds:
``held_copy`` mirrors the module tree with this rank's parameters and buffers, under the same names,
in the same order, shared ones shared, so position and name pair them as before. The callbacks then
run unchanged; their checkpoint entries hold this rank's part, saved and read back as the model's are.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any, Iterable

from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from torch import nn
from torch.optim.swa_utils import AveragedModel

from lightning_parallel.compat import averaging_arguments, non_persistent_buffers, set_average_model


def _mirror(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    mirror = memo[id(module)] = nn.Module()
    for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
        if id(param) not in memo:
            memo[id(param)] = nn.Parameter(param.detach(), requires_grad=param.requires_grad)
        mirror.register_parameter(name, memo[id(param)])
    skipped = non_persistent_buffers(module)
    for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
        mirror.register_buffer(name, memo.setdefault(id(buffer), buffer.detach()), persistent=name not in skipped)
    for name, child in module.named_children():
        mirror.add_module(name, _mirror(child, memo))
    return mirror


def held_copy(module: nn.Module) -> nn.Module:
    """A plain module with copies of the parameters and buffers this rank holds of ``module``, named
    and ordered as ``module``'s (``parameters()``, ``buffers()`` and ``state_dict()`` pair up)."""
    return deepcopy(_mirror(module, {}))


def average_held_parts(callbacks: Iterable[Any], module: nn.Module) -> None:
    """Give every weight-averaging callback among ``callbacks`` a fresh average of what this rank holds
    of ``module`` (called once the module is split, before anything was averaged or restored)."""
    for callback in callbacks:
        if isinstance(callback, WeightAveraging):  # EMAWeightAveraging included; copies the mirror itself
            device, use_buffers, kwargs = averaging_arguments(callback)
            device = device or module.device  # where the callback's own copy would be
            set_average_model(callback, AveragedModel(_mirror(module, {}), device=device, use_buffers=use_buffers,
                                                      **kwargs))
        elif isinstance(callback, StochasticWeightAveraging):
            set_average_model(callback, held_copy(module))
