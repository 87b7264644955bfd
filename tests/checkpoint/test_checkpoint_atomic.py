"""A crash or a failed write while saving never costs the previous checkpoint.

The runs are those of ``test_checkpoint.py`` (the tiny GPT, 6 steps, global batch s at step s) on 2
fork-started processes, with ``ModelCheckpoint(save_last=True)`` saving every step. A patched
``torch.save`` strikes one rank during its write of ``last.ckpt`` at step HALF + 1 (DCP writes each
chunk with ``torch.save`` into the rank's ``.distcp`` file; the first chunk of the file is struck):
it writes half of the bytes and then either kills its process (SIGKILL, as the OOM killer or a node
failure would) or raises ``OSError(ENOSPC)``. The ``last.ckpt`` of step HALF must then still be complete, and a run
resumed from it (on PP2, whose ranks hold whole tensors to compare) must continue the uninterrupted
single-device run; the tolerances are those of ``test_checkpoint.py`` (another layout than one
device: LOSS_TOL, PARAM_TOL). Before the commit protocol of ``atomic.py`` the old ``last.ckpt``
was deleted first, and resuming failed with ``FileNotFoundError``.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.checkpoint import IncompleteCheckpointError, consolidate
from lightning_parallel.checkpoint.atomic import (
    MARKER,
    PARTIAL,
    REPLACED,
    is_complete,
    remove_checkpoint_dir,
    staged,
)
from lightning_parallel.cli.consolidate import main as consolidate_main
from tests.checkpoint.test_checkpoint import (  # noqa: F401 - reference: fixture
    HALF,
    assert_continues,
    checkpoint_before_dcp,
    half_run,
    reference,
    train,
)

LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2)}
STRUCK_RANK = {"tp2": 0, "pp2": 1}  # rank 0 also writes the metadata and commits; rank 1 only its piece
_real_save = torch.save


def _strike_on(rank: int, nth: int, target, fault):
    """A ``torch.save`` that calls ``fault`` on global rank ``rank`` at its ``nth`` write matching ``target``."""
    count = 0

    def save(obj, f, *args, **kwargs):
        nonlocal count
        if dist.is_initialized() and dist.get_rank() == rank and target(obj, f):
            count += 1
            if count == nth:
                fault(obj, f)
        return _real_save(obj, f, *args, **kwargs)

    return save


_files_written: list = []  # the DCP files this process has written into, kept so that each is told apart


def _last_piece(obj, f) -> bool:
    """The first chunk DCP writes into a ``.distcp`` file of ``last.ckpt``, wherever that is written
    (now: ``.lp-staging/last.ckpt.partial``): once per save and rank."""
    raw = getattr(f, "raw", f)  # DCP hands torch.save a writer around the open file
    name = Path(getattr(raw, "name", "") or "")
    if not (name.parent.name.startswith("last.ckpt") and name.suffix == ".distcp"):
        return False
    if any(raw is seen for seen in _files_written):
        return False
    _files_written.append(raw)
    return True


def _half_then(obj, f):
    buffer = io.BytesIO()
    _real_save(obj, buffer)
    half = buffer.getvalue()[: len(buffer.getvalue()) // 2]
    if isinstance(f, (str, os.PathLike)):
        Path(f).write_bytes(half)
    else:
        f.write(half)
        f.flush()


def _killed(obj, f):
    _half_then(obj, f)
    os.kill(os.getpid(), signal.SIGKILL)


def _disk_full(obj, f):
    _half_then(obj, f)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class RecordingCheckpoint(ModelCheckpoint):
    """ModelCheckpoint(save_last=True) that writes what each rank's failed save raised into ``errors``."""

    def __init__(self, dirpath: Path, errors: Path):
        super().__init__(dirpath=dirpath, every_n_train_steps=1, save_top_k=1, save_last=True)
        self.errors = errors

    def _save_checkpoint(self, trainer, filepath):
        try:
            super()._save_checkpoint(trainer, filepath)
        except Exception as err:
            self.errors.mkdir(exist_ok=True)
            (self.errors / f"rank{trainer.global_rank}.txt").write_text(f"{type(err).__name__}: {err}")
            raise


