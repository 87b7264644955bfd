"""``model.load_state_dict(whole)`` on a split model: each rank copies its slices of the whole tensors.

After the split, a parameter that tensor parallelism shards holds this rank's slice (``param.tp_shard``
says which), and one that ZeRO-2/3 shards is a DTensor over the data-parallel replicas. A state dict of
the unsplit model (``torch.load`` or ``lazy_load`` of a one-device checkpoint, what scripts such as LitGPT's fine-tuning
load after setting the model up) does not fit them: ``copy_`` refuses a tensor of the whole shape, or a
plain tensor into a DTensor. A pre-hook on the split model's ``load_state_dict`` replaces each such
entry by this rank's part of it: the TP slice (``tensor_parallel.shard.slice_shard``), then this rank's
rows as a DTensor sharded like the parameter (``data_parallel.fully_sharded.sharded_like``). Entries
that already fit (a state dict of the same split model, DTensors) are left as they are.

Under pipeline parallelism a rank holds one stage: the whole state dict's other stages' entries are
unexpected there, so load with ``strict=False`` or read a Distributed Checkpoint (``fabric.load``,
``ckpt_path=``) instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_parallel.data_parallel.fully_sharded import sharded_like
from lightning_parallel.tensor_parallel.shard import slice_shard


def this_ranks_part(value: Any, param: torch.Tensor, tp_rank: int, tp_size: int) -> Any:
    """``value`` (a whole tensor of the unsplit parameter, or one that fits ``param`` already) as
    ``param`` holds it on this rank: its TP slice, as a DTensor where ZeRO-2/3 shards ``param``."""
    if isinstance(value, DTensor) or not torch.overrides.is_tensor_like(value):
        return value
    if not isinstance(value, torch.Tensor):  # a lazily read tensor (Lightning's and LitGPT's ``lazy_load``)
        value = _loaded(value)
    shard = getattr(param, "tp_shard", None)
    if shard is not None and tp_size > 1 and value.shape != param.shape:
        value = slice_shard(value, shard, tp_rank, tp_size)
    if isinstance(param, DTensor) and value.shape == param.shape:
        value = sharded_like(value.to(param.dtype), param)
    return value


def _loaded(lazy: Any) -> torch.Tensor:
    """The tensor a tensor-like stands for (it loads on its first torch call): a view of the whole, no copy."""
    return torch.narrow(lazy, 0, 0, lazy.shape[0]) if len(lazy.shape) else torch.clone(lazy)


def accept_whole_state_dicts(module: nn.Module, tp_rank: int, tp_size: int) -> None:
    """Let ``module.load_state_dict`` take a whole (unsplit) state dict on this rank (module docstring)."""

    def slice_entries(model: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        for name, param in model.named_parameters(remove_duplicate=False):
            key = prefix + name
            if key in state_dict:
                state_dict[key] = this_ranks_part(state_dict[key], param, tp_rank, tp_size)

    module.register_load_state_dict_pre_hook(slice_entries)
