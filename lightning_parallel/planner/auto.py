"""``strategy=auto``: the layout a strategy trains with when its sizes say ``"auto"``.

The launching process chooses before any worker starts (``strategy/launcher.py``), reading the
batch shape from the data the run will use (``planner/batch.py``); where processes are started
externally (torchrun, srun) every rank computes the same choice from the same inputs (the model,
the world, the batch shape, nominal rates for the device kind, the device's memory), before any
collective: no rank waits for another, and a model that fits no layout fails on every rank with
the same message. Rates are not
measured here because a measurement differs between ranks and runs, and the choice must not; the
ranking depends mostly on the ratios between compute and links, which the nominal rates of
``calibrate.NOMINAL`` keep. ``lp-plan --search`` ranks with measured rates; pin its choice with the
overrides it prints.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import nn

from lightning_parallel.errors import Fix
from lightning_parallel.options import AUTO, ParallelOptions
from lightning_parallel.planner.batch import (
    BatchShapeUnknown,
    batch_shape,
    datamodule_shape,
    first_training_batch,
)
from lightning_parallel.planner.calibrate import nominal
from lightning_parallel.planner.estimate import transformer_dims
from lightning_parallel.planner.search import (
    PlanError,
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
        zero=None if zero is None else int(zero), zero_shard=options.zero_shard_size,
        recompute=(False,),  # the strategy does not add activation checkpointing to a model
        cp=options.cp, ep=options.ep,
    )


def device_memory(kind: str, processes_per_node: int, device: Optional[torch.device] = None) -> float:
    """Bytes one process may use: the GPU's memory, or the host's memory shared by its processes."""
    if kind == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(device or 0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / processes_per_node


def choose(model: nn.Module, nodes: int, devices_per_node: int, kind: str, replica_batch: int, seq: int,
           precision: str, options: ParallelOptions, memory: Optional[float] = None,
           example: Any = None) -> SearchResult:
    """The ranked layouts for a strategy whose ``options`` contain ``"auto"`` (raises ``PlanError``);
    ``example``: a batch of the run, on which the costs of a model that names no sizes are traced
    (``profile.py``)."""
    cluster = Cluster(nodes, devices_per_node, memory or device_memory(kind, devices_per_node), nominal(kind),
                      shared_compute=kind != "cuda")
    work = Workload(seq=seq, precision=precision, replica_batch=replica_batch, options=options, example=example)
    try:
        return search(model, cluster, work, constraints(options))
    except PlanError as err:
        if not err.fixes:
            raise
        raise PlanError(err.problem, [pinned(options)]) from None  # "give the sizes": those given as "auto"


def pinned(options: ParallelOptions) -> Fix:
    """The fix that gives every option left to the search its default: no search."""
    defaults = options.unsearched()
    return Fix({f"strategy.{name}": getattr(defaults, name) for name in options.searched})


def report(result: SearchResult, top: int = 5) -> str:
    """The table of the best layouts and why the first wins, as the strategy logs it."""
    return f"{format_table(result, top)}\n{explain(result)}"


def nothing_to_choose(result: SearchResult, model: nn.Module) -> str:
    """Why the search chose plain data parallelism when nothing else was there to choose."""
    world = result.cluster.world
    if world == 1:
        why = "one process: nothing to split"
    else:
        why = (f"{type(model).__name__} splits into no tensor or pipeline layout of {world} processes that fits "
               "(no repeated blocks, heads or widths these sizes divide, or too small to split)")
    return f"nothing to choose but data parallelism: {why}; each process holds the whole model"


def training_shape(trainer: Any, strategy: Any) -> tuple[int, int]:
    """The batch shape of the run (``planner/batch.py``): its data module's, or the first batch of
    the loader given to the Trainer or of the module's own hook. Raises ``BatchShapeUnknown``."""
    if trainer is None:
        raise BatchShapeUnknown("no Trainer call (fit, validate, ...) shows the data yet")
    if trainer.datamodule is not None:
        return datamodule_shape(trainer.datamodule)
    from lightning_parallel.pipeline.example import first_batch

    shape = batch_shape(first_batch(trainer, strategy)[0])
    if shape is None:
        raise BatchShapeUnknown("the Trainer call gives no training data whose first batch holds a tensor")
    return shape


def training_example(trainer: Any, strategy: Any) -> Any:
    """The first batch of the run (its data module's training loader, else the Trainer call's data), for
    tracing the costs of a model that names no sizes; None where it cannot be read before the run."""
    from lightning_parallel.pipeline.example import first_batch

    try:
        if trainer.datamodule is not None:
            return first_training_batch(trainer.datamodule)
        return first_batch(trainer, strategy)[0]
    except Exception:  # noqa: BLE001 - any failure of the user's data code: the costs come from the model alone
        return None


def choose_for(strategy: Any, trainer: Any, options: ParallelOptions) -> SearchResult:
    """The search of a ``ParallelStrategy`` before its process group, from its module, world and the
    batch shape of ``trainer``'s data (``training_shape``); rank 0 logs the table and why."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    from lightning_parallel.errors import LaunchError

    try:
        shape = training_shape(trainer, strategy)
    except BatchShapeUnknown as err:
        raise LaunchError(f"sizes given as 'auto' are chosen for the model and its batch shape, but {err}; "
                          "give the sizes instead, e.g.", [pinned(options)]) from None
    kind, model = strategy.root_device.type, strategy.lightning_module
    example = None if transformer_dims(model) else training_example(trainer, strategy)
    result = choose(model, strategy.num_nodes, strategy.num_processes, kind, shape[0], shape[1],
                    str(trainer.precision), options, device_memory(kind, strategy.num_processes, strategy.root_device),
                    example)
    why = f"{nothing_to_choose(result, model)}\n" if result.nothing_to_choose else ""
    rank_zero_info(f"strategy=auto chose {result.best.candidate.layout.describe()} of {len(result.ranked)} layouts "
                   f"that fit (planner/auto.py; costs: {result.profile.describe()}):\n{why}{report(result)}")
    return result
