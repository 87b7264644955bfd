"""ZeRO-1 checkpoints: saved like any other checkpoint, resumed with or without ZeRO, on any layout.

The runs, data and tolerances are those of ``test_checkpoint.py`` (the tiny GPT, 6 steps, step s
reads global batch s, AdamW with two parameter groups). Resuming on the SAME layout repeats the same
float32 arithmetic, so it must be bit-identical; resuming across ZeRO / non-ZeRO or another layout
re-associates sums (reduce-scatter against all-reduce, other TP splits), hence LOSS_TOL and
PARAM_TOL against the single-device run. The optimizer state a ZeRO-1 run saves is compared with
what a plain DP run saves at the same step to 1e-6: only the order of sums may differ (measured:
identical), while a slice lost or put at the wrong offset is off by the moment itself (up to 1.8e-2).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_checkpoint import (
    DATASET, GLOBAL_BATCH, HALF, LOSS_TOL, STEPS, StepData, assert_continues, half_run, tiny_gpt, train,
)

from lightning_parallel import ParallelStrategy
from lightning_parallel.checkpoint.consolidate import main as consolidate_main

# small buckets: the GPT's 53k parameters spread over 26 buckets, many cut between the two ranks' slices
ZERO = dict(zero_stage=1, bucket_size_mb=0.01)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run on one device."""
    return train(tmp_path_factory.mktemp("reference"))[0]


@pytest.fixture(scope="module")
def zero_checkpoint(tmp_path_factory):
    """A plain checkpoint file written by DP2 with ZeRO-1 after HALF steps."""
    return half_run(tmp_path_factory.mktemp("zero"), devices=2, **ZERO)


@pytest.mark.timeout(90)
def test_zero1_checkpoint_holds_the_unsharded_optimizer_state(tmp_path, zero_checkpoint):
    plain = half_run(tmp_path, devices=2)
    zero = torch.load(zero_checkpoint, weights_only=False)["optimizer_states"]
    full = torch.load(plain, weights_only=False)["optimizer_states"]
    assert len(zero) == len(full) == 1
    assert zero[0]["param_groups"] == full[0]["param_groups"]
    assert zero[0]["state"].keys() == full[0]["state"].keys()
    for index, state in full[0]["state"].items():
        assert zero[0]["state"][index].keys() == state.keys()
        for key, value in state.items():
            torch.testing.assert_close(zero[0]["state"][index][key], value, atol=1e-6, rtol=0,
                                       msg=lambda m: f"parameter {index}, {key}: {m}")


@pytest.mark.timeout(90)
def test_zero1_dp2_resumes_on_zero1_dp2_exactly(tmp_path, zero_checkpoint):
    whole = train(tmp_path / "whole", devices=2, **ZERO)
    resumed = train(tmp_path / "resumed", devices=2, ckpt_path=zero_checkpoint, **ZERO)
    for w, r in zip(whole, resumed, strict=True):
        assert r["global_step"] == STEPS
        assert r["losses"] == w["losses"][HALF:]
        for name, value in w["params"].items():
            assert torch.equal(r["params"][name], value), name


@pytest.mark.timeout(90)
def test_zero1_checkpoint_resumes_without_zero_and_on_one_device(tmp_path, zero_checkpoint, reference):
    assert_continues(train(tmp_path / "dp2", devices=2, ckpt_path=zero_checkpoint), reference)
    assert_continues(train(tmp_path / "one", ckpt_path=zero_checkpoint), reference)


@pytest.mark.timeout(90)
def test_plain_dp_checkpoint_resumes_with_zero1(tmp_path, reference):
    checkpoint = half_run(tmp_path / "dp2", devices=2)
    assert_continues(train(tmp_path / "zero", devices=2, ckpt_path=checkpoint, **ZERO), reference)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved, resumed", [((4, 2, 1), (4, 1, 2, 1)), ((4, 1, 2), (2, 1, 1, 0))],
                         ids=["tp2dp2-to-pp2dp2-zero1", "pp2dp2-to-dp2"])
def test_zero1_sharded_folder_resumes_on_another_layout(tmp_path, reference, saved, resumed):
    """A ZeRO-1 run on TP2 x DP2 or PP2 x DP2 writes a folder of pieces; another layout resumes it,
    and so does one device from its consolidation.

    ``saved`` is (devices, tp, pp), ``resumed`` (devices, tp, pp, zero_stage)."""
    devices, tp, pp = saved
    checkpoint = half_run(tmp_path / "saved", devices=devices, tp=tp, pp=pp, **ZERO)
    assert checkpoint.is_dir()
    devices, tp, pp, zero_stage = resumed
    records = train(tmp_path / "resumed", devices, tp, pp, ckpt_path=checkpoint, zero_stage=zero_stage,
                    bucket_size_mb=0.02)  # another bucket layout than the saving run
    assert_continues(records, reference)
    # and consolidated into one plain file, it resumes on one device
    plain = tmp_path / "plain.ckpt"
    consolidate_main([str(checkpoint), str(plain)])
    assert_continues(train(tmp_path / "one", ckpt_path=plain), reference)


@pytest.mark.timeout(90)
def test_zero1_saves_weights_only(tmp_path, reference):
    strategy = ParallelStrategy(start_method="fork", timeout=60, **ZERO)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=HALF, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=str(tmp_path),
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_weights_only=True)],
    )
    trainer.fit(tiny_gpt(), datamodule=StepData())
    saved = torch.load(tmp_path / "ckpt" / f"epoch=0-step={HALF}.ckpt", weights_only=False)
    assert "optimizer_states" not in saved
    # the weights are those of the run at HALF steps: the next step's loss is the reference's
    model = tiny_gpt()
    model.load_state_dict(saved["state_dict"])
    x, y = DATASET[HALF * GLOBAL_BATCH:(HALF + 1) * GLOBAL_BATCH]
    with torch.no_grad():
        loss = model._loss((x, y)).item()
    assert loss == pytest.approx(reference["losses"][HALF], abs=LOSS_TOL["atol"])
