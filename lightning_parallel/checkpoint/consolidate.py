"""A sharded checkpoint directory -> one plain Lightning checkpoint file (the command: ``cli/consolidate.py``).

The output is what a single-device run would have saved: full tensors under the model's own
names and optimizer states in ``configure_optimizers`` order, so the unchanged module loads it
with ``MyModule.load_from_checkpoint(path)`` or resumes with ``Trainer(...).fit(ckpt_path=path)``.
Each parameter group also records its ``param_names`` (torch's convention), which lets the same
file resume on any parallel layout again: ``ParallelStrategy`` reads plain files and shard
directories alike.

    lp-consolidate checkpoints/epoch=0-step=100.ckpt model.ckpt
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_parallel.checkpoint import dcp
from lightning_parallel.checkpoint.atomic import MARKER
from lightning_parallel.checkpoint.format import (
    Piece,
    full_optimizer_state,
    full_tensor,
    index_optimizer_state,
    unsplit_group_names,
)
from lightning_parallel.checkpoint.io import (
    META_FILE,
    checkpoint_to_read,
    is_sharded_checkpoint,
    read_checkpoint,
)
from lightning_parallel.checkpoint.module_states import replaced


def consolidate(path: Path, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The plain Lightning checkpoint equivalent to the sharded checkpoint at ``path``.

    Raises ``IncompleteCheckpointError`` for a directory whose save did not finish, and
    ``ValueError`` for anything else that is not a sharded checkpoint directory. ``weights_only``
    is ``torch.load``'s, for Lightning's part of the checkpoint (loops, hyper-parameters).
    """
    if path.is_file():
        raise ValueError(f"{path} is a plain checkpoint file, already consolidated: load it as it is, e.g. "
                         f"MyModule.load_from_checkpoint({str(path)!r}) or Trainer(...).fit(ckpt_path={str(path)!r})")
    path = checkpoint_to_read(path, weights_only)
    if not is_sharded_checkpoint(path):
        found = "does not exist" if not path.exists() else f"is a directory without {META_FILE}"
        raise ValueError(f"{path} {found}: give a sharded checkpoint directory, as ModelCheckpoint or "
                         "Trainer.save_checkpoint write them with a split model")
    if dcp.is_dcp_checkpoint(path):
        return _consolidate_dcp(path, weights_only)
    meta, pieces = read_checkpoint(path, weights_only)
    names = list(dict.fromkeys(n for p in pieces for n in p.tensors))
    checkpoint = {k: v for k, v in meta.items() if k != "lightning_parallel"}
    checkpoint["state_dict"] = {n: full_tensor(n, pieces).clone() for n in names}
    if all(p.optimizers for p in pieces):
        layouts = {n: layout for p in pieces for n, layout in p.layouts.items()}
        checkpoint["optimizer_states"] = []
        for i, named in enumerate(pieces[0].optimizers):
            group_names = unsplit_group_names(pieces, i)
            state = {n: full_optimizer_state(n, i, pieces, layouts[n]) for group in group_names for n in group}
            plain = index_optimizer_state(named, state, group_names)
            for group, group_params in zip(plain["param_groups"], group_names, strict=True):
                group["param_names"] = group_params
            checkpoint["optimizer_states"].append(plain)
    return checkpoint


def _consolidate_dcp(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """``consolidate`` for a checkpoint in DCP format: every tensor read whole, in one process."""
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)
    metadata = dcp.read_metadata(path)
    targets = {fqn: dcp.local_target(metadata, fqn, None, 0, 1) for fqn, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata)}
    objects = [fqn for fqn in metadata.state_dict_metadata if fqn not in targets]
    objects_read = dcp.read_chunks(path, metadata, targets, objects)
    values = {**{fqn: local for fqn, (local, _, _) in targets.items()}, **objects_read}
    checkpoint = {k: v for k, v in meta.items() if k != "lightning_parallel"}
    checkpoint["state_dict"] = {n: values[n] for n in dcp.tensor_shapes(metadata)}
    for k, place in enumerate(meta["lightning_parallel"].get("module_states", [])):  # weight averaging's
        prefix = dcp.module_state_prefix(k)
        checkpoint = replaced(checkpoint, place, {n: values[prefix + n] for n in dcp.tensor_shapes(metadata, prefix)})
    saved_optimizers = meta["lightning_parallel"]["optimizers"]
    if not saved_optimizers:
        return checkpoint
    # what each (stage, TP rank) listed: the place of its parameters in the unsplit model, its groups
    pieces = [Piece(0, 1, {}, {}, [{"param_groups": [{"params": g} for g in groups]} for groups in info["groups"]],
                    info["order"])
              for fqn, info in values.items() if fqn.startswith(dcp.PIECE_PREFIX)]
    entries = dcp.optimizer_entries(metadata)
    checkpoint["optimizer_states"] = []
    for i, saved in enumerate(saved_optimizers):
        group_names = unsplit_group_names(pieces, i)
        state = {n: {key: values[fqn] for key, fqn in entries.get((i, n), {}).items()} for g in group_names for n in g}
        plain = index_optimizer_state(saved, state, group_names)
        for group, group_params in zip(plain["param_groups"], group_names, strict=True):
            group["param_names"] = group_params
        checkpoint["optimizer_states"].append(plain)
    return checkpoint


def load_directory(path: Path, map_location: Any = None, weights_only: Optional[bool] = None) -> Optional[dict]:
    """A sharded checkpoint directory written by ``ParallelStrategy``, consolidated, as Lightning's own
    reader returns a ``.ckpt`` file (``lightning_hooks.read_checkpoint_directories`` makes Lightning call this);
    None for any other directory. Tensors are on the CPU, or on ``map_location`` when it names a device.
    """
    if not (path / MARKER).is_file() and not any(path.glob("pp*-tp*.pt")):
        return None  # not ours (Lightning's FSDP writes directories too): Lightning reads it as before
    checkpoint = consolidate(path, weights_only)
    if isinstance(map_location, (str, torch.device)):
        checkpoint = move_data_to_device(checkpoint, map_location)
    return checkpoint

