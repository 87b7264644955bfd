"""``strategy=auto``: the layout a strategy trains with when its sizes say ``"auto"``.

Every rank computes the same choice from the same inputs (the model, the world, the batch shape,
nominal rates for the device kind, the device's memory), before any collective: no rank waits for
another, and a model that fits no layout fails on every rank with the same message. Rates are not
measured here because a measurement differs between ranks and runs, and the choice must not; the
ranking depends mostly on the ratios between compute and links, which the nominal rates of
``calibrate.NOMINAL`` keep. ``lp-plan --search`` ranks with measured rates; pin its choice with the
overrides it prints.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch
from torch import nn

from lightning_parallel.options import AUTO, ParallelOptions
from lightning_parallel.planner.calibrate import nominal
from lightning_parallel.planner.search import (
    SearchResult,
    explain,
    format_table,
    search,
)
from lightning_parallel.planner.space import Cluster, Constraints, Workload


def constraints(options: ParallelOptions) -> Constraints:
    """What the options fix: sizes given as numbers; ``"auto"`` (``options.searched``) leaves them free."""

    def fixed(name: str):
        return None if name in options.searched else getattr(options, name)

    zero = fixed("zero_stage")
    dp = options.data_parallel
    return Constraints(
        tp=fixed("tensor_parallel"), pp=fixed("pipeline_parallel"), dp=None if dp == AUTO else dp,
        micro_batches=options.micro_batches, schedule=fixed("schedule"), virtual_stages=fixed("virtual_stages"),
        zero=None if zero is None else bool(zero),
        recompute=(False,),  # the strategy does not add activation checkpointing to a model
    )


def device_memory(kind: str, processes_per_node: int, device: Optional[torch.device] = None) -> float:
    """Bytes one process may use: the GPU's memory, or the host's memory shared by its processes."""
    if kind == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(device or 0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / processes_per_node


def choose(model: nn.Module, nodes: int, devices_per_node: int, kind: str, replica_batch: int, seq: int,
           precision: str, options: ParallelOptions, memory: Optional[float] = None) -> SearchResult:
    """The ranked layouts for a strategy whose ``options`` contain ``"auto"`` (raises ``PlanError``)."""
    cluster = Cluster(nodes, devices_per_node, memory or device_memory(kind, devices_per_node), nominal(kind),
                      shared_compute=kind != "cuda")
    work = Workload(seq=seq, precision=precision, replica_batch=replica_batch, options=options)
    return search(model, cluster, work, constraints(options))


def report(result: SearchResult, top: int = 5) -> str:
    """The table of the best layouts and why the first wins, as the strategy logs it."""
    return f"{format_table(result, top)}\n{explain(result)}"


def batch_shape(batch: Any) -> Optional[tuple[int, int]]:
    """(sequences, tokens per sequence) of a batch: the first tensor in it, (B, T, ...) or (B,)."""
    if isinstance(batch, torch.Tensor):
        return (batch.shape[0], batch.shape[1] if batch.dim() > 1 else 1) if batch.dim() else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((shape for shape in map(batch_shape, items) if shape is not None), None)


def training_shape(trainer: Any, strategy: Any) -> Optional[tuple[int, int]]:
    """(sequences per replica, tokens per sequence) of the run: a data module's ``batch_size`` and
    ``block_size`` hyperparameters (read before its ``setup``, which Lightning runs after the
    strategy's, as ``lp-plan`` reads ``data.batch_size`` and ``data.block_size``); without a data
    module, the first batch of the loader given to the Trainer or of the module's own hook."""
    from lightning_parallel.pipeline.example import first_batch

    if trainer.datamodule is not None:
        hparams = getattr(trainer.datamodule, "hparams", {})
        if hparams.get("batch_size") is None or hparams.get("block_size") is None:
            return None
        return int(hparams["batch_size"]), int(hparams["block_size"])
    return batch_shape(first_batch(trainer, strategy)[0])


def choose_for(strategy: Any, options: ParallelOptions) -> SearchResult:
    """The search of a ``ParallelStrategy`` at setup, from its module, world and batch shape
    (``training_shape``); rank 0 logs the table and why."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    from lightning_parallel.compat import attached_trainer
    from lightning_parallel.errors import LaunchError

    module = strategy.lightning_module
    trainer = attached_trainer(module) if module is not None else None
    shape = training_shape(trainer, strategy) if trainer is not None else None
    if shape is None:
        raise LaunchError(
            "ParallelStrategy sizes given as 'auto' are chosen for the model and its batch shape, which this "
            "Trainer call does not show: pass a DataLoader, or a data module whose hyperparameters "
            "(save_hyperparameters) include batch_size (per replica) and block_size (tokens per sequence); "
            "or give the sizes, e.g. ParallelStrategy(tensor_parallel=1, pipeline_parallel=1)"
        )
    kind = strategy.root_device.type
    result = choose(module, strategy.num_nodes, strategy.num_processes, kind, shape[0], shape[1],
                    str(trainer.precision), options, device_memory(kind, strategy.num_processes, strategy.root_device))
    rank_zero_info(f"strategy=auto chose {result.best.candidate.layout.describe()} of {len(result.ranked)} layouts "
                   f"that fit (planner/auto.py):\n{report(result)}")
    return result
