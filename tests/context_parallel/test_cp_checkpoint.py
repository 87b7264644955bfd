"""Checkpoints under context parallelism are those of the same layout without it (CP splits no
parameter): a run saved at CP2 resumes at CP1 and at CP4 and continues as the uninterrupted run does.

Tolerance as in ``test_cp_training.py``: each CP size sums the split blocks' gradients in another
order (~1e-7 relative); a lost optimizer state or a wrong parameter is off by about lr = 1e-2.
"""

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.strategy import ParallelStrategy
from tests.context_parallel.test_cp_training import LOSS_TOL, PARAM_TOL, LlamaLM, tokens
from tests.helpers.parity import (
    assert_close_series,
    assert_params_close,
    fit_and_record,
)

EPOCH = 2  # steps per epoch: the checkpoint is taken at an epoch's end, where the sampler restarts


def fit(module, out, cp: int, steps: int, **kwargs) -> dict:
    """Rank 0's record (losses, parameters) of ``steps`` steps on ``cp`` processes."""
    return fit_and_record(module, tokens(2 * EPOCH), 2, str(out), devices=cp, max_steps=steps,
                          strategy=ParallelStrategy(context_parallel=cp, start_method="fork"), **kwargs)[0]


@pytest.mark.timeout(180)
def test_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4(tmp_path):
    L.seed_everything(0)
    module = LlamaLM()
    whole = fit(module, tmp_path / "whole", cp=2, steps=2 * EPOCH)
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="epoch", every_n_train_steps=EPOCH)
    fit(module, tmp_path / "first", cp=2, steps=EPOCH, enable_checkpointing=True, callbacks=[save])
    saved = tmp_path / "ckpt" / "epoch.ckpt"
    assert saved.is_file()  # one file, as without context parallelism (not a directory of shards)
    for cp in (1, 4):
        resumed = fit(module, tmp_path / f"cp{cp}", cp=cp, steps=2 * EPOCH, ckpt_path=str(saved))
        assert_close_series(resumed["losses"], whole["losses"][EPOCH:], **LOSS_TOL)
        assert_params_close(resumed["params"], whole["params"], **PARAM_TOL)


@pytest.mark.timeout(180)
def test_checkpoint_saved_at_tp2_cp2_is_a_tp2_checkpoint_and_resumes_without_cp(tmp_path):
    L.seed_everything(0)
    module = LlamaLM()

    def run(out, cp, steps, **kwargs):
        return fit_and_record(module, tokens(2 * EPOCH), 2, str(out), devices=2 * cp, max_steps=steps,
                              strategy=ParallelStrategy(tensor_parallel=2, context_parallel=cp, start_method="fork"),
                              **kwargs)[0]

    whole = run(tmp_path / "whole", cp=1, steps=2 * EPOCH)
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="epoch", every_n_train_steps=EPOCH)
    run(tmp_path / "first", cp=2, steps=EPOCH, enable_checkpointing=True, callbacks=[save])
    saved = tmp_path / "ckpt" / "epoch.ckpt"
    assert saved.is_dir()  # the tensor-parallel layout's directory of shards
    resumed = run(tmp_path / "resumed", cp=1, steps=2 * EPOCH, ckpt_path=str(saved))
    assert_close_series(resumed["losses"], whole["losses"][EPOCH:], **LOSS_TOL)
    assert_params_close(resumed["params"], whole["params"], **PARAM_TOL)  # rank 0's TP shards
