"""DCP planners for tensors given as lists of chunks.

``torch.distributed.checkpoint`` describes a plain tensor as one chunk at offset zero and a DTensor
by its placements; neither fits our shards: a fused QKV shard is several boxes of the global
tensor, and a padded vocabulary shard holds rows that the global tensor does not have. ShardedTensor
could list several local shards, but it is deprecated and checks its metadata with a collective
over the whole world on construction. So the planners here take the boxes directly (``chunks.py``):

- ``ChunkSavePlanner`` turns each (tensor, global shape, chunks) into DCP write items. DCP's
  global planning then removes duplicates: a chunk that several ranks hold (data-parallel
  replicas, TP ranks of a replicated norm, the stages that share a tied embedding) is written
  once, by the rank with the least planned bytes so far, so the writes are spread over replicas.
- ``ChunkLoadPlanner`` executes read items that ``read_items`` computed against the saved
  chunks, copying straight into views of the local tensors.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import (
    DefaultSavePlanner,
    LoadPlan,
    LoadPlanner,
    SavePlan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from lightning_parallel.checkpoint.chunks import Chunk, chunk_view

# fqn -> (local tensor, global shape, the chunks of the global tensor it holds)
ChunkedTensors = dict[str, tuple[torch.Tensor, tuple[int, ...], list[Chunk]]]


class ChunkSavePlanner(DefaultSavePlanner):
    """Write ``tensors`` chunk by chunk under their global names, and ``objects`` as pickled bytes."""

    def __init__(self, tensors: ChunkedTensors, objects: dict[str, Any]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors, self.objects = tensors, objects

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, (local, shape, chunks) in self.tensors.items():
            properties = TensorProperties.create_from_tensor(local)
            for chunk in chunks:
                offsets = torch.Size(chunk.offsets)
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, torch.Size(chunk.sizes)), properties,
                                                torch.Size(shape)),
                ))
        items += [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self.objects[fqn], buffer)
            buffer.seek(0)
            return buffer
        local, _, chunks = self.tensors[fqn]
        chunk = next(c for c in chunks if c.offsets == tuple(write_item.index.offset))
        # a copy: torch.save of a view writes its whole storage (under ZeRO-1, a whole flat bucket)
        return chunk_view(local.detach(), chunk).to("cpu", copy=True)


def read_items(metadata: Metadata, targets: ChunkedTensors, objects: list[str]) -> list[ReadItem]:
    """The reads that fill every chunk of ``targets`` (checked against ``metadata`` already) and the
    ``objects``, in a deterministic order: the same on every rank that needs the same things."""
    items = []
    for fqn, (_, _, chunks) in targets.items():
        local = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in chunks]
        saved = metadata.state_dict_metadata[fqn]
        assert isinstance(saved, TensorStorageMetadata), fqn
        items += create_read_items_for_chunk_list(fqn, saved, local)
    for fqn in objects:
        index = MetadataIndex(fqn)
        items.append(ReadItem(LoadItemType.BYTE_IO, index, torch.Size((0,)), index, torch.Size((0,)),
                              torch.Size((0,))))
    return items


class ChunkLoadPlanner(LoadPlanner):
    """Run the given read items: tensors land in their chunk of the local target, objects in ``objects``."""

    def __init__(self, targets: ChunkedTensors, items: list[ReadItem]):
        self.targets, self.items = targets, items
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        pass  # the targets and items were given to the constructor

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self.items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return destination(self.targets, read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # ``resolve_tensor`` handed out a view of the target: the data is in place


def destination(targets: ChunkedTensors, read_item: ReadItem) -> torch.Tensor:
    """The view of a local target that ``read_item`` fills."""
    local, _, chunks = targets[read_item.dest_index.fqn]
    view = chunk_view(local, chunks[read_item.dest_index.index])
    return narrow_tensor_by_index(view, read_item.dest_offsets, read_item.lengths)
