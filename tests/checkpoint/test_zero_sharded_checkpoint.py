"""ZeRO-2/3 checkpoints: each rank writes its rows; they resume across zero stages and layouts, and
``lp-consolidate`` and ``lp-export``'s reader read them.

The runs, data and tolerances are those of ``test_checkpoint.py`` (the tiny GPT, 6 steps, step s reads
global batch s). Resuming on the SAME layout repeats the same float32 arithmetic: bit-identical.
Across stages and layouts sums are re-associated: LOSS_TOL and PARAM_TOL against one device. What a
ZeRO-3 run saves equals what a plain DP run saves at the same step to SAVED_TOL: only the order of
sums differs (reduce-scatter against all-reduce), which AdamW amplifies on near-zero gradients
(measured: at most 1.2e-6, in one attention bias element); rows put at another rank's offset are off
by the values themselves (~1e-1).
"""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.checkpoint.dcp import OPTIMIZER_PREFIX, read_metadata
from lightning_parallel.checkpoint.tensors import CheckpointTensors
from lightning_parallel.cli.consolidate import main as consolidate_main
from tests.checkpoint.test_checkpoint import (
    HALF,
    LOSS_TOL,
    PARAM_TOL,
    STEPS,
    assert_continues,
    half_run,
    train,
)
from tests.helpers.parity import (
    assert_close_series,
    assert_params_close,
    mean_over_ranks,
)

SAVED_TOL = dict(atol=1e-5, rtol=0.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run on one device."""
    return train(tmp_path_factory.mktemp("reference"))[0]


@pytest.fixture(scope="module")
def zero3_dp4_checkpoint(tmp_path_factory):
    return half_run(tmp_path_factory.mktemp("zero3_dp4"), devices=4, zero_stage=3)


def assert_losses_continue(records: list[dict], reference: dict) -> None:
    """The uninterrupted losses; parameters wherever a rank holds them whole (not its TP shard)."""
    assert_close_series(mean_over_ranks(records), reference["losses"][HALF:], **LOSS_TOL)
    for record in records:
        whole = {n for n, p in record["params"].items() if p.shape == reference["params"][n].shape}
        assert_params_close(record["params"], reference["params"], names=whole.__contains__, **PARAM_TOL)


@pytest.mark.timeout(120)
def test_zero3_ranks_write_their_rows_which_read_back_as_a_plain_dp_checkpoint(tmp_path, zero3_dp4_checkpoint):
    metadata = read_metadata(zero3_dp4_checkpoint)
    files: dict[str, set] = {}  # file -> what it holds: model tensors, optimizer states
    for index, stored in metadata.storage_data.items():
        kind = "optimizer" if index.fqn.startswith(OPTIMIZER_PREFIX) else "model"
        files.setdefault(stored.relative_path, set()).add(kind)
    assert files == {f"__{r}_0.distcp": {"model", "optimizer"} for r in range(4)}  # each wrote its rows of both
    zero = tmp_path / "zero.ckpt"
    consolidate_main([str(zero3_dp4_checkpoint), str(zero)])
    zero = torch.load(zero, weights_only=False)
    plain = torch.load(half_run(tmp_path / "plain", devices=4), weights_only=False)
    assert zero["state_dict"].keys() == plain["state_dict"].keys()
    for name, value in plain["state_dict"].items():
        torch.testing.assert_close(zero["state_dict"][name], value, **SAVED_TOL, msg=lambda m: f"{name}: {m}")
    (saved,), (expected,) = zero["optimizer_states"], plain["optimizer_states"]
    assert saved["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(saved["state"][index][key], value, **SAVED_TOL,
                                       msg=lambda m: f"parameter {index}, {key}: {m}")
    # lp-export reads tensor by tensor, whatever layout wrote them
    tensors = CheckpointTensors(zero3_dp4_checkpoint)
    for name, value in plain["state_dict"].items():
        torch.testing.assert_close(tensors.read(name), value, **SAVED_TOL)


@pytest.mark.timeout(120)
def test_zero3_dp4_resumes_on_tp2_pp2_with_zero1(tmp_path, zero3_dp4_checkpoint, reference):
    assert_losses_continue(train(tmp_path, devices=4, tp=2, pp=2, ckpt_path=zero3_dp4_checkpoint, zero_stage=1),
                           reference)


@pytest.mark.timeout(180)
def test_tp2_pp2_zero1_resumes_on_dp4_with_zero3_and_on_pp2_dp2_with_zero2(tmp_path, reference):
    checkpoint = half_run(tmp_path / "saved", devices=4, tp=2, pp=2, zero_stage=1)
    assert_continues(train(tmp_path / "dp4", devices=4, ckpt_path=checkpoint, zero_stage=3), reference)
    assert_continues(train(tmp_path / "pp2", devices=4, pp=2, ckpt_path=checkpoint, zero_stage=2), reference)


@pytest.mark.timeout(120)
def test_zero2_dp2_resumes_on_zero2_dp2_exactly(tmp_path):
    checkpoint = half_run(tmp_path / "saved", devices=2, zero_stage=2)
    whole = train(tmp_path / "whole", devices=2, zero_stage=2)
    resumed = train(tmp_path / "resumed", devices=2, ckpt_path=checkpoint, zero_stage=2)
    for w, r in zip(whole, resumed, strict=True):
        assert r["global_step"] == STEPS
        assert r["losses"] == w["losses"][HALF:]
        for name, value in w["params"].items():
            assert torch.equal(r["params"][name], value), name


@pytest.mark.timeout(120)
def test_one_device_checkpoint_resumes_with_zero3(tmp_path, reference):
    """A plain file (one device, or lp-consolidate's output): each rank cuts its rows from the whole tensors."""
    checkpoint = half_run(tmp_path / "one", devices=1)
    assert_continues(train(tmp_path / "dp2", devices=2, ckpt_path=checkpoint, zero_stage=3), reference)


@pytest.mark.timeout(120)
def test_zero3_pp2_dp2_checkpoint_with_a_tied_head_resumes_on_dp2(tmp_path, reference):
    """The embedding and the head it is tied to are on two stages, each writing the same rows once."""
    checkpoint = half_run(tmp_path / "saved", devices=4, pp=2, zero_stage=3)
    assert_continues(train(tmp_path / "dp2", devices=2, ckpt_path=checkpoint), reference)


@pytest.mark.timeout(180)
def test_hsdp_checkpoint_holds_each_row_once_and_resumes_on_another_shard_size(tmp_path, reference):
    """Under hybrid sharding the two shard groups hold the same rows: each is written once (DCP's planning
    keeps one writer of a chunk). Saved with ZeRO-3 in shard groups of 2, resumed with ZeRO-2 in shard groups
    of 1 (every rank its whole model), each rank reading its rows of the directory."""
    checkpoint = half_run(tmp_path / "saved", devices=4, zero_stage=3, zero_shard_size=2)
    metadata = read_metadata(checkpoint)
    for fqn, stored in metadata.state_dict_metadata.items():
        if hasattr(stored, "chunks"):
            assert sum(chunk.sizes.numel() for chunk in stored.chunks) == stored.size.numel(), fqn
    assert_continues(train(tmp_path / "resumed", devices=4, ckpt_path=checkpoint, zero_stage=2, zero_shard_size=1),
                     reference)