def _last_step(checkpoint: Path) -> int:
    return torch.load(checkpoint / "meta.pt", weights_only=False)["global_step"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rank_killed_while_saving_last_leaves_previous_last_resumable(tmp_path, monkeypatch, reference, layout):
    ckpt, last = tmp_path / "ckpt", tmp_path / "ckpt" / "last.ckpt"
    monkeypatch.setattr(torch, "save", _strike_on(STRUCK_RANK[layout], HALF + 1, _last_piece, _killed))
    with pytest.raises(Exception, match="SIGKILL|signal 9"):
        train(tmp_path / "crashed", devices=2, checkpoint=RecordingCheckpoint(ckpt, tmp_path / "errors"),
              **LAYOUTS[layout])
    monkeypatch.undo()

    assert is_complete(last) and _last_step(last) == HALF
    # the interrupted save's directory is refused, naming what it lacks and the checkpoint to use instead
    with pytest.raises(IncompleteCheckpointError, match=f"missing pieces: meta.pt.*resume from {last}"):
        consolidate(staged(last, PARTIAL))
    assert_continues(train(tmp_path / "resumed", devices=2, pp=2, ckpt_path=last), reference)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_failed_write_on_one_rank_fails_the_save_on_every_rank(tmp_path, monkeypatch, reference, layout):
    ckpt, last, errors = tmp_path / "ckpt", tmp_path / "ckpt" / "last.ckpt", tmp_path / "errors"
    struck = STRUCK_RANK[layout]
    monkeypatch.setattr(torch, "save", _strike_on(struck, HALF + 1, _last_piece, _disk_full))
    with pytest.raises(Exception, match="CheckpointSaveError"):
        train(tmp_path / "full", devices=2, checkpoint=RecordingCheckpoint(ckpt, errors), **LAYOUTS[layout])
    monkeypatch.undo()

    for rank in range(2):  # every rank raised the same error, none waited for the other
        message = (errors / f"rank{rank}.txt").read_text()
        assert message.startswith("CheckpointSaveError: saving checkpoint")
        assert f"rank {struck}: OSError: [Errno {errno.ENOSPC}]" in message and "is unchanged" in message
    assert not staged(last, PARTIAL).exists()  # the partial pieces were removed, giving the space back
    assert is_complete(last) and _last_step(last) == HALF
    assert_continues(train(tmp_path / "resumed", devices=2, pp=2, ckpt_path=last), reference)


def _checkpoint_into_file_object(obj, f) -> bool:
    return not isinstance(f, (str, os.PathLike)) and isinstance(obj, dict) and "state_dict" in obj


@pytest.mark.timeout(90)
@pytest.mark.parametrize("temp_dir", ["default", "/dev/shm"])
def test_single_file_checkpoint_survives_a_kill_inside_torch_save(tmp_path, monkeypatch, reference, temp_dir):
    """An unsplit model (DP) saves one file: written beside the checkpoint, then renamed over it,
    whichever file system the system temp directory is on (Lightning's own writer copies across)."""
    if temp_dir != "default":
        if not os.path.isdir(temp_dir):
            pytest.skip(f"no {temp_dir} here")
        monkeypatch.setattr(tempfile, "tempdir", temp_dir)
    ckpt, last = tmp_path / "ckpt", tmp_path / "ckpt" / "last.ckpt"
    monkeypatch.setattr(torch, "save", _strike_on(0, HALF + 1, _checkpoint_into_file_object, _killed))
    checkpoint = ModelCheckpoint(dirpath=ckpt, every_n_train_steps=1, save_top_k=0, save_last=True)
    with pytest.raises(Exception, match="SIGKILL|signal 9"):
        train(tmp_path / "crashed", devices=2, checkpoint=checkpoint)
    monkeypatch.undo()

    assert last.is_file() and torch.load(last, weights_only=False)["global_step"] == HALF
    assert_continues(train(tmp_path / "resumed", devices=2, ckpt_path=last), reference)


# ---- reading: only complete directories --------------------------------------------------------
@pytest.fixture(scope="module")
def pp2_checkpoint(tmp_path_factory) -> Path:
    return half_run(tmp_path_factory.mktemp("pp2"), devices=2, pp=2)


def _copy(checkpoint: Path, to: Path) -> Path:
    shutil.copytree(checkpoint, to)
    return to


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][name]), name


