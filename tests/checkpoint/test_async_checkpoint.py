"""Checkpoints written in the background (``checkpoint/background.py``) resume like synchronous ones.

The runs are those of ``test_checkpoint.py``: the tiny GPT for 6 steps, global batch s at step s,
a ``ModelCheckpoint`` saving every step and keeping the newest one (so each save is followed by the
removal of the previous one, which must wait for the write). A run on TP2 x PP2 with Lightning's
``AsyncCheckpointIO`` saves at step HALF and a run resumed from that checkpoint must continue the
uninterrupted single-device run within that file's loss tolerance (another layout than one device:
1e-5, from the float32 bound; its ranks hold TP shards, so parameters are compared after the kill,
on PP2). A save whose write fails or whose process is
killed mid-write must leave the previous checkpoint complete and resumable (the scenarios of
``test_checkpoint_atomic.py``, with the write on the background thread).
"""

from __future__ import annotations

import errno

import pytest
import torch
from lightning.pytorch.plugins import AsyncCheckpointIO

from lightning_parallel.checkpoint.atomic import PARTIAL, is_complete, staged
from tests.checkpoint.test_checkpoint import (  # noqa: F401 - reference: fixture
    HALF,
    LOSS_TOL,
    assert_continues,
    half_run,
    reference,
    train,
)
from tests.helpers.parity import assert_close_series, mean_over_ranks
from tests.checkpoint.test_checkpoint_atomic import (
    RecordingCheckpoint,
    _disk_full,
    _killed,
    _last_piece,
    _last_step,
    _strike_on,
)


@pytest.mark.timeout(90)
def test_tp2_pp2_async_checkpoint_io_resumes_with_uninterrupted_losses(tmp_path, reference):
    checkpoint = half_run(tmp_path, devices=4, tp=2, pp=2, plugins=[AsyncCheckpointIO()])
    assert is_complete(checkpoint) and _last_step(checkpoint) == HALF
    assert not (checkpoint.parent / ".lp-staging").exists()  # the write finished before fit ended
    resumed = train(tmp_path / "resumed", devices=4, tp=2, pp=2, ckpt_path=checkpoint, plugins=[AsyncCheckpointIO()])
    assert_close_series(mean_over_ranks(resumed), reference["losses"][HALF:], **LOSS_TOL)


@pytest.mark.timeout(90)
def test_rank_killed_during_a_background_write_leaves_previous_last_resumable(tmp_path, monkeypatch, reference):
    ckpt, last = tmp_path / "ckpt", tmp_path / "ckpt" / "last.ckpt"
    monkeypatch.setattr(torch, "save", _strike_on(1, HALF + 1, _last_piece, _killed))
    with pytest.raises(Exception, match="SIGKILL|signal 9"):
        train(tmp_path / "crashed", devices=2, pp=2, async_checkpoint=True,
              checkpoint=RecordingCheckpoint(ckpt, tmp_path / "errors"))
    monkeypatch.undo()

    assert is_complete(last) and _last_step(last) == HALF
    assert_continues(train(tmp_path / "resumed", devices=2, pp=2, ckpt_path=last), reference)


@pytest.mark.timeout(90)
def test_failed_background_write_is_raised_on_every_rank_at_the_next_save(tmp_path, monkeypatch):
    ckpt, last, errors = tmp_path / "ckpt", tmp_path / "ckpt" / "last.ckpt", tmp_path / "errors"
    monkeypatch.setattr(torch, "save", _strike_on(0, HALF + 1, _last_piece, _disk_full))
    with pytest.raises(Exception, match="CheckpointSaveError"):
        train(tmp_path / "full", devices=2, tp=2, async_checkpoint=True, checkpoint=RecordingCheckpoint(ckpt, errors))
    monkeypatch.undo()

    for rank in range(2):  # raised by the save after the failed one, on every rank
        message = (errors / f"rank{rank}.txt").read_text()
        assert message.startswith("CheckpointSaveError: saving checkpoint")
        assert f"rank 0: OSError: [Errno {errno.ENOSPC}]" in message and "is unchanged" in message
    assert not staged(last, PARTIAL).exists()
    assert is_complete(last) and _last_step(last) == HALF


@pytest.mark.timeout(90)
def test_dp2_whole_model_checkpoint_written_in_the_background_resumes(tmp_path, reference):
    checkpoint = half_run(tmp_path, devices=2, async_checkpoint=True)
    assert checkpoint.is_file()  # a whole model: one file, written by rank 0's background thread
    assert_continues(train(tmp_path / "resumed", devices=2, ckpt_path=checkpoint, async_checkpoint=True), reference)
