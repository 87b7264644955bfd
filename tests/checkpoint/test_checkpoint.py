"""Sharded checkpoints: resume on the same or another layout, consolidation, and mismatch errors.

Every run trains the tiny GPT for 6 steps on the same global batches: step s reads global batch s,
split evenly over the data-parallel ranks, and a resumed run picks up at its restored global step
(``StepBatches``), so an interrupted run sees exactly the data of an uninterrupted one.

Tolerances. Resuming on the SAME layout repeats the same float32 arithmetic, so losses and
parameters must be bit-identical. On ANOTHER layout the sums inside matmuls and reductions are
associated differently (~1e-7 relative per op); losses of a 6-step run then agree with one device
to ~1e-6 (measured: at most 4.8e-7), hence LOSS_TOL = 1e-5. Parameters use the documented bound, PARAM_TOL = 1e-4, as the
pipeline tests do (measured: at most 5.7e-6): Adam turns rounding noise on near-zero gradients
into updates of up to the learning rate. A checkpoint that loses the optimizer state, the
learning rate or a shard moves the losses after resuming by far more (measured: resuming TP2 x
PP2 -> DP4 without the optimizer state is off by 2.1e-2 in loss and 1.5e-2 in parameters).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Sampler

from lightning_parallel import ParallelStrategy
from lightning_parallel.checkpoint import CheckpointMismatchError, load_sharded
from lightning_parallel.checkpoint.format import (
    Piece,
    full_optimizer_state,
    full_tensor,
    local_tensor,
)
from lightning_parallel.cli.consolidate import main as consolidate_main
from lightning_parallel.models.gpt import GPT
from lightning_parallel.tensor_parallel.shard import TPShard, merge_shards, slice_shard
from tests.helpers.parity import (
    LOSS_BOUND,
    PARAM_BOUND,
    TensorDataset,
    _Recorder,
    assert_close_series,
    assert_params_close,
    mean_over_ranks,
)
from tests.helpers.processes import make_mesh, run_distributed

STEPS, HALF, GLOBAL_BATCH, SEQ, VOCAB = 6, 3, 8, 16, 64
LOSS_TOL = dict(atol=LOSS_BOUND, rtol=0.0)
PARAM_TOL = dict(atol=PARAM_BOUND, rtol=0.0)

_g = torch.Generator().manual_seed(1)
_tokens = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ + 1), generator=_g)
DATASET = TensorDataset(_tokens[:, :-1].contiguous(), _tokens[:, 1:].contiguous())


class StepBatches(Sampler):
    """Global batch ``s`` at global step ``s``; this data-parallel rank reads its slice of it."""

    def __init__(self, start: int, dp_rank: int, dp_size: int):
        self.start, self.dp_rank, self.per_rank = start, dp_rank, GLOBAL_BATCH // dp_size

    def __len__(self) -> int:
        return STEPS - self.start

    def __iter__(self):
        for step in range(self.start, STEPS):
            first = step * GLOBAL_BATCH + self.dp_rank * self.per_rank
            yield list(range(first, first + self.per_rank))


class StepData(L.LightningDataModule):
    def train_dataloader(self):
        mesh = getattr(self.trainer.strategy, "mesh", None)
        dp_rank, dp_size = (mesh.dp_rank, mesh.dp_size) if mesh is not None else (0, 1)
        return DataLoader(DATASET, batch_sampler=StepBatches(self.trainer.global_step, dp_rank, dp_size))


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(**{**dict(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=32), **overrides})


def train(out: Path, devices: int = 1, tp: int = 1, pp: int = 1, steps: int = STEPS, ckpt_path=None,
          save_to: Path | None = None, checkpoint: ModelCheckpoint | None = None, plugins: list | None = None,
          build=None, **strategy_args) -> list[dict]:
    """Fit the tiny GPT (or ``build()``) to ``steps``; with ``save_to``, a ModelCheckpoint keeps the latest
    step there (``checkpoint`` replaces that callback); ``plugins`` go to the Trainer."""
    strategy = "auto" if devices == 1 else ParallelStrategy(
        tensor_parallel=tp, pipeline_parallel=pp, start_method="fork", timeout=60, **strategy_args
    )
    callbacks = [_Recorder(str(out))]
    if checkpoint is None and save_to is not None:
        checkpoint = ModelCheckpoint(dirpath=save_to, every_n_train_steps=1, save_top_k=1)
    if checkpoint is not None:
        callbacks.append(checkpoint)
    os.makedirs(out, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=checkpoint is not None, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=callbacks, default_root_dir=str(out), plugins=plugins,
    )
    trainer.fit((build or tiny_gpt)(), datamodule=StepData(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def half_run(out: Path, devices: int, tp: int = 1, pp: int = 1, **train_args) -> Path:
    """Train the first HALF steps on a layout; return the single checkpoint ModelCheckpoint kept."""
    train(out / "run", devices, tp, pp, steps=HALF, save_to=out / "ckpt", **train_args)
    kept = sorted((out / "ckpt").iterdir())
    assert [p.name for p in kept] == [f"epoch=0-step={HALF}.ckpt"], kept  # older ones were removed
    return kept[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run on one device."""
    return train(tmp_path_factory.mktemp("reference"))[0]


