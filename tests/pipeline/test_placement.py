"""A model built with real values is split before it reaches the accelerator: each rank moves its own
stage and shards to its device, never the whole model, and starts from rank 0's initial values.

Device allocations are counted where the strategy moves the module (``model_to_device``): the bytes
of the module's parameters and buffers at that moment, i.e. what ``.to(root_device)`` copies from
the CPU on an accelerator run. On these CPU runs the move itself is a no-op, so the count is the
accounting, not a measurement of an allocator.

Initial values are compared for exact equality: the broadcast copies rank 0's tensors bit for bit
and a TP shard is a slice of them. Each worker first adds its rank to every parameter, as processes
that each build the model unseeded (``start_method="popen"``, torchrun) would differ; only rank 0's
values may survive.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_parallel import ParallelStrategy
from lightning_parallel.models.gpt import GPT
from lightning_parallel.tensor_parallel.shard import slice_shard
from tests.checkpoint.test_checkpoint import StepData


def tiny_gpt() -> GPT:
    return GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct parameters and buffers (tied weights once)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class _CountingStrategy(ParallelStrategy):
    """Records the bytes each ``model_to_device`` call would copy, after making ranks' values differ."""

    def __init__(self, out: Path, **kwargs):
        super().__init__(**kwargs)
        self.out, self.moved = out, []

    def setup(self, trainer):
        with torch.no_grad():
            for p in self.lightning_module.parameters():
                p.add_(self.global_rank)
        super().setup(trainer)

    def model_to_device(self) -> None:
        self.moved.append(module_bytes(self.model))
        super().model_to_device()


class _Placement(Callback):
    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        values = {n: (p.detach().clone(), getattr(p, "tp_shard", None))
                  for n, p in pl_module.named_parameters(remove_duplicate=False)}
        record = {"moved": strategy.moved, "local": module_bytes(pl_module), "values": values,
                  "tp": (strategy.mesh.tp_rank, strategy.mesh.tp_size)}
        torch.save(record, strategy.out / f"rank{trainer.global_rank}.pt")


def _fit(out: Path, tp: int, pp: int) -> tuple[dict, int, list[dict]]:
    devices = tp * pp
    L.seed_everything(7)
    model = tiny_gpt()
    initial = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    whole = module_bytes(model)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=_CountingStrategy(out, tensor_parallel=tp, pipeline_parallel=pp, start_method="fork", timeout=60),
        callbacks=[_Placement()],
    )
    trainer.fit(model, datamodule=StepData())
    return initial, whole, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_each_rank_moves_only_its_stage_and_shards_to_its_device(tmp_path, tp, pp):
    """TP=2 or PP=2: the only move is of what the rank keeps, and that is well under the whole model.

    Bound: TP halves every matrix and the vocabulary (LayerNorms stay whole), PP keeps two of four
    blocks plus the embedding or the head; measured 0.513 (TP) and 0.515-0.523 (PP) of the whole model.
    """
    _, whole, ranks = _fit(tmp_path, tp, pp)
    for rank in ranks:
        assert rank["moved"] == [rank["local"]]
        assert rank["local"] < 0.6 * whole


@pytest.mark.timeout(90)
def test_tp2_pp2_ranks_never_move_the_whole_model_and_start_from_rank0_values(tmp_path):
    """TP=2 x PP=2: each rank first moves its TP shards (the pipeline trace runs TP collectives, which
    need the device), at most 0.6 of the whole model, then keeps only its stage (measured 0.513, then
    0.262-0.270). Every kept value is rank 0's, though the ranks' own values differed before setup."""
    initial, whole, ranks = _fit(tmp_path, tp=2, pp=2)
    for rank in ranks:
        assert max(rank["moved"]) < 0.6 * whole
        assert rank["moved"][-1] == rank["local"] < 0.35 * whole
        tp_rank, tp_size = rank["tp"]
        for name, (value, shard) in rank["values"].items():
            expected = initial[name] if shard is None else slice_shard(initial[name], shard, tp_rank, tp_size)
            assert torch.equal(value, expected), name
