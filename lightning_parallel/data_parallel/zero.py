"""ZeRO stage 1: optimizer state sharded over the data-parallel group.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC 2020,
arXiv 1910.02054), stage 1 (P_os). Every rank keeps the whole model but gives its optimizer only a
``1/dp`` slice of it, so optimizer state (Adam's two moments: 8 bytes per fp32 parameter) shrinks by
``dp``. Per step:

1. backward reduce-scatters each gradient bucket, so a rank receives the averaged gradient of its
   own slice only (``GradientSynchronizer(shard=True)``);
2. the user's optimizer steps on the slice: its parameters are 1-D *pieces* that share storage with
   a flat copy of the bucket's parameters;
3. an all-gather of each bucket's flat parameters hands every rank the updated model.

The pieces are views, so the update is elementwise identical to the unsharded one for elementwise
optimizers (SGD, Adam, AdamW, ...). Optimizers that use whole-tensor statistics would see slices:
torch's Adafactor and LBFGS are refused at setup; others (LAMB) are the user's to avoid.

Checkpoints hold the optimizer state of the unsharded optimizer, indexed like the optimizer that
``configure_optimizers`` built, so either kind resumes the other. A plain checkpoint file gets it
whole: ``state_dict`` gathers each parameter's slices on data-parallel rank 0. A sharded
(Distributed Checkpoint) directory gets it without a gather: ``local_state_dict`` hands each rank's
own slices, which ``checkpoint.chunks.slice_chunks`` places in the parameter's global shape, and
each rank reads back only its ``slices()``. ``load_state_dict`` takes either: whole states are cut
into this rank's slices, slices are kept.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.compat import unwrap_optimizer
from lightning_parallel.data_parallel.grad_sync import GradientSynchronizer

# optimizers whose update of a parameter depends on the whole tensor (row/column factors, line search)
_WHOLE_TENSOR_OPTIMIZERS = tuple(
    getattr(torch.optim, name) for name in ("Adafactor", "LBFGS") if hasattr(torch.optim, name)  # Adafactor: torch 2.5
)


def refuse_whole_tensor_optimizers(optimizers: list[torch.optim.Optimizer], stage: int) -> None:
    """Refuse optimizers whose update of a parameter depends on the whole tensor: under ZeRO they see a
    part of it (stage 1: 1-D slices; stages 2 and 3: rows), and would step differently from one device."""
    for optimizer in optimizers:
        optimizer = unwrap_optimizer(optimizer)
        if isinstance(optimizer, _WHOLE_TENSOR_OPTIMIZERS):
            part = "1-D slices" if stage == 1 else "row shards"
            raise ValueError(
                f"zero_stage={stage} steps {type(optimizer).__name__} on {part} of the parameters, but it computes "
                "statistics over whole tensors, so the update would differ from one device; train it with "
                "zero_stage=0, or use an elementwise optimizer such as AdamW"
            )


# optimizer -> its parameter groups as configured, before ZeRO-1 replaced them with pieces
_CONFIGURED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[list[nn.Parameter]]]" = weakref.WeakKeyDictionary()


def configured_param_groups(optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
    """The parameters of each group of ``optimizer`` as ``configure_optimizers`` gave them.

    Under ZeRO-1 the optimizer steps on pieces of them; checkpoints name its state by these.
    """
    optimizer = unwrap_optimizer(optimizer)  # a LightningOptimizer wraps it
    if optimizer in _CONFIGURED:
        return _CONFIGURED[optimizer]
    return [list(group["params"]) for group in optimizer.param_groups]


@dataclass(frozen=True)
class Piece:
    """This rank's slice of one parameter: ``param.view(-1)[begin : begin + piece.numel()]``."""

    piece: nn.Parameter
    bucket: int  # index of the parameter's gradient bucket
    index: int  # position of the parameter in its bucket
    start: int  # where the slice starts in this rank's shard of the bucket
    begin: int  # where the slice starts in the flattened parameter


