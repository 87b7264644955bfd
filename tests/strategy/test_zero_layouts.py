"""ZeRO-2 and ZeRO-3 composed with tensor and pipeline parallelism reproduce one device, step by step.

Each layout trains the tiny GPT (tied embedding and head) with gradient accumulation and clipping by
the global norm. Tolerances as in test_3d.py: the split runs re-associate float32 sums (row-parallel
partial sums, micro-batch means, tied sums across stages, reduce-scatters), so losses agree to 1e-5
and parameters after AdamW to the documented 1e-4; a shard not reduced, a tied weight not summed or a clip on a
local norm moves losses by >1e-3 and parameters by about the learning rate (1e-2).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_parallel import ParallelStrategy
from lightning_parallel.models.gpt import GPT
from tests.helpers.parity import (
    LOSS_BOUND,
    PARAM_BOUND,
    ReplicaBatches,
    _Recorder,
    assert_close_series,
    assert_param_close,
    fit_and_record,
    mean_over_ranks,
)
from tests.strategy.test_3d import HFTokens, ShardRecorder, gather_records, token_data

LOSS_TOL = LOSS_BOUND  # the documented float32 parity bound (tests/helpers/parity.py)
PARAM_TOL = PARAM_BOUND


def tiny_gpt() -> GPT:
    return GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, lr=1e-2)


def fit_layout(tmp_path, dp: int, tp: int, pp: int, stage: int, schedule: str = "1f1b", callbacks=(),
               model=tiny_gpt, shard_size=None, **kwargs) -> list[dict]:
    L.seed_everything(0)
    strategy = ParallelStrategy(data_parallel=dp, tensor_parallel=tp, pipeline_parallel=pp, zero_stage=stage,
                                zero_shard_size=shard_size, micro_batches=4 if pp > 1 else None, schedule=schedule,
                                start_method="fork")
    recs = fit_and_record(model(), token_data(), batch_size=4, out_dir=str(tmp_path / "run"), devices=dp * tp * pp,
                          strategy=strategy, callbacks=[ShardRecorder(str(tmp_path)), *callbacks], **kwargs)
    for r, rec in enumerate(recs):
        rec["shards"] = torch.load(str(tmp_path / f"shards{r}.pt"), weights_only=False)
    return recs


def assert_matches_one_device(tmp_path, recs: list[dict], dp: int, tp: int, pp: int, model=tiny_gpt,
                              **kwargs) -> None:
    L.seed_everything(0)
    ref = fit_and_record(model(), token_data(), batch_size=4 * dp, out_dir=str(tmp_path / "ref"),
                         emulate_replicas=dp, **kwargs)[0]
    rank = lambda p, d, t: (p * dp + d) * tp + t  # noqa: E731 - the mesh's order
    # every rank of a pipeline returns its replica's loss: the mean over the replicas is one device's
    assert_close_series(mean_over_ranks([recs[rank(0, d, 0)] for d in range(dp)]), ref["losses"], atol=LOSS_TOL)
    assert ref["losses"][-1] < ref["losses"][0]
    replica = [recs[rank(p, 0, t)] for p in range(pp) for t in range(tp)]  # stage by stage, shard by shard
    if tp > 1:
        full = gather_records(replica)
    else:
        full = {name: value for rec in replica for name, value in rec["params"].items()}
    assert set(full) == set(ref["params"])
    for name, expected in ref["params"].items():
        assert_param_close(full[name], expected, atol=PARAM_TOL, name=name)


TRAINING = dict(max_steps=3, gradient_clip_val=0.1, accumulate_grad_batches=2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_dp2_tp2_matches_single_device(tmp_path, stage):
    recs = fit_layout(tmp_path, dp=2, tp=2, pp=1, stage=stage, **TRAINING)
    assert_matches_one_device(tmp_path, recs, dp=2, tp=2, pp=1, **TRAINING)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage, schedule", [(2, "1f1b"), (3, "zb_h1")])
def test_zero_dp2_pp2_matches_single_device(tmp_path, stage, schedule):
    recs = fit_layout(tmp_path, dp=2, tp=1, pp=2, stage=stage, schedule=schedule, **TRAINING)
    assert_matches_one_device(tmp_path, recs, dp=2, tp=1, pp=2, **TRAINING)


@pytest.mark.timeout(240)
def test_zero3_dp2_tp2_pp2_matches_single_device(tmp_path):
    recs = fit_layout(tmp_path, dp=2, tp=2, pp=2, stage=3, **TRAINING)
    assert_matches_one_device(tmp_path, recs, dp=2, tp=2, pp=2, **TRAINING)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage, tp, pp", [(2, 2, 1), (3, 1, 2)])
def test_hsdp_composed_with_tp_or_pp_matches_single_device(tmp_path, stage, tp, pp):
    """Hybrid sharding under TP or PP on 4 processes: two replicas, each its own shard group
    (``zero_shard_size=1``), so the gradients cross the replicate dimension of the 2-D mesh by all-reduce
    (after the pipeline's last micro-batch under PP), and the global norm counts each shard once."""
    recs = fit_layout(tmp_path, dp=2, tp=tp, pp=pp, stage=stage, shard_size=1, **TRAINING)
    assert_matches_one_device(tmp_path, recs, dp=2, tp=tp, pp=pp, **TRAINING)


# what FSDP2 gathers a unit's parameters with (torch 2.13 renamed all_gather_into_tensor)
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@pytest.mark.timeout(180)
def test_zero3_dp2_pp2_hf_llama_matches_single_device(tmp_path):
    """A model we did not write: the Hugging Face Llama, its decoder layers the units."""
    recs = fit_layout(tmp_path, dp=2, tp=1, pp=2, stage=3, model=HFTokens, **TRAINING)
    assert_matches_one_device(tmp_path, recs, dp=2, tp=1, pp=2, model=HFTokens, **TRAINING)


class AllGathers(L.Callback):
    """Count the all-gathers of each training step (FSDP2 gathers a unit's parameters with one)."""

    def __init__(self, out_dir):
        self.out_dir, self.counts, self.original = out_dir, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.original, counts = getattr(dist, GATHER), self.counts
        counts.append(0)

        def counted(*args, **kwargs):
            counts[-1] += 1
            return self.original(*args, **kwargs)

        setattr(dist, GATHER, counted)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        setattr(dist, GATHER, self.original)

    def on_train_end(self, trainer, pl_module):
        torch.save(self.counts, f"{self.out_dir}/gathers{trainer.global_rank}.pt")


@pytest.mark.timeout(120)
def test_zero3_under_pp_gathers_each_unit_once_per_step_whatever_the_micro_batches(tmp_path):
    """Under pipeline parallelism a stage runs 4 forwards and 4 backwards per step here; its parameters
    are gathered at the first and kept (``FullySharded(keep_gathered=True)``): one all-gather per unit
    (2 blocks, and the root: embeddings or final norm and head). Without pipelining ZeRO-3 gathers each
    block for its forward and again for its backward, ZeRO-2 once."""
    fit_layout(tmp_path / "pp", dp=2, tp=1, pp=2, stage=3, callbacks=[AllGathers(str(tmp_path))], max_steps=2)
    assert [torch.load(tmp_path / f"gathers{r}.pt") for r in range(4)] == [[2 + 1] * 2] * 4
    for stage, gathers in ((3, 1 + 4 + 4), (2, 1 + 4)):  # the root, the 4 blocks' forwards, their backwards
        fit_layout(tmp_path / f"dp{stage}", dp=2, tp=1, pp=1, stage=stage, callbacks=[AllGathers(str(tmp_path))],
                   max_steps=2)
        assert [torch.load(tmp_path / f"gathers{r}.pt") for r in range(2)] == [[gathers] * 2] * 2


def _fit_validating_every_batch(out, devices: int, strategy, loader) -> tuple[list[dict], float]:
    out.mkdir()
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=3, logger=False,
                        accumulate_grad_batches=2, val_check_interval=1, gradient_clip_val=0.1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[_Recorder(str(out))])
    model, val = tiny_gpt(), DataLoader(token_data(8), batch_size=4)  # one batch per replica
    trainer.fit(model, loader, val)
    metrics = trainer.validate(model, val, verbose=False)[0]
    return [torch.load(out / f"rank{r}.pt") for r in range(devices)], metrics["val_loss"]