@pytest.fixture(scope="module")
def tp2pp2_checkpoint(tmp_path_factory) -> Path:
    return half_run(tmp_path_factory.mktemp("tp2pp2"), devices=4, tp=2, pp=2)


def assert_continues(records: list[dict], reference: dict) -> None:
    assert_close_series(mean_over_ranks(records), reference["losses"][HALF:], **LOSS_TOL)
    for record in records:
        assert_params_close(record["params"], reference["params"], **PARAM_TOL)


@pytest.mark.timeout(60)
def test_resume_on_same_layout_continues_exactly(tmp_path, tp2pp2_checkpoint):
    uninterrupted = train(tmp_path / "whole", devices=4, tp=2, pp=2)
    resumed = train(tmp_path / "resumed", devices=4, tp=2, pp=2, ckpt_path=tp2pp2_checkpoint)
    for whole, part in zip(uninterrupted, resumed, strict=True):
        assert part["losses"] == whole["losses"][HALF:]
        assert part["global_step"] == STEPS
        assert part["params"].keys() == whole["params"].keys()
        for name, value in whole["params"].items():
            assert torch.equal(part["params"][name], value), name


@pytest.mark.timeout(60)
def test_tp2_pp2_checkpoint_resumes_on_dp4_with_uninterrupted_losses(tmp_path, tp2pp2_checkpoint, reference):
    assert_continues(train(tmp_path, devices=4, ckpt_path=tp2pp2_checkpoint), reference)


@pytest.mark.timeout(60)
def test_tp2_checkpoint_resumes_on_pp2_with_uninterrupted_losses(tmp_path, reference):
    checkpoint = half_run(tmp_path / "tp2", devices=2, tp=2)
    assert_continues(train(tmp_path / "pp2", devices=2, pp=2, ckpt_path=checkpoint), reference)


@pytest.mark.timeout(90)
def test_8_rank_checkpoint_resumes_on_2_ranks_with_uninterrupted_losses(tmp_path, reference):
    checkpoint = half_run(tmp_path / "tp2pp2dp2", devices=8, tp=2, pp=2)
    assert_continues(train(tmp_path / "pp2", devices=2, pp=2, ckpt_path=checkpoint), reference)


@pytest.mark.timeout(60)
def test_consolidated_checkpoint_loads_in_unchanged_module_and_back(tmp_path, tp2pp2_checkpoint, reference):
    plain = tmp_path / "plain.ckpt"
    consolidate_main([str(tp2pp2_checkpoint), str(plain)])
    # the user's module, on one device, without lightning_parallel
    model = GPT.load_from_checkpoint(plain)
    x, y = DATASET[HALF * GLOBAL_BATCH:(HALF + 1) * GLOBAL_BATCH]
    with torch.no_grad():
        loss = model._loss((x, y)).item()
    assert loss == pytest.approx(reference["losses"][HALF], abs=LOSS_TOL["atol"])
    # resuming from it on one device continues the run (optimizer state in configure_optimizers order)
    assert_continues(train(tmp_path / "one", ckpt_path=plain), reference)
    # and back: the plain file resumes on a pipeline, whose stages need the optimizer's parameter names
    assert_continues(train(tmp_path / "pp2", devices=2, pp=2, ckpt_path=plain), reference)


@pytest.mark.timeout(60)
def test_interleaved_pipeline_checkpoint_consolidates_in_single_device_order(tmp_path, reference):
    """Rank 0 of an interleaved pipeline holds stages 0 and 2: the optimizer's parameters are put
    back in the unsplit model's order by (stage, position), not by rank."""
    checkpoint = half_run(tmp_path / "interleaved", devices=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2,
                          micro_batches=4)
    plain = tmp_path / "plain.ckpt"
    consolidate_main([str(checkpoint), str(plain)])
    assert_continues(train(tmp_path / "one", ckpt_path=plain), reference)