class ZeroOneSharding:
    """Rewrite ``optimizers`` to step on this rank's slice of every gradient bucket of ``sync``."""

    def __init__(self, sync: GradientSynchronizer, optimizers: list[torch.optim.Optimizer]):
        if not sync.shard:
            raise ValueError("ZeRO-1 needs a GradientSynchronizer created with shard=True")
        self.sync = sync
        self.flat: list[torch.Tensor] = []
        self.pieces: list[Piece] = []
        self.original: dict[nn.Parameter, nn.Parameter] = {}
        self._of_piece: dict[nn.Parameter, Piece] = {}
        pieces_of: dict[nn.Parameter, list[nn.Parameter]] = {}
        rank = sync.rank
        with torch.no_grad():
            for b_idx, bucket in enumerate(sync.buckets):
                flat = torch.zeros(bucket.padded, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
                size = bucket.padded // sync.world
                lo, hi = rank * size, (rank + 1) * size
                for i, (p, o) in enumerate(zip(bucket.params, bucket.offsets)):
                    flat[o : o + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[o : o + p.numel()].view_as(p)
                    a, b = max(o, lo), min(o + p.numel(), hi)
                    if a < b:
                        piece = nn.Parameter(flat[a:b])  # shares storage with flat
                        for attr in ("tp_shard", "sequence_parallel"):
                            if hasattr(p, attr):
                                setattr(piece, attr, getattr(p, attr))
                        record = Piece(piece, b_idx, i, a - lo, a - o)
                        self.pieces.append(record)
                        self._of_piece[piece] = record
                        self.original[piece] = p
                        pieces_of.setdefault(p, []).append(piece)
                self.flat.append(flat)
        # the pieces as a module, for code that walks a module's parameters (sequence-parallel sync)
        self.holder = nn.Module()
        self.holder.pieces = nn.ParameterList([record.piece for record in self.pieces])
        refuse_whole_tensor_optimizers(optimizers, 1)
        for optimizer in optimizers:
            if optimizer.state:
                raise RuntimeError("ZeRO-1 must shard an optimizer before its first step")
            _CONFIGURED[optimizer] = [list(group["params"]) for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                # a parameter with no slice on this rank leaves the group; one that is not synchronised stays whole
                group["params"] = [q for p in group["params"] for q in pieces_of.get(p, [] if p in sync._where else [p])]

    def attach_grads(self) -> None:
        """Give every piece its averaged gradient slice (``None`` where no replica had a gradient).

        Reads the flags ``GradientSynchronizer.finish`` already brought to the host: no device read.
        """
        for record in self.pieces:
            bucket = self.sync.buckets[record.bucket]
            n = record.piece.numel()
            record.piece.grad = bucket.shard[record.start : record.start + n] if bucket.used[record.index] else None

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather every bucket's updated slices into the full flat parameters."""
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        size_of = lambda flat: flat.numel() // self.sync.world  # noqa: E731
        for flat in self.flat:
            n = size_of(flat)
            local = flat[self.sync.rank * n : (self.sync.rank + 1) * n].clone()
            gather(flat, local, group=self.sync.group)

    # ---- checkpoints ---------------------------------------------------------------------------
    @torch.no_grad()
    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The torch ``state_dict`` the unsharded optimizer would have (collective over the DP group).

        Complete on data-parallel rank 0, the rank that writes checkpoints: the other ranks send it
        their slices one bucket and one state entry at a time, and return the parameter groups with
        an empty state.
        """
        optimizer = unwrap_optimizer(optimizer)
        mine = {q for g in optimizer.param_groups for q in g["params"] if q in self._of_piece}
        entries = self._describe_state(optimizer, mine)
        tensors = self._gather_slices(optimizer, mine, entries)
        is_root = self.sync.rank == 0
        bucket_index = {id(bucket): b for b, bucket in enumerate(self.sync.buckets)}
        state, groups, index = {}, [], 0
        for g, params in zip(optimizer.param_groups, configured_param_groups(optimizer), strict=True):
            ids = []
            for p in params:
                where = self.sync._where.get(p)
                if where is None:  # not trainable: never sharded, the same on every rank
                    if is_root and optimizer.state.get(p):
                        state[index] = dict(optimizer.state[p])
                else:
                    at = (bucket_index[id(where[0])], where[1])
                    if is_root and at in entries:
                        state[index] = {key: tensors.get((at, key), value) for key, value in entries[at].items()}
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": ids})
        return {"state": state, "param_groups": groups}

    def slices(self) -> dict[nn.Parameter, tuple[int, int]]:
        """Every sharded parameter -> ``(begin, length)`` of this rank's slice of it (flattened);
        ``(0, 0)`` where this rank steps none of it."""
        where = {self.original[record.piece]: (record.begin, record.piece.numel()) for record in self.pieces}
        return {p: where.get(p, (0, 0)) for p in self.sync._where}

    def local_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The torch ``state_dict`` of the unsharded optimizer as far as this rank holds it, without
        communication: a sharded parameter's sliced entries are this rank's 1-D slice (``slices()``),
        and a parameter this rank steps no slice of has no state."""
        optimizer = unwrap_optimizer(optimizer)
        piece_of = {self.original[record.piece]: record.piece for record in self.pieces}
        state, groups, index = {}, [], 0
        for g, params in zip(optimizer.param_groups, configured_param_groups(optimizer), strict=True):
            ids = []
            for p in params:
                held = piece_of.get(p, p if p not in self.sync._where else None)
                if held is not None and optimizer.state.get(held):
                    state[index] = dict(optimizer.state[held])
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": ids})
        return {"state": state, "param_groups": groups}

    def _describe_state(self, optimizer: torch.optim.Optimizer, mine: set) -> dict[tuple[int, int], dict[str, Any]]:
        """Every rank's view of the state: (bucket, index in bucket) -> entry name -> ``_Slice`` for an
        entry shaped like the slices (Adam's moments), or the value itself (``step``)."""
        described: dict[tuple[int, int], dict[str, Any]] = {}
        for record in self.pieces:
            state = optimizer.state.get(record.piece) if record.piece in mine else None
            if state:
                described[(record.bucket, record.index)] = {
                    key: _Slice(v.dtype) if _is_slice(v, record.piece) else _to_cpu(v) for key, v in state.items()
                }
        everyone: list[Any] = [None] * self.sync.world
        dist.all_gather_object(everyone, described, group=self.sync.group)
        entries: dict[tuple[int, int], dict[str, Any]] = {}
        for rank_entries in everyone:
            for where, entry in rank_entries.items():
                merged = entries.setdefault(where, {})
                for key, value in entry.items():
                    merged.setdefault(key, value)
        return entries

    def _gather_slices(self, optimizer: torch.optim.Optimizer, mine: set,
                       entries: dict[tuple[int, int], dict[str, Any]]) -> dict[tuple[Any, str], torch.Tensor]:
        """``((bucket, index), entry name) -> tensor shaped like the parameter``, on DP rank 0.

        One gather per bucket and sliced entry, in the same order on every rank (``entries`` is the
        same everywhere); a rank without that entry for a slice sends zeros there.
        """
        sync, is_root = self.sync, self.sync.rank == 0
        tensors = {}
        for b, bucket in enumerate(sync.buckets):
            keys = {}  # entry name -> dtype, first seen first
            for i in range(len(bucket.params)):
                for key, value in entries.get((b, i), {}).items():
                    if isinstance(value, _Slice):
                        keys.setdefault(key, value.dtype)
            for key, dtype in keys.items():
                local = torch.zeros(bucket.padded // sync.world, dtype=dtype, device=bucket.buffer.device)
                for record in self.pieces:
                    value = optimizer.state.get(record.piece, {}).get(key) if record.piece in mine else None
                    if record.bucket == b and value is not None:
                        local[record.start : record.start + record.piece.numel()].copy_(value)
                parts = [torch.empty_like(local) for _ in range(sync.world)] if is_root else None
                dist.gather(local, parts, dst=dist.get_global_rank(sync.group, 0), group=sync.group)
                if is_root:
                    flat = torch.cat(parts)
                    for i, (p, o) in enumerate(zip(bucket.params, bucket.offsets)):
                        if key in entries.get((b, i), {}):
                            tensors[((b, i), key)] = flat[o : o + p.numel()].view_as(p).clone()
        return tensors

    def load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Load the ``state_dict`` of the unsharded optimizer: each rank keeps the slices it steps.

        An entry shaped like the parameter is cut; any other (``step``, or the slice itself, as a
        sharded checkpoint reads it: ``slices()``) is kept as it is.
        """
        optimizer = unwrap_optimizer(optimizer)
        index_of = {p: i for i, p in enumerate(p for g in configured_param_groups(optimizer) for p in g)}
        saved, state, groups, position = state_dict["state"], {}, [], 0
        for g, saved_group in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
            ids = []
            for q in g["params"]:
                record = self._of_piece.get(q)
                p = self.original[q] if record is not None else q
                entry = saved.get(index_of[p])
                if entry:
                    state[position] = entry if record is None else {
                        key: v.reshape(-1)[record.begin : record.begin + q.numel()].clone()
                        if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) else v
                        for key, v in entry.items()
                    }
                ids.append(position)
                position += 1
            groups.append({**{k: v for k, v in saved_group.items() if k not in ("params", "param_names")},
                           "params": ids})
        optimizer.load_state_dict({"state": state, "param_groups": groups})


@dataclass(frozen=True)
class _Slice:
    """Marks a state entry kept as slices on each rank, to be gathered into the parameter's shape."""

    dtype: torch.dtype


def _is_slice(value: Any, piece: nn.Parameter) -> bool:
    """A state entry shaped like the piece (Adam's moments, momentum), not a scalar such as ``step``."""
    return isinstance(value, torch.Tensor) and value.shape == piece.shape


def _to_cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value
