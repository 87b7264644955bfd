"""Checkpoint tensors in PyTorch Distributed Checkpoint (DCP) format: parallel writes, partial reads.

Layout of the tensors of a checkpoint directory (``torch.distributed.checkpoint``'s file system
format, readable by its own tools such as ``format_utils.dcp_to_torch_save``):

- every model tensor under its name in the unsplit model and its global shape;
- optimizer ``i``'s state of parameter ``name`` as ``optimizer.<i>.state.<name>.<key>`` (Adam's
  ``exp_avg``, ``exp_avg_sq``: the parameter's global shape; ``step``: a scalar), by the
  parameter's first name in the unsplit model (a weight tied across stages has one entry); under
  ZeRO-1 each data-parallel rank writes, and reads back, only its own slice of those states
  (``chunks.slice_chunks``), so no rank gathers another's; under ZeRO-2/3 likewise its rows of the
  parameters themselves and of their states (DTensors: ``data_parallel.fully_sharded.local_slice``);
- the module-shaped state dicts a checkpoint holds besides ``state_dict`` (with Lightning's weight
  averaging: the module's weights beside their average, SWA's average; ``module_states.py``) as
  ``module_state.<k>.<name>``, split like the model, ``k`` their position in the list ``meta.pt`` keeps;
- ``lightning_parallel.pp<p>-tp<t>``: what pipeline rank p and TP rank t list of their parameters
  (their place in the unsplit model's order, optimizer groups), used by ``lp-consolidate``.

**Writing.** Every rank describes what it holds as chunks of global tensors (``chunks.py``) and
writes its own ``__<rank>_0.distcp`` in parallel; DCP's planning writes each chunk once (data-
parallel replicas and other holders of the same chunk split the writes) and rank 0 writes the one
``.metadata`` file, the index of every chunk: its box, file, offset and length.

**Reading.** A rank reads ``.metadata``, works out the chunks it needs on its own layout, and reads
only the stored chunks that intersect them. Data-parallel replicas need the same chunks, so each
reads a different part (whole stored chunks, balanced by bytes) and they exchange what they read
over the data-parallel group: the group reads every needed byte once. No name leaves its rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor

from lightning_parallel.checkpoint.chunks import Chunk, slice_chunks, tp_chunks
from lightning_parallel.checkpoint.format import Layout, local_shape
from lightning_parallel.checkpoint.planner import (
    ChunkedTensors,
    ChunkLoadPlanner,
    ChunkSavePlanner,
    destination,
    read_items,
)
from lightning_parallel.data_parallel.fully_sharded import local_slice

METADATA = ".metadata"
OPTIMIZER_PREFIX, PIECE_PREFIX = "optimizer.", "lightning_parallel."
MODULE_STATE_PREFIX = "module_state."
_PREFIXES = (OPTIMIZER_PREFIX, PIECE_PREFIX, MODULE_STATE_PREFIX)


def is_dcp_checkpoint(path: Path) -> bool:
    return (path / METADATA).is_file()


def optimizer_key(index: int, name: str, key: str) -> str:
    return f"{OPTIMIZER_PREFIX}{index}.state.{name}.{key}"


def module_state_prefix(index: int) -> str:
    """The prefix of the tensors of the ``index``-th module-shaped state dict besides ``state_dict``."""
    return f"{MODULE_STATE_PREFIX}{index}."


def piece_key(pp_rank: int, tp_rank: int) -> str:
    return f"{PIECE_PREFIX}pp{pp_rank:03d}-tp{tp_rank:03d}"


# ---- what a rank writes ------------------------------------------------------------------------
def chunked_state(tensors: dict[str, torch.Tensor], layouts: dict[str, Layout],
                  optimizers: list[dict[str, Any]], param_layouts: dict[str, Layout],
                  tp_rank: int, tp_size: int, slices: dict[str, tuple[int, int]]
                  ) -> tuple[ChunkedTensors, dict[str, Any]]:
    """This rank's model tensors and optimizer states (by name: ``format.name_optimizer_state``) as
    chunks of global tensors, and the non-tensor optimizer state as objects, under their DCP keys.

    An optimizer state shaped like the parameter's local shard is split like the parameter; under
    ZeRO-1, parameter ``name`` in ``slices`` (begin, length) has its state as that range of the
    flattened local shard (``chunks.slice_chunks``); a DTensor (ZeRO-2/3: a parameter or state sharded
    over the data-parallel replicas) is its local rows, such a range too; any other tensor (``step``)
    is whole on every rank that holds it.
    """
    chunked: ChunkedTensors = {}
    for name, tensor in tensors.items():
        shape, shard = layouts[name]
        chunked[name] = _rows(tensor, shape, shard, tp_rank, tp_size) if isinstance(tensor, DTensor) else (
            tensor, shape, tp_chunks(shape, shard, tp_rank, tp_size))
    objects: dict[str, Any] = {}
    for index, named in enumerate(optimizers):
        for name, state in named["state"].items():
            shape, shard = param_layouts[name]
            for key, value in state.items():
                fqn = optimizer_key(index, name, key)
                if not isinstance(value, torch.Tensor):
                    objects[fqn] = value
                elif isinstance(value, DTensor):
                    chunked[fqn] = _rows(value, shape, shard, tp_rank, tp_size)
                elif name in slices and tuple(value.shape) == (slices[name][1],):
                    chunked[fqn] = (value, shape, slice_chunks(shape, shard, tp_rank, tp_size, *slices[name]))
                elif shard is not None and tuple(value.shape) == local_shape(shape, shard, tp_size):
                    chunked[fqn] = (value, shape, tp_chunks(shape, shard, tp_rank, tp_size))
                else:
                    chunked[fqn] = (value, tuple(value.shape), tp_chunks(tuple(value.shape), None, 0, 1))
    return chunked, objects


def _rows(tensor: DTensor, shape: tuple[int, ...], shard: Any, tp_rank: int, tp_size: int
          ) -> tuple[torch.Tensor, tuple[int, ...], list[Chunk]]:
    """The local rows of a DTensor sharded over the data-parallel replicas, as chunks of the global tensor."""
    return tensor.to_local(), shape, slice_chunks(shape, shard, tp_rank, tp_size, *local_slice(tensor))


def save_chunks(folder: Path, tensors: ChunkedTensors, objects: dict[str, Any],
                group: Optional[dist.ProcessGroup] = None) -> list[str]:
    """Write this rank's chunks into ``folder`` with DCP; return the files this rank wrote.

    A collective over ``group``, which spans every process (the default group when None): every
    rank writes ``__<rank>_0.distcp``, rank 0 also ``.metadata``. If this rank failed it raises its
    own error; a failure elsewhere is reported by its rank.
    """
    writer = FileSystemWriter(folder, single_file_per_rank=True, sync_files=True, thread_count=1)
    try:
        dcp.save({}, storage_writer=writer, planner=ChunkSavePlanner(tensors, objects), process_group=group)
    except CheckpointException as err:  # raised on every rank when any rank failed
        mine = err.failures.get(dist.get_rank())
        if mine is not None:
            raise mine[0] from None
    rank = dist.get_rank()
    written = sorted(p.name for p in folder.glob(f"__{rank}_*.distcp"))
    return written + ([METADATA] if rank == 0 and (folder / METADATA).is_file() else [])


# ---- what a rank reads -------------------------------------------------------------------------
def read_metadata(folder: Path) -> Metadata:
    return FileSystemReader(folder).read_metadata()


def tensor_shapes(metadata: Metadata, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Global shape of every model tensor in the checkpoint, by name; with ``prefix``
    (``module_state_prefix``), of every tensor of the state dict saved under it."""
    def under(fqn: str) -> bool:
        return fqn.startswith(prefix) if prefix else not fqn.startswith(_PREFIXES)

    return {fqn[len(prefix):]: tuple(md.size) for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) and under(fqn)}


