"""On CUDA with NCCL, DP, TP, PP and 3D reproduce one GPU, and each rank's peak memory is near the estimate.

Run on a GPU node with ``bash scripts/gpu_check.sh`` (``pytest -m cuda tests/test_cuda.py``); each test
skips, naming the count it needs, where fewer GPUs are visible, so collection on a CPU machine skips them
all. A fit runs this file as a script in a subprocess (``python tests/test_cuda.py LAYOUT OUT PRECISION``):
Lightning's default ``popen`` launcher starts the other ranks by running the same command again, which
needs no fork of a process that has touched CUDA. Every rank writes its losses, parameters and peak
memory to ``OUT``; the test compares them with a one-GPU reference run of the same global batches.

Tolerances. float32: the split run sums the same products in another order (row-parallel partial sums,
micro-batch means, NCCL's reduction order), and cuBLAS picks its kernels (split-K or not) by matrix
shape, so a sharded matmul rounds differently from the whole one: losses within 1e-4 and parameters
within 2e-4, ten times the CPU tests' bounds (tests/test_3d.py); a real error (a shard or replica not
reduced, a tied weight not summed) moves losses by more than 1e-3 and parameters by about the learning
rate. bf16-mixed: 8 bits of mantissa, so the first loss within 1e-2 and the next within 5e-2, as in
tests/test_pp_training.py. Memory: ``torch.cuda.max_memory_allocated`` over training, divided by
``estimate.estimate_memory``, within [0.75, 1.5]: the estimate counts parameters, gradients, AdamW state
and activations, not AdamW's foreach temporaries (a copy of the second moments, +25% of the 16 bytes per
parameter), the pipeline's receive buffers or cuBLAS workspaces; the model is sized so that parameter
state dominates. These bounds are reasoned, not yet measured on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CUDA_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

# name: (GPUs, strategy options, data-parallel replicas)
LAYOUTS = {
    "dp2": (2, dict(data_parallel=2), 2),
    "tp2": (2, dict(tensor_parallel=2), 1),
    "pp2": (2, dict(pipeline_parallel=2, micro_batches=2), 1),
    "3d": (8, dict(data_parallel=2, tensor_parallel=2, pipeline_parallel=2, micro_batches=2), 2),
}
PER_RANK_BATCH = 4
STEPS = 4
LOSS_TOL, PARAM_TOL = 1e-4, 2e-4
MEMORY_MARGIN = (0.75, 1.5)
SMALL_GPT = dict(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, lr=1e-2)
# parameter state (16 bytes per parameter in float32) well above activations: ~17M parameters per stage
MEMORY_GPT = dict(vocab_size=8192, block_size=64, n_layer=8, n_head=8, n_embd=512)
MEMORY_BATCH = 4  # per replica: two micro-batches of two sequences of 64 tokens


def needs_gpus(n: int):
    return pytest.mark.skipif(CUDA_GPUS < n, reason=f"needs {n} CUDA GPUs, {CUDA_GPUS} visible")


# ---- the script: one fit, run by the test in a subprocess (and by Lightning again for each other rank) ----


def _fit(layout: str, out: str, precision: str) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_parallel import ParallelStrategy
    from lightning_parallel.models.gpt import GPT
    from tests.helpers.parity import ReplicaBatches, _Recorder
    from tests.strategy.test_3d import ShardRecorder, token_data

    class PeakMemory(L.Callback):
        def on_train_start(self, trainer, pl_module):
            torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, trainer, pl_module):
            torch.save(torch.cuda.max_memory_allocated(), os.path.join(out, f"peak{trainer.global_rank}.pt"))

    memory = layout.startswith("memory-")
    layout = layout.removeprefix("memory-")
    L.seed_everything(0)
    module = GPT(**(MEMORY_GPT if memory else SMALL_GPT))
    data = token_data(n=64, vocab=module.hparams.vocab_size, seq=module.hparams.block_size)
    if layout.startswith("single"):  # single-<replicas>: one GPU reads what that many replicas read (shuffled)
        replicas = int(layout.split("-")[1])
        devices, strategy = 1, "auto"
        loader = DataLoader(data, batch_sampler=ReplicaBatches(len(data), replicas, PER_RANK_BATCH))
    else:
        devices, options, _ = LAYOUTS[layout]
        strategy = ParallelStrategy(**options)
        loader = DataLoader(data, batch_size=MEMORY_BATCH if memory else PER_RANK_BATCH)
    trainer = L.Trainer(
        accelerator="gpu", devices=devices, strategy=strategy, precision=precision, max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[_Recorder(out), ShardRecorder(out), PeakMemory()],
    )
    trainer.fit(module, loader)


def run_fit(layout: str, out, precision: str = "32-true") -> list[dict]:
    """Fit in a subprocess; one record per rank (losses, params, shards, peak)."""
    os.makedirs(out, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, os.path.abspath(__file__), layout, str(out), precision], check=True,
                   timeout=600, env=env, cwd=here)
    name = layout.removeprefix("memory-")
    devices = 1 if name.startswith("single") else LAYOUTS[name][0]
    records = []
    for r in range(devices):
        record = torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False)
        record["shards"] = torch.load(os.path.join(out, f"shards{r}.pt"), weights_only=False)
        record["peak"] = torch.load(os.path.join(out, f"peak{r}.pt"))
        records.append(record)
    return records


# ---- the tests ----


def replica_losses(layout: str, records: list[dict]) -> list[float]:
    """Mean over replicas of the loss each reports (every rank of a replica reports its replica's loss)."""
    from tests.helpers.parity import mean_over_ranks

    return mean_over_ranks([records[0], records[2]] if layout == "3d" else records)


def full_parameters(layout: str, records: list[dict]) -> dict:
    """Replica 0's parameters merged over its TP shards and pipeline stages."""
    from tests.strategy.test_3d import gather_records

    if layout == "dp2":
        return records[0]["params"]
    if layout == "3d":
        return gather_records([records[0], records[1], records[4], records[5]])
    return gather_records(records)


@pytest.mark.cuda
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [pytest.param(name, marks=needs_gpus(LAYOUTS[name][0])) for name in LAYOUTS])
def test_nccl_layout_matches_one_gpu_step_by_step(tmp_path, layout):
    from tests.helpers.parity import assert_close_series, assert_param_close

    reference = run_fit(f"single-{LAYOUTS[layout][2]}", tmp_path / "ref")[0]
    records = run_fit(layout, tmp_path / layout)
    assert_close_series(replica_losses(layout, records), reference["losses"], atol=LOSS_TOL)
    assert reference["losses"][-1] < reference["losses"][0]
    full = full_parameters(layout, records)
    assert set(full) == set(reference["params"])
    for name, expected in reference["params"].items():
        assert_param_close(full[name], expected, atol=PARAM_TOL, name=name)