@pytest.mark.timeout(60)
def test_folder_without_marker_is_refused_naming_missing_pieces(tmp_path, pp2_checkpoint, capsys):
    complete = _copy(pp2_checkpoint, tmp_path / "epoch=0-step=2.ckpt")
    broken = _copy(pp2_checkpoint, tmp_path / "epoch=0-step=3.ckpt")
    (broken / MARKER).unlink()
    (broken / "__1_0.distcp").unlink()
    with pytest.raises(SystemExit) as exit_:
        consolidate_main([str(broken), str(tmp_path / "plain.ckpt")])
    assert exit_.value.code == 2
    message = capsys.readouterr().err
    assert "missing pieces: __1_0.distcp" in message and f"resume from {complete}" in message
    assert not (tmp_path / "plain.ckpt").exists()


@pytest.mark.timeout(60)
def test_truncated_piece_is_refused_even_with_marker(tmp_path, pp2_checkpoint):
    broken = _copy(pp2_checkpoint, tmp_path / "last.ckpt")
    piece = broken / "__0_0.distcp"
    piece.write_bytes(piece.read_bytes()[:100])
    with pytest.raises(IncompleteCheckpointError, match="__0_0.distcp \\(truncated: 100 of"):
        consolidate(broken)


@pytest.mark.timeout(60)
def test_folder_from_before_markers_loads_only_when_its_layout_is_complete(tmp_path, pp2_checkpoint):
    """Directories saved before completion markers existed: the metadata's layout names the pieces."""
    plain = tmp_path / "plain.ckpt"
    consolidate_main([str(pp2_checkpoint), str(plain)])
    old = checkpoint_before_dcp(plain, tmp_path / "old.ckpt")
    _assert_same_weights(consolidate(old), consolidate(pp2_checkpoint))
    (old / "pp001-tp000.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match="missing pieces: pp001-tp000.pt"):
        consolidate(old)


@pytest.mark.timeout(60)
def test_crash_between_the_renames_of_a_commit_reads_the_replaced_checkpoint(tmp_path, pp2_checkpoint):
    """The old directory was renamed aside and the new one not yet into place: ``last.ckpt`` is missing."""
    last = tmp_path / "last.ckpt"
    staged(last, REPLACED).parent.mkdir()
    _copy(pp2_checkpoint, staged(last, REPLACED))
    _assert_same_weights(consolidate(last), consolidate(pp2_checkpoint))


def _make(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "meta.pt").write_bytes(b"x")
    return path


def test_removing_a_checkpoint_leaves_saves_in_progress_alone(tmp_path):
    """What ModelCheckpoint's removal of a stale checkpoint does on rank 0 (``strategy.remove_checkpoint``)."""
    old, saving = _make(tmp_path / "epoch=0-step=1.ckpt"), staged(tmp_path / "epoch=0-step=2.ckpt", PARTIAL)
    saving.mkdir(parents=True)
    (saving / "pp000-tp000.pt").write_bytes(b"y")
    remove_checkpoint_dir(old)
    assert not old.exists()
    assert [p.name for p in saving.parent.iterdir()] == [saving.name]
    assert (saving / "pp000-tp000.pt").read_bytes() == b"y"
    shutil.rmtree(saving)
    remove_checkpoint_dir(_make(tmp_path / "third.ckpt"))
    assert list(tmp_path.iterdir()) == []  # the staging folder goes once empty


def test_plain_file_given_to_lp_consolidate_is_refused_as_already_consolidated(tmp_path, capsys):
    plain = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, plain)
    with pytest.raises(SystemExit) as exit_:
        consolidate_main([str(plain), str(tmp_path / "out.ckpt")])
    assert exit_.value.code == 2
    assert "is a plain checkpoint file, already consolidated" in capsys.readouterr().err
