"""ZeRO-1 checkpoints: saved like any other checkpoint, resumed with or without ZeRO, on any layout.

A plain checkpoint file gets the optimizer state gathered on data-parallel rank 0; a folder in DCP
format (a split model) gets each rank's own slices, with no gather: the tests that write one run
with the gather disabled in every rank, and compare what plain DCP tools read from it with what a
run without ZeRO saves.

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
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_parallel import ParallelStrategy
from lightning_parallel.checkpoint.dcp import OPTIMIZER_PREFIX, read_metadata
from lightning_parallel.cli.consolidate import main as consolidate_main
from lightning_parallel.data_parallel.zero import ZeroOneSharding
from tests.checkpoint.test_checkpoint import (
    DATASET,
    GLOBAL_BATCH,
    HALF,
    LOSS_TOL,
    STEPS,
    StepData,
    assert_continues,
    half_run,
    tiny_gpt,
    train,
)

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


def _gather(*args, **kwargs):
    raise AssertionError("a rank gathered other ranks' optimizer slices to save a checkpoint folder")


@pytest.fixture(scope="module")
def zero_tp2dp2_checkpoint(tmp_path_factory):
    """A folder written by TP2 x DP2 with ZeRO-1 after HALF steps, the gather of optimizer slices
    disabled in every rank (the forked ranks inherit the patch)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ZeroOneSharding, "state_dict", _gather)
        return half_run(tmp_path_factory.mktemp("zero_tp2dp2"), devices=4, tp=2, **ZERO)


@pytest.fixture(scope="module")
def tp2dp2_checkpoint(tmp_path_factory):
    """The same run without ZeRO."""
    return half_run(tmp_path_factory.mktemp("tp2dp2"), devices=4, tp=2)


@pytest.mark.timeout(90)
def test_zero1_ranks_write_their_own_slices_which_dcp_tools_read_as_the_state_without_zero(
        tmp_path, zero_tp2dp2_checkpoint, tp2dp2_checkpoint):
    metadata = read_metadata(zero_tp2dp2_checkpoint)
    files = {}  # file -> optimizer chunks in it
    for index, stored in metadata.storage_data.items():
        if index.fqn.startswith(OPTIMIZER_PREFIX):
            files[stored.relative_path] = files.get(stored.relative_path, 0) + 1
    assert sorted(files) == [f"__{r}_0.distcp" for r in range(4)], files  # every rank wrote a part of the state
    zero, plain = tmp_path / "zero.pt", tmp_path / "plain.pt"
    dcp_to_torch_save(zero_tp2dp2_checkpoint, zero)
    dcp_to_torch_save(tp2dp2_checkpoint, plain)
    zero, plain = torch.load(zero, weights_only=False), torch.load(plain, weights_only=False)
    assert zero.keys() == plain.keys()
    assert any(k.startswith(OPTIMIZER_PREFIX) and k.endswith(".exp_avg") for k in zero)
    for key, value in plain.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(zero[key], value, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")
        else:
            assert zero[key] == value, key


@pytest.mark.timeout(90)
def test_tp2dp2_folder_without_zero_resumes_on_pp2dp2_with_zero1(tmp_path, tp2dp2_checkpoint, reference):
    assert_continues(train(tmp_path, devices=4, pp=2, ckpt_path=tp2dp2_checkpoint, **ZERO), reference)


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


def _resumes_and_consolidates(tmp_path, checkpoint, reference, devices, tp, pp, zero_stage):
    """Another layout resumes ``checkpoint`` (with other buckets: ``bucket_size_mb``), and so does
    one device from its consolidation."""
    assert checkpoint.is_dir()
    records = train(tmp_path / "resumed", devices, tp, pp, ckpt_path=checkpoint, zero_stage=zero_stage,
                    bucket_size_mb=0.02)
    assert_continues(records, reference)
    plain = tmp_path / "plain.ckpt"
    consolidate_main([str(checkpoint), str(plain)])
    assert_continues(train(tmp_path / "one", ckpt_path=plain), reference)


@pytest.mark.timeout(120)
def test_zero1_tp2dp2_folder_resumes_on_pp2dp2_with_zero1_and_other_buckets(tmp_path, reference,
                                                                           zero_tp2dp2_checkpoint):
    _resumes_and_consolidates(tmp_path, zero_tp2dp2_checkpoint, reference, devices=4, tp=1, pp=2, zero_stage=1)


@pytest.mark.timeout(120)
def test_zero1_pp2dp2_folder_resumes_on_dp2_without_zero(tmp_path, reference):
    checkpoint = half_run(tmp_path / "saved", devices=4, pp=2, **ZERO)
    _resumes_and_consolidates(tmp_path, checkpoint, reference, devices=2, tp=1, pp=1, zero_stage=0)


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
