"""What a sharded checkpoint holds and how a tensor moves from one layout to another (pure logic).

Checkpoints are written in DCP format (``dcp.py``); this module reads the two formats that came
before it and checks names and shapes for all of them. In the older format (``pp*-tp*.pt`` files)
a checkpoint is a set of *pieces*. A piece is what one (pipeline rank, TP rank) pair holds: its
tensors under their GLOBAL names (the names of the unsplit model), each with a layout (global
shape, and the ``TPShard`` it was cut with or None when replicated), and its optimizer states
keyed by parameter name. A plain Lightning checkpoint is a single piece of full tensors. Loading
on another layout rebuilds each full tensor from the pieces that hold it (``merge_shards`` over
the old TP ranks) and cuts the new local shard (``slice_shard``), so any layout reads any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from lightning_parallel.errors import CheckpointError
from lightning_parallel.tensor_parallel.shard import (
    TPShard,
    merge_shards,
    padded_size,
    slice_shard,
)

FORMAT_VERSION = 2  # 1: a ``pp*-tp*.pt`` file per piece; 2: DCP (``dcp.py``)
Layout = tuple[tuple[int, ...], Optional[TPShard]]


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the model: a parameter is missing, unexpected, or of another shape."""


@dataclass
class Piece:
    """The tensors and optimizer states one (pipeline rank, TP rank) pair saved.

    optimizers: per optimizer, ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``,
        where a parameter tied across pipeline stages goes by its first name in the unsplit model.
    order: ``name -> (stage, position)``, the parameter's place in the unsplit model's order.
    """

    tp_rank: int
    tp_size: int
    tensors: dict[str, torch.Tensor]
    layouts: dict[str, Layout]
    optimizers: list[dict[str, Any]] = field(default_factory=list)
    order: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ExpertRows:
    """The layout of an expert parameter under expert parallelism: this rank holds experts ``first`` to
    ``first + count - 1`` of ``total`` along dimension 0 (``expert_parallel.ExpertShard``), each of them
    whole or, with ``tp``, split further as a TP shard. Saved under the unsplit name and shape, indexed by
    global expert id, so any expert-parallel size reads any other."""

    first: int
    count: int
    total: int
    tp: Optional[TPShard] = None


def layout_of(param: Any) -> Union[TPShard, ExpertRows, None]:
    """How ``param`` is split: its TP shard, and its experts' rows under expert parallelism."""
    tp, experts = getattr(param, "tp_shard", None), getattr(param, "expert_shard", None)
    return tp if experts is None else ExpertRows(experts.first, experts.count, experts.total, tp)


def _expert_rows(shape: Any, count: int) -> tuple[int, ...]:
    return (count, *tuple(shape)[1:])


def global_shape(local: torch.Size, shard: Optional[TPShard], tp_size: int) -> tuple[int, ...]:
    """Shape of the unsplit tensor whose TP shard has shape ``local``."""
    if isinstance(shard, ExpertRows):
        return _expert_rows(global_shape(local, shard.tp, tp_size), shard.total)
    shape = list(local)
    if shard is not None:
        dim = shard.dim % len(shape)
        shape[dim] = shard.full_size if shard.full_size is not None else shape[dim] * shard.parts(tp_size)
    return tuple(shape)


def decode_layout(encoded: tuple) -> Layout:
    """A layout as a piece file of the format before DCP stores it: plain tuples."""
    shape, shard = encoded
    return (tuple(shape), None if shard is None else TPShard(*shard))


# ---- checks, before anything is loaded --------------------------------------------------------
def mismatches(expected: dict[str, tuple[int, ...]], pieces: list[Piece], strict: bool) -> list[str]:
    """Why the local tensors ``expected`` (name -> global shape) cannot load from ``pieces``.

    A missing name is only a problem when ``strict``; a shape mismatch always is.
    """
    saved = saved_shapes(pieces)
    problems = shape_mismatches(expected, saved, strict)
    for name in expected:
        missing = _missing_tp_ranks(name, pieces) if name in saved else []
        if missing:
            problems.append(f"{name}: the checkpoint lacks the shards of TP ranks {missing}")
    return problems


def shape_mismatches(expected: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]],
                     strict: bool) -> list[str]:
    """Why the local tensors ``expected`` cannot load from tensors of the global shapes ``saved``."""
    problems = []
    for name, shape in expected.items():
        if name not in saved:
            if strict:
                problems.append(f"{name}: in the model (shape {list(shape)}) but not in the checkpoint")
        elif tuple(saved[name]) != tuple(shape):
            problems.append(f"{name}: shape {list(shape)} in the model but {list(saved[name])} in the checkpoint")
    return problems


def unexpected(saved: dict[str, tuple[int, ...]], held_anywhere: set[str]) -> list[str]:
    """Checkpoint entries that no rank of the current layout holds."""
    return [f"{name}: in the checkpoint (shape {list(shape)}) but not in the model" for name, shape in saved.items()
            if name not in held_anywhere]


def saved_shapes(pieces: list[Piece]) -> dict[str, tuple[int, ...]]:
    return {name: shape for p in pieces for name, (shape, _) in p.layouts.items()}


def _missing_tp_ranks(name: str, pieces: list[Piece]) -> list[int]:
    holders = [p for p in pieces if name in p.tensors]
    shard = holders[0].layouts[name][1]
    if shard is None:
        return []
    have = {p.tp_rank for p in holders}
    return [r for r in range(holders[0].tp_size) if r not in have]