def checkpoint_before_dcp(plain: Path, folder: Path) -> Path:
    """The consolidated checkpoint ``plain`` as the format before DCP wrote it for two pipeline stages:
    ``meta.pt`` and a ``pp<p>-tp000.pt`` per stage with its tensors, layouts, optimizer state by name
    and order; without completion marker, as written before markers existed."""
    saved = torch.load(plain, weights_only=False)
    tensors = saved["state_dict"]
    names = list(tensors)
    stages = [names[: len(names) // 2], names[len(names) // 2:]]
    folder.mkdir(parents=True)
    for stage, part in enumerate(stages):
        optimizers = []
        for optimizer in saved["optimizer_states"]:
            groups = optimizer["param_groups"]
            optimizers.append({
                "state": {n: optimizer["state"][i] for g in groups for i, n in zip(g["params"], g["param_names"])
                          if n in part and i in optimizer["state"]},
                "param_groups": [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                                  "params": [n for n in g["param_names"] if n in part]} for g in groups],
            })
        torch.save({"tp_rank": 0, "tp_size": 1, "tensors": {n: tensors[n] for n in part},
                    "layouts": {n: (tuple(tensors[n].shape), None) for n in part}, "optimizers": optimizers,
                    "order": {n: (stage, i) for i, n in enumerate(part)}}, folder / f"pp{stage:03d}-tp000.pt")
    meta = {k: v for k, v in saved.items() if k not in ("state_dict", "optimizer_states")}
    meta["lightning_parallel"] = {"format_version": 1, "layout": {"tensor_parallel": 1, "pipeline_parallel": 2,
                                                                  "data_parallel": 1}}
    torch.save(meta, folder / "meta.pt")
    return folder


@pytest.mark.timeout(60)
def test_checkpoint_in_the_format_before_dcp_still_resumes(tmp_path, tp2pp2_checkpoint, reference):
    plain = tmp_path / "plain.ckpt"
    consolidate_main([str(tp2pp2_checkpoint), str(plain)])
    old = checkpoint_before_dcp(plain, tmp_path / "old.ckpt")
    assert_continues(train(tmp_path / "dp2", devices=2, ckpt_path=old), reference)


def _load_into(rank, world_size, checkpoint, overrides):
    mesh = make_mesh(rank, world_size)
    model = tiny_gpt(**overrides)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    strategy = SimpleNamespace(mesh=mesh, lightning_module=model, pipeline=None, optimizers=[],
                               broadcast=lambda obj, src=0: obj, root_device=torch.device("cpu"))
    try:
        load_sharded(strategy, checkpoint)
    except CheckpointMismatchError as err:
        unchanged = all(torch.equal(before[n], t) for n, t in model.state_dict().items())
        return str(err), unchanged
    return None, True


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(vocab_size=80), "transformer.wte.weight: shape [80, 32] in the model but [64, 32] in the checkpoint"),
        (dict(n_layer=5),
         "transformer.h.4.attn.c_attn.weight: in the model (shape [96, 32]) but not in the checkpoint"),
        (dict(n_layer=3), "transformer.h.3.mlp.c_fc.bias: in the checkpoint (shape [128]) but not in the model"),
    ],
)
def test_mismatched_checkpoint_fails_on_every_rank_naming_the_parameter(tp2pp2_checkpoint, overrides, expected):
    results = run_distributed(_load_into, 2, tp2pp2_checkpoint, overrides)
    for message, unchanged in results:
        assert message is not None and expected in message
        assert unchanged


def test_pieces_reshard_onto_any_tp_size():
    """A fused QKV weight, a padded vocabulary and Adam state saved on TP2 reload on TP1 and TP3."""
    torch.manual_seed(0)
    cases = [(torch.randn(18, 4), TPShard(dim=0, fused=3)), (torch.randn(5, 4), TPShard(dim=0, full_size=5))]
    for full, shard in cases:
        pieces = [
            Piece(r, 2, {"w": slice_shard(full, shard, r, 2)}, {"w": (tuple(full.shape), shard)},
                  [{"state": {"w": {"step": torch.tensor(3.0), "exp_avg": slice_shard(2 * full, shard, r, 2)}},
                    "param_groups": [{"lr": 0.1, "params": ["w"]}]}])
            for r in range(2)
        ]
        assert torch.equal(full_tensor("w", pieces), full)
        state = full_optimizer_state("w", 0, pieces, (tuple(full.shape), shard))
        assert torch.equal(state["exp_avg"], 2 * full) and state["step"] == 3
        for tp_size in (1, 3):
            shards = [local_tensor(full_tensor("w", pieces), shard, r, tp_size) for r in range(tp_size)]
            assert torch.equal(merge_shards(shards, shard), full)