@pytest.mark.cuda
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [pytest.param(name, marks=needs_gpus(2)) for name in ("tp2", "pp2")])
def test_bf16_mixed_on_nccl_tracks_one_gpu(tmp_path, layout):
    reference = run_fit(f"single-{LAYOUTS[layout][2]}", tmp_path / "ref", "bf16-mixed")[0]
    losses = replica_losses(layout, run_fit(layout, tmp_path / layout, "bf16-mixed"))
    assert losses[0] == pytest.approx(reference["losses"][0], abs=1e-2)
    assert losses == pytest.approx(reference["losses"], abs=5e-2)


@pytest.mark.cuda
@pytest.mark.timeout(900)
@needs_gpus(2)
def test_peak_memory_per_pipeline_rank_is_within_margin_of_the_estimate(tmp_path):
    from lightning_parallel.checks.model import check_model
    from lightning_parallel.mesh import ParallelMesh
    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.options import ParallelOptions
    from lightning_parallel.planner.estimate import (
        estimate_memory,
        tp_sharded_parameters,
    )

    records = run_fit("memory-pp2", tmp_path / "pp2")
    with torch.device("meta"):
        model = GPT(**MEMORY_GPT)
    assignments, stages = check_model(model, ParallelMesh(2, pipeline_parallel=2), ParallelOptions(pipeline_parallel=2))
    micro_batches = LAYOUTS["pp2"][1]["micro_batches"]
    estimate = estimate_memory(model, stages, tp_sharded_parameters(assignments), 1, MEMORY_GPT["block_size"],
                               MEMORY_BATCH // micro_batches, micro_batches, "1f1b", False, "32-true")
    for rank, (record, expected) in enumerate(zip(records, estimate)):
        ratio = record["peak"] / expected.total_bytes
        assert MEMORY_MARGIN[0] <= ratio <= MEMORY_MARGIN[1], (
            f"pipeline rank {rank}: peak {record['peak'] / 2**20:.0f} MiB, estimate "
            f"{expected.total_bytes / 2**20:.0f} MiB (ratio {ratio:.2f})"
        )


if __name__ == "__main__":
    _fit(*sys.argv[1:4])
