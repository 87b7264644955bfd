"""The model tensors of a checkpoint of any layout, read one at a time (for ``lp-export``).

A DCP directory (``dcp.py``) is read chunk by chunk: each tensor is assembled whole from the stored
chunks that hold it, whatever layout wrote them. A directory in the format before DCP and a plain
``.ckpt`` file are memory-mapped, so only the bytes of the tensor asked for are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_parallel.checkpoint import dcp
from lightning_parallel.checkpoint.format import full_tensor
from lightning_parallel.checkpoint.io import (
    META_FILE,
    checkpoint_to_read,
    read_checkpoint,
)

Spec = tuple[tuple[int, ...], torch.dtype]


class CheckpointTensors:
    """``specs``: name -> (global shape, dtype) of every model tensor; ``extra``: the rest of what
    Lightning saved (hyper-parameters, loops, the Hugging Face record); ``read(name)``: one tensor whole.

    Raises ``IncompleteCheckpointError`` for a directory whose save did not finish and
    ``FileNotFoundError`` when nothing is at ``path``.
    """

    def __init__(self, path: Path):
        self.path = checkpoint_to_read(Path(path))
        self.is_dcp = dcp.is_dcp_checkpoint(self.path)
        if self.is_dcp:
            self.extra: dict[str, Any] = torch.load(self.path / META_FILE, map_location="cpu")
            self._metadata = dcp.read_metadata(self.path)
            self.specs: dict[str, Spec] = {
                name: (shape, self._stored(name).properties.dtype)
                for name, shape in dcp.tensor_shapes(self._metadata).items()
            }
        else:
            self.extra, self._pieces = read_checkpoint(self.path, mmap=True)
            self.specs = {name: (shape, next(p.tensors[name].dtype for p in self._pieces if name in p.tensors))
                          for p in self._pieces for name, (shape, _) in p.layouts.items()}

    def _stored(self, name: str) -> TensorStorageMetadata:
        stored = self._metadata.state_dict_metadata[name]
        assert isinstance(stored, TensorStorageMetadata), name
        return stored

    def read(self, name: str) -> torch.Tensor:
        if not self.is_dcp:
            return full_tensor(name, self._pieces)
        target = dcp.local_target(self._metadata, name, None, 0, 1)
        dcp.read_chunks(self.path, self._metadata, {name: target}, [])
        return target[0]