@pytest.mark.timeout(180)
def test_zero3_under_pp_validates_inside_an_accumulation_window_and_after_fit_like_one_device(tmp_path):
    """Validation after every batch falls inside accumulation windows: the stage's gathered parameters are
    freed for it and gathered again, and the gradients the window accumulated stay. Then a second
    Trainer call (validate) splits and shards the trained model again."""
    data = token_data()
    (ref,), ref_val = _fit_validating_every_batch(tmp_path / "one", 1, "auto",
                                                   DataLoader(data, batch_sampler=ReplicaBatches(len(data), 2, 4)))
    strategy = ParallelStrategy(data_parallel=2, pipeline_parallel=2, zero_stage=3, start_method="fork")
    recs, val = _fit_validating_every_batch(tmp_path / "z3", 4, strategy, DataLoader(data, batch_size=4))
    assert_close_series(mean_over_ranks(recs[:2]), ref["losses"], atol=LOSS_TOL)  # ranks 0, 1: stage 0's replicas
    full = {**recs[0]["params"], **recs[2]["params"]}  # stage 0 and stage 1 of replica 0
    for name, expected in ref["params"].items():
        assert_param_close(full[name], expected, atol=PARAM_TOL, name=name)
    assert val == pytest.approx(ref_val, abs=LOSS_TOL)