def incomplete_tensors(metadata: Metadata, names: list[str]) -> list[str]:
    """Those of ``names`` whose saved chunks do not cover the whole tensor (DCP checks they do not overlap)."""
    def covered(md: TensorStorageMetadata) -> bool:
        return sum(torch.Size(c.sizes).numel() for c in md.chunks) == torch.Size(md.size).numel()

    return [f"{n}: the checkpoint lacks parts of it" for n in names
            if not covered(metadata.state_dict_metadata[n])]  # type: ignore[arg-type]


def optimizer_entries(metadata: Metadata) -> dict[tuple[int, str], dict[str, str]]:
    """``(optimizer index, parameter name) -> {state key: DCP key}``."""
    entries: dict[tuple[int, str], dict[str, str]] = {}
    for fqn in metadata.state_dict_metadata:
        if fqn.startswith(OPTIMIZER_PREFIX):
            index, rest = fqn[len(OPTIMIZER_PREFIX):].split(".state.", 1)
            name, key = rest.rsplit(".", 1)
            entries.setdefault((int(index), name), {})[key] = fqn
    return entries


def local_target(metadata: Metadata, fqn: str, layout: Optional[Layout], tp_rank: int,
                 tp_size: int) -> tuple[torch.Tensor, tuple[int, ...], list[Chunk]]:
    """An empty local tensor for ``fqn`` cut by ``layout`` (global shape, TP shard), or whole when the
    saved tensor has another shape (``step``) or ``layout`` is None; padding rows stay zero."""
    md = metadata.state_dict_metadata[fqn]
    assert isinstance(md, TensorStorageMetadata), fqn
    shape, shard = layout if layout is not None and tuple(layout[0]) == tuple(md.size) else (tuple(md.size), None)
    local = torch.zeros(local_shape(shape, shard, tp_size), dtype=md.properties.dtype)
    return local, shape, tp_chunks(shape, shard, tp_rank, tp_size)