# ---- resharding -------------------------------------------------------------------------------
def _holders(name: str, pieces: list[Piece]) -> list[Piece]:
    """One piece per saved TP rank holding ``name``, in rank order. Copies held by several pipeline
    stages (tied weights, root parameters) are identical: their gradients are summed across stages."""
    first: dict[int, Piece] = {}
    for p in pieces:
        if name in p.tensors:
            first.setdefault(p.tp_rank, p)
    return [first[r] for r in sorted(first)]


def full_tensor(name: str, pieces: list[Piece]) -> torch.Tensor:
    """The unsplit tensor ``name``, rebuilt from the pieces that hold it."""
    holders = _holders(name, pieces)
    shard = holders[0].layouts[name][1]
    if shard is None:
        return holders[0].tensors[name]
    return merge_shards([p.tensors[name] for p in holders], shard)


def local_tensor(full: torch.Tensor, shard: Optional[TPShard], tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of ``full`` under its current layout (a copy)."""
    if isinstance(shard, ExpertRows):
        return local_tensor(full.narrow(0, shard.first, shard.count), shard.tp, tp_rank, tp_size)
    return slice_shard(full, shard, tp_rank, tp_size) if shard is not None else full.clone()


def local_shape(shape: tuple[int, ...], shard: Optional[TPShard], tp_size: int) -> tuple[int, ...]:
    """Shape of one TP shard of a tensor of global ``shape`` (the inverse of ``global_shape``)."""
    if isinstance(shard, ExpertRows):
        return local_shape(_expert_rows(shape, shard.count), shard.tp, tp_size)
    if shard is None:
        return tuple(shape)
    local = list(shape)
    dim = shard.dim % len(local)
    tp_size = shard.parts(tp_size)
    local[dim] = padded_size(local[dim], tp_size) // tp_size if shard.full_size is not None else local[dim] // tp_size
    return tuple(local)


def full_optimizer_state(name: str, index: int, pieces: list[Piece], layout: Layout) -> dict[str, Any]:
    """Optimizer ``index``'s state of parameter ``name`` (global ``layout``), every param-shaped entry unsplit.

    An entry shaped like the saved shard (Adam's ``exp_avg``, ``exp_avg_sq``) is sharded like the
    parameter; anything else (``step``) is replicated.
    """
    shape, shard = layout
    by_rank: dict[int, dict[str, Any]] = {}
    for p in pieces:
        state = p.optimizers[index]["state"].get(name) if index < len(p.optimizers) else None
        if state:
            by_rank.setdefault(p.tp_rank, state)
    if not by_rank:
        return {}
    states = [by_rank[r] for r in sorted(by_rank)]
    tp_size = next(p.tp_size for p in pieces)
    saved_local = local_shape(shape, shard, tp_size)
    full = {}
    for key, value in states[0].items():
        if shard is not None and isinstance(value, torch.Tensor) and tuple(value.shape) == saved_local:
            full[key] = merge_shards([s[key] for s in states], shard)
        else:
            full[key] = value
    return full


def local_optimizer_state(full: dict[str, Any], shape: tuple[int, ...], shard: Optional[TPShard],
                          tp_rank: int, tp_size: int) -> dict[str, Any]:
    """Cut the param-shaped entries of ``full`` (a parameter of global ``shape``) like the parameter."""
    return {
        key: local_tensor(v, shard, tp_rank, tp_size) if isinstance(v, torch.Tensor) and tuple(v.shape) == shape else v
        for key, v in full.items()
    }


# ---- optimizer state: by index (torch) <-> by name (here) --------------------------------------
def name_optimizer_state(state_dict: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """Re-key a torch optimizer ``state_dict`` by parameter name; ``names[g]`` lists group g's params."""
    groups, state = [], {}
    for group, group_names in zip(state_dict["param_groups"], names, strict=True):
        for index, name in zip(group["params"], group_names, strict=True):
            if index in state_dict["state"]:
                state[name] = state_dict["state"][index]
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": group_names})
    return {"state": state, "param_groups": groups}


def index_optimizer_state(named: dict[str, Any], state: dict[str, dict[str, Any]],
                          names: list[list[str]]) -> dict[str, Any]:
    """The torch ``state_dict`` of an optimizer whose group g holds the params ``names[g]``.

    ``named`` supplies the group hyper-parameters (learning rate, betas, ...) by group index and
    ``state`` the per-parameter state by name.
    """
    groups, indexed, index = [], {}, 0
    for saved, group_names in zip(named["param_groups"], names, strict=True):
        ids = []
        for name in group_names:
            if state.get(name):
                indexed[index] = state[name]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": indexed, "param_groups": groups}


def unsplit_group_names(pieces: list[Piece], index: int) -> list[list[str]]:
    """Optimizer ``index``'s parameter names per group in the unsplit model's order.

    Each piece lists its own parameters; merged and sorted by (stage, position) they are the order
    ``configure_optimizers`` sees on one device (a tied parameter takes its first place).
    """
    groups = len(pieces[0].optimizers[index]["param_groups"])
    result = []
    for g in range(groups):
        names: dict[str, tuple[int, int]] = {}
        for p in pieces:
            for name in p.optimizers[index]["param_groups"][g]["params"]:
                key = p.order[name]
                names[name] = min(names.get(name, key), key)
        result.append(sorted(names, key=lambda n: names[n]))
    return result
