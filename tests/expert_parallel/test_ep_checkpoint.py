"""Checkpoints under expert parallelism hold every expert under its unsplit name, indexed by its global id:
a run saved at DP2 x EP2 resumes at EP1 (plain DP2) and at EP2 and continues as the uninterrupted run does,
a checkpoint of plain DP2 resumes at EP2, and ``lp-consolidate`` / ``lp-export`` read the EP checkpoint as
the whole model.

Tolerance as in ``test_ep_training.py``: each layout sums the experts' outputs and gradients in another
order (~1e-7 relative); a lost optimizer state or an expert restored at another's place is off by about
lr = 1e-2.
"""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.checkpoint.consolidate import consolidate
from lightning_parallel.checkpoint.export import export
from lightning_parallel.strategy import ParallelStrategy
from tests.expert_parallel.test_ep_training import (
    LOSS_TOL,
    PARAM_TOL,
    MoELM,
    Record,
    tokens,
)
from tests.helpers.parity import (
    assert_close_series,
    assert_params_close,
    fit_and_record,
)

EPOCH = 2  # steps per epoch: the checkpoint is taken at an epoch's end, where the sampler restarts


def fit(module, out, ep: int, steps: int, zero_stage: int = 0, **kwargs) -> dict:
    """Rank 0's record (losses, and every parameter whole) of ``steps`` steps on 2 data-parallel ranks."""
    callbacks = [Record(str(out))] + kwargs.pop("callbacks", [])
    strategy = ParallelStrategy(data_parallel=2, expert_parallel=ep, zero_stage=zero_stage, start_method="fork")
    record = fit_and_record(module, tokens(4 * EPOCH), 2, str(out), devices=2, max_steps=steps, strategy=strategy,
                            callbacks=callbacks, **kwargs)[0]
    return {**record, "params": torch.load(out / "whole0.pt")["params"]}


@pytest.mark.timeout(180)
def test_checkpoint_saved_at_ep2_resumes_at_ep1_and_ep2_and_exports_whole(tmp_path):
    L.seed_everything(0)
    module = MoELM()
    whole = fit(module, tmp_path / "whole", ep=2, steps=2 * EPOCH)
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="epoch", every_n_train_steps=EPOCH)
    first = fit(module, tmp_path / "first", ep=2, steps=EPOCH, enable_checkpointing=True, callbacks=[save])
    saved = tmp_path / "ckpt" / "epoch.ckpt"
    assert saved.is_dir()  # each rank wrote its own experts
    plain = consolidate(saved)["state_dict"]
    experts = "model.model.layers.1.mlp.experts.down_proj"
    assert plain[experts].shape == first["params"][experts].shape == (4, 32, 32)
    assert_params_close(plain, first["params"], atol=0, rtol=0)
    for ep in (1, 2):
        resumed = fit(module, tmp_path / f"ep{ep}", ep=ep, steps=2 * EPOCH, ckpt_path=str(saved))
        assert_close_series(resumed["losses"], whole["losses"][EPOCH:], **LOSS_TOL)
        assert_params_close(resumed["params"], whole["params"], **PARAM_TOL)
    export(saved, tmp_path / "hf")
    from transformers import MixtralForCausalLM

    exported = MixtralForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(exported.model.layers[1].mlp.experts.down_proj.detach(), first["params"][experts])


@pytest.mark.timeout(180)
def test_checkpoint_saved_without_expert_parallelism_resumes_at_ep2(tmp_path):
    L.seed_everything(0)
    module = MoELM("qwen3_moe")
    whole = fit(module, tmp_path / "whole", ep=1, steps=2 * EPOCH)
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="epoch", every_n_train_steps=EPOCH)
    fit(module, tmp_path / "first", ep=1, steps=EPOCH, enable_checkpointing=True, callbacks=[save])
    resumed = fit(module, tmp_path / "ep2", ep=2, steps=2 * EPOCH, ckpt_path=str(tmp_path / "ckpt" / "epoch.ckpt"))
    assert_close_series(resumed["losses"], whole["losses"][EPOCH:], **LOSS_TOL)
    assert_params_close(resumed["params"], whole["params"], **PARAM_TOL)


@pytest.mark.timeout(180)
def test_checkpoint_saved_at_ep2_with_zero1_resumes_without_either(tmp_path):
    # the dense parameters' optimizer state written as each rank's ZeRO-1 slices, the experts' whole per rank
    L.seed_everything(0)
    module = MoELM()
    whole = fit(module, tmp_path / "whole", ep=2, zero_stage=1, steps=2 * EPOCH)
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="epoch", every_n_train_steps=EPOCH)
    fit(module, tmp_path / "first", ep=2, zero_stage=1, steps=EPOCH, enable_checkpointing=True, callbacks=[save])
    for ep, zero_stage in ((1, 0), (2, 1)):
        resumed = fit(module, tmp_path / f"ep{ep}", ep=ep, zero_stage=zero_stage, steps=2 * EPOCH,
                      ckpt_path=str(tmp_path / "ckpt" / "epoch.ckpt"))
        assert_close_series(resumed["losses"], whole["losses"][EPOCH:], **LOSS_TOL)
        assert_params_close(resumed["params"], whole["params"], **PARAM_TOL)
