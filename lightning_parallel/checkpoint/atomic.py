"""Replace a checkpoint directory so that a crash at any moment leaves a loadable checkpoint.

A directory written by several ranks cannot be replaced by one ``rename`` the way a single file
can, so a save runs as a small commit protocol (every rank calls ``save_pieces``):

1. rank 0 makes an empty staging directory ``<parent>/.lp-staging/<name>.partial`` (on the same
   file system as the checkpoint, so the renames below are atomic);
2. every rank writes its pieces there, each file flushed and ``fsync``-ed;
3. one ``all_gather_object`` tells every rank whether every other rank succeeded and what it
   wrote; if any rank failed, every rank raises ``CheckpointSaveError`` and nothing is replaced;
4. rank 0 writes the completion marker ``complete.json`` last, listing every piece and its size;
5. rank 0 renames the old checkpoint aside (``<name>.replaced``), the new one to ``<name>``, and
   only then removes the old one. POSIX cannot rename a directory over a non-empty one, so there is
   a moment with ``<name>`` missing; a reader then takes the complete ``<name>.replaced``.

The staging folder is a hidden sub-folder rather than siblings named after the checkpoint because
Lightning picks checkpoints by name: ``ckpt_path="last"`` matches ``last*.ckpt`` and SLURM
requeue resumes from the largest number in any entry whose name contains ``hpc_ckpt_``.

A directory is complete when its marker lists pieces that are all present with their sizes.
Directories written before markers existed carry no marker; ``folder_to_read`` accepts one only
when every piece its metadata implies is present. A single-file checkpoint (an unsplit model) is
written beside its final name and renamed over it (``save_file``); a removed directory first
leaves its name by one rename (``remove_checkpoint_dir``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_parallel.errors import CheckpointError

STAGING = ".lp-staging"
MARKER = "complete.json"
PARTIAL, REPLACED, REMOVED = ".partial", ".replaced", ".removed"


class CheckpointSaveError(CheckpointError, RuntimeError):
    """Some rank could not write its part of a checkpoint; the previous checkpoint is unchanged."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """A checkpoint directory lacks pieces, or its save never confirmed them (no completion marker)."""


def staged(path: Path, suffix: str) -> Path:
    """Where the save or removal of checkpoint ``path`` keeps its directory in flight."""
    return path.parent / STAGING / (path.name + suffix)


# ---- save (every rank) -------------------------------------------------------------------------
def save_pieces(path: Path, write: Callable[[Path], list[str]], finish: Callable[[Path, list[str]], list[str]],
                is_rank_zero: bool, group: Optional[dist.ProcessGroup] = None) -> None:
    """Write checkpoint directory ``path`` by the protocol above; a collective over ``group`` (every
    process; the default group when None).

    write(folder): this rank writes its pieces into ``folder`` and returns their file names.
    finish(folder, names): rank 0, once every piece is written, writes the files that list the
        pieces (the checkpoint's metadata) and returns their names.
    On failure every rank raises ``CheckpointSaveError`` naming the ranks that failed and why.
    """
    partial = staged(path, PARTIAL)
    _agree(path, _attempt(lambda: _begin(partial) if is_rank_zero else {}), is_rank_zero, group)
    written = _agree(path, _attempt(lambda: _sizes(partial, write(partial))), is_rank_zero, group)

    def commit() -> dict[str, int]:
        if is_rank_zero:
            _commit(path, {**written, **_sizes(partial, finish(partial, sorted(written)))})
        return {}

    _agree(path, _attempt(commit), is_rank_zero, group)


def write_file(obj: Any, file: Path) -> None:
    """``torch.save`` to ``file``, with its bytes on disk (``fsync``) before returning."""
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _attempt(step: Callable[[], Any]) -> tuple[Any, Optional[BaseException]]:
    try:
        return step(), None
    except Exception as err:  # noqa: BLE001 - every rank must learn of it before anyone raises
        return None, err


def _agree(path: Path, outcome: tuple[Any, Optional[BaseException]], is_rank_zero: bool,
           group: Optional[dist.ProcessGroup]) -> dict[str, int]:
    """Every rank's result merged, once every rank has finished its step; raises on all if one failed."""
    result, error = outcome
    mine = (result or {}, None if error is None else f"rank {dist.get_rank()}: {type(error).__name__}: {error}")
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    failures = [message for _, message in every if message is not None]
    if failures:
        if is_rank_zero:  # give the space back; a failure here must not hide the one being reported
            shutil.rmtree(staged(path, PARTIAL), ignore_errors=True)
            _remove_staging_if_empty(path)
        previous = f"the previous checkpoint {path} is unchanged" if path.exists() else "there was no previous one"
        raise CheckpointSaveError(f"saving checkpoint {path} failed ({'; '.join(failures)}); {previous}") from error
    return {name: size for written, _ in every for name, size in written.items()}


def _begin(partial: Path) -> dict[str, int]:
    _remove(partial)  # left by a save of the same name that was interrupted
    partial.mkdir(parents=True)
    return {}


def _sizes(folder: Path, names: list[str]) -> dict[str, int]:
    _fsync(folder)
    return {name: (folder / name).stat().st_size for name in names}


def _commit(path: Path, pieces: dict[str, int]) -> None:
    partial, replaced = staged(path, PARTIAL), staged(path, REPLACED)
    with open(partial / MARKER, "w") as f:
        json.dump({"pieces": pieces}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync(partial)
    if path.exists() or path.is_symlink():
        _remove(replaced)  # older than ``path``: a commit stopped after its second rename
        os.rename(path, replaced)
    os.rename(partial, path)
    _fsync(path.parent)
    _remove(replaced)
    _remove_staging_if_empty(path)


def save_file(obj: Any, path: Path) -> None:
    """Replace the one-file checkpoint ``path`` by a single rename of a complete, ``fsync``-ed file.

    Lightning's ``TorchCheckpointIO`` writes its temporary file in the system temp directory and moves
    it: where that is another file system than the checkpoint's (a tmpfs ``/tmp``, checkpoints on
    a network file system), the move copies over the old file, and a crash during the copy leaves
    a torn checkpoint. The temporary file here is in the staging folder beside the checkpoint.
    """
    partial = staged(path, PARTIAL)
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_file(obj, partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync(path.parent)
    _remove_staging_if_empty(path)


# ---- remove (rank 0) ---------------------------------------------------------------------------
def remove_checkpoint_dir(path: Path) -> None:
    """Remove checkpoint directory ``path``: its name disappears at once (one rename), then its files.

    Saves in flight of other checkpoints live under other names in the staging folder and are left alone.
    """
    removed = staged(path, REMOVED)
    _remove(removed)
    removed.parent.mkdir(exist_ok=True)
    os.rename(path, removed)
    _fsync(path.parent)
    _remove(removed)
    _remove_staging_if_empty(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _remove_staging_if_empty(path: Path) -> None:
    try:
        (path.parent / STAGING).rmdir()
    except OSError:
        pass  # another checkpoint of this folder is being saved or removed


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- read --------------------------------------------------------------------------------------
def listed_pieces(folder: Path) -> Optional[dict[str, int]]:
    """``file name -> size`` from the completion marker of ``folder``; None without a marker."""
    marker = folder / MARKER
    if not marker.is_file():
        return None
    return json.loads(marker.read_text())["pieces"]


def missing_pieces(folder: Path, pieces: dict[str, Optional[int]]) -> list[str]:
    """The pieces absent from ``folder`` or of another size than listed (a size of None is not checked)."""
    missing = []
    for name, size in sorted(pieces.items()):
        file = folder / name
        if not file.is_file():
            missing.append(name)
        elif size is not None and file.stat().st_size != size:
            missing.append(f"{name} (truncated: {file.stat().st_size} of {size} bytes)")
    return missing


def is_complete(folder: Path) -> bool:
    pieces = listed_pieces(folder) if folder.is_dir() else None
    return pieces is not None and not missing_pieces(folder, pieces)


def folder_to_read(path: Path, unconfirmed: Callable[[Path], tuple[dict[str, Optional[int]], bool]]) -> Path:
    """The complete checkpoint to read for ``path``: ``path`` itself, or the checkpoint it replaces
    when a crash fell between the two renames of a commit. A path that is neither a directory nor
    recoverable is returned as it is (a plain file, or nothing: the caller reports it).

    unconfirmed(folder): for a directory without marker, the pieces its metadata names and whether
        it predates markers (then it is accepted when they are all present).
    Raises ``IncompleteCheckpointError`` naming the missing pieces and a complete checkpoint nearby.
    """
    if not path.exists() and is_complete(staged(path, REPLACED)):
        return staged(path, REPLACED)
    if not path.is_dir():
        return path
    pieces = listed_pieces(path)
    if pieces is not None:
        missing = missing_pieces(path, pieces)
        if not missing:
            return path
        reason = f"it lacks pieces its completion marker lists: {', '.join(missing)}"
    else:
        pieces, predates_markers = unconfirmed(path)
        missing = missing_pieces(path, pieces)
        if predates_markers and not missing:
            return path
        reason = f"its save did not finish (no {MARKER}); " + (
            f"missing pieces: {', '.join(missing)}" if missing else "its pieces were never confirmed by every rank"
        )
    previous = _complete_neighbour(path)
    advice = (f"resume from {previous}, the newest complete checkpoint beside it" if previous
              else "no complete checkpoint was found beside it")
    raise IncompleteCheckpointError(f"checkpoint {path} is incomplete: {reason}. It is not loaded; {advice}")


def _complete_neighbour(path: Path) -> Optional[Path]:
    """The checkpoint an interrupted ``path`` would have replaced, else the newest complete one beside it."""
    if path.parent.name == STAGING and path.name.endswith(PARTIAL):
        final = path.parent.parent / path.name[: -len(PARTIAL)]
        if final.is_file() or is_complete(final):
            return final
    if is_complete(staged(path, REPLACED)):
        return staged(path, REPLACED)
    folder = path.parent.parent if path.parent.name == STAGING else path.parent
    beside = [p for p in folder.iterdir() if p != path and ((p.suffix == ".ckpt" and p.is_file()) or is_complete(p))]
    return max(beside, key=lambda p: p.stat().st_mtime, default=None)