def slice_target(metadata: Metadata, fqn: str, layout: Layout, tp_rank: int, tp_size: int,
                 begin: int, length: int) -> tuple[torch.Tensor, tuple[int, ...], list[Chunk]]:
    """An empty ZeRO-1 slice ``[begin, begin + length)`` of the flattened local shard for ``fqn``, a
    state of the parameter of ``layout``; padding rows stay zero."""
    md = metadata.state_dict_metadata[fqn]
    assert isinstance(md, TensorStorageMetadata) and tuple(md.size) == tuple(layout[0]), fqn
    shape, shard = layout
    return (torch.zeros(length, dtype=md.properties.dtype), shape,
            slice_chunks(shape, shard, tp_rank, tp_size, begin, length))


def read_chunks(folder: Path, metadata: Metadata, targets: ChunkedTensors, objects: list[str],
                dp_group: Optional[dist.ProcessGroup] = None, device: torch.device = torch.device("cpu")
                ) -> dict[str, Any]:
    """Fill every chunk of ``targets`` from ``folder`` and return the ``objects`` by key.

    With ``dp_group`` (whose ranks ask for the same targets and objects) each replica reads its
    share of the stored chunks (``assign_reads``) and broadcasts it to the others (collective over
    ``dp_group``).
    """
    items = read_items(metadata, targets, objects)
    replicas = dist.get_world_size(dp_group) if dp_group is not None else 1
    me = dist.get_rank(dp_group) if dp_group is not None else 0
    owners = assign_reads(items, metadata, replicas)
    planner = ChunkLoadPlanner(targets, [item for item, owner in zip(items, owners) if owner == me])
    reader = FileSystemReader(folder)
    reader.set_up_storage_reader(metadata, False)
    reader.read_data(planner.create_local_plan(), planner).wait()
    values = dict(planner.objects)
    for src in range(replicas if replicas > 1 else 0):
        theirs = [item for item, owner in zip(items, owners) if owner == src]
        _broadcast_tensors(targets, [i for i in theirs if i.type == LoadItemType.TENSOR], src == me,
                           dist.get_global_rank(dp_group, src), dp_group, device)
        keys = [i.dest_index.fqn for i in theirs if i.type == LoadItemType.BYTE_IO]
        if keys:
            sent = [[values[k] for k in keys] if src == me else None]
            dist.broadcast_object_list(sent, src=dist.get_global_rank(dp_group, src), group=dp_group, device=device)
            values.update(zip(keys, sent[0]))
    return values


def assign_reads(items: list[ReadItem], metadata: Metadata, replicas: int) -> list[int]:
    """Which replica reads each item: a stored chunk is read whole, so all items of one stored chunk
    go to one replica; stored chunks are dealt largest first to the replica with the fewest bytes."""
    length = {item.storage_index: metadata.storage_data[item.storage_index].length for item in items}
    load, owner = [0] * replicas, {}
    for index in sorted(length, key=lambda i: -length[i]):  # stable: ties keep the items' order
        owner[index] = min(range(replicas), key=lambda r: load[r])
        load[owner[index]] += length[index]
    return [owner[item.storage_index] for item in items]


def _broadcast_tensors(targets: ChunkedTensors, items: list[ReadItem], is_src: bool, src: int,
                       group: dist.ProcessGroup, device: torch.device) -> None:
    """Hand the regions ``items`` filled on ``src`` to the other replicas, as one byte buffer."""
    views = [destination(targets, item) for item in items]
    sizes = [v.numel() * v.element_size() for v in views]
    if not sum(sizes):
        return
    if is_src:
        buffer = torch.cat([v.contiguous().view(-1).view(torch.uint8) for v in views]).to(device)
    else:
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    if is_src:
        return
    buffer, offset = buffer.cpu(), 0
    for view, size in zip(views, sizes):
        view.copy_(buffer[offset:offset + size].clone().view(view.dtype).view(view.shape))
        offset += size
