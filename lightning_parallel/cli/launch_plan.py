"""The plan of an `lp-train` launch, checked before anything heavy starts: sizes, layout, the model's
split on the meta device, the batch shape and the memory estimate (``build_plan``), and a refusal
explained with fixes that pass every check (``explain_failure``). `lp-train` runs ``check_launch``
first, `lp-plan` prints ``format_plan``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_parallel.checks.launch import check_allocation, check_layout
from lightning_parallel.checks.layouts import Launch, checked_fixes, checked_layout
from lightning_parallel.checks.model import check_model
from lightning_parallel.checks.share import Share, planned_share
from lightning_parallel.cli.config_checks import check_config, parallel_options
from lightning_parallel.cli.overrides import compose_config
from lightning_parallel.cli.suggest import (
    explained,
)
from lightning_parallel.errors import (
    Fix,
    LaunchError,
    LightningParallelError,
)
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.pipeline.partition import StagePlan
from lightning_parallel.planner import (
    SearchResult,
)
from lightning_parallel.planner.auto import choose, pinned, report
from lightning_parallel.planner.batch import (
    BatchShapeUnknown,
    argument_shape,
    datamodule_shape,
    first_training_batch,
)
from lightning_parallel.planner.estimate import (
    RankMemory,
    count_parameters,
    estimate_memory,
    tp_sharded_parameters,
    transformer_dims,
)
from lightning_parallel.planner.experts import experts_placed, held_with_experts
from lightning_parallel.planner.profile import model_profile
from lightning_parallel.tensor_parallel.resolve import divisors


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the dry run reports about one config."""

    model_name: str
    parameters: int
    num_nodes: int
    devices_per_node: int
    precision: str
    mesh: ParallelMesh
    stages: StagePlan | None
    memory: list[RankMemory]
    micro_batches: int
    micro_batch_size: int | None
    tokens_per_step: int | None
    # "module glob: style" -> number of modules it shards
    tp_plan: dict[str, int] = field(default_factory=dict)
    # strategy=auto: the ranked layouts the strategy will choose from
    search: SearchResult | None = None
    # why the memory is not estimated (the batch shape unknown, no block list), or None
    memory_left_out: str | None = None
    # the parameters on the most loaded rank (checks/share.py)
    share: Share | None = None


def build_plan(cfg: DictConfig, env: Mapping[str, str] = os.environ) -> LaunchPlan:
    """Check the launch described by a composed `lp-train` config and estimate its memory.

    Raises ``ConfigurationError`` (config_checks) or ``LaunchError`` (checks).

    ``env`` is the environment the SLURM allocation is read from (none outside a job).
    """
    check_config(cfg)
    options = parallel_options(cfg)
    num_nodes, devices = int(cfg.trainer.num_nodes), int(cfg.trainer.devices)
    check_allocation(num_nodes, devices, env)
    searched, shape, unknown = None, None, None
    try:
        shape = data_batch_shape(cfg)
    except BatchShapeUnknown as err:
        unknown = str(err)
    model = meta_model(cfg)
    example = None if transformer_dims(model) or shape is None else data_example(cfg)  # to trace the model's costs
    if options.is_auto:  # the layout the strategy will choose at setup
        if shape is None:
            raise LaunchError(f"strategy=auto chooses the layout for the model and its batch shape, but {unknown}; "
                              "give the sizes instead, e.g.", [pinned(options)])
        searched = choose(model, num_nodes, devices, device_kind(cfg.trainer.accelerator), shape[0], shape[1],
                          str(cfg.trainer.precision), options, example=example)
        options = options.resolved(searched.best.candidate.layout.options())
    # a network built in the module's setup hook exists only once the run starts: the strategy checks it then
    built = any(True for _ in model.parameters())
    mesh = checked_layout(Launch(model, options, num_nodes, devices)) if built else check_layout(options, num_nodes, devices)
    assignments, stages = check_model(model, mesh, options) if built else ([], None)
    micro_batches = options.micro_batches or mesh.pp_size
    if shape is not None and shape[0] % micro_batches:
        _refuse_micro_batches(shape[0], micro_batches)
    memory = []
    if not built:
        unknown = f"{type(model).__name__} builds its network when the run starts (its setup hook)"
    elif stages is None:
        unknown = f"{type(model).__name__} has no list of repeated blocks for the estimate to count"
    elif shape is not None:
        batch, seq = shape
        sharded = tp_sharded_parameters(assignments)
        memory = estimate_memory(
            model, stages, sharded, mesh.tp_size, seq, batch // micro_batches,
            micro_batches, options.schedule_name, options.sequence_parallel,
            cfg.trainer.precision, zero_stage=options.zero, dp=mesh.dp_size * mesh.cp_size,
            context_parallel=mesh.cp_size, params=held_with_experts(model, stages, sharded, mesh),
            zero_shard_size=mesh.zero_shard_size, profile=model_profile(model, seq, example, options.pipeline_blocks),
        )
    accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1))
    return LaunchPlan(
        model_name=type(model).__name__,
        parameters=count_parameters(model),
        num_nodes=num_nodes,
        devices_per_node=devices,
        precision=str(cfg.trainer.precision),
        mesh=mesh,
        stages=stages,
        memory=memory,
        micro_batches=micro_batches,
        micro_batch_size=shape[0] // micro_batches if shape is not None else None,
        tokens_per_step=shape[0] * shape[1] * mesh.dp_size * accumulate if shape is not None else None,
        tp_plan=dict(Counter(f"{a.glob}: {a.entry.style}" for a in assignments if a.entry.style)),
        search=searched,
        memory_left_out=None if memory else unknown,
        share=experts_placed(planned_share(model, assignments, mesh.tp_size, stages if mesh.pp_size > 1 else None),
                             model, assignments, mesh),
    )


def _refuse_micro_batches(batch: int, micro_batches: int) -> None:
    fewer = max(d for d in divisors(batch) if d <= micro_batches)
    raise LaunchError(
        f"the batch of {batch} sequences (per replica) is not divisible by micro_batches={micro_batches}; use a "
        f"batch size that is a multiple of it, or fewer micro-batches, e.g.",
        [Fix({"data.batch_size": batch - batch % micro_batches or micro_batches}),
         Fix({"strategy.micro_batches": fewer})],
    )


def data_batch_shape(cfg: DictConfig) -> tuple[int, int]:
    """The batch shape of the run (``planner/batch.py``): the data config's ``batch_size`` and
    ``block_size``, else the first batch of the data module's training loader. Raises
    ``BatchShapeUnknown``."""
    return argument_shape(cfg.data) or _loader_shape(OmegaConf.to_yaml(cfg.data, resolve=True))


def data_example(cfg: DictConfig) -> Any:
    """The first batch of the config's training data (``planner/batch.py``), for the planner to trace the
    model's costs on; None where the data cannot be read before the run."""
    return _loader_batch(OmegaConf.to_yaml(cfg.data, resolve=True))


@lru_cache(maxsize=2)
def _loader_batch(data_config: str) -> Any:
    try:
        return first_training_batch(instantiate(OmegaConf.create(data_config), _convert_="all"))
    except Exception:  # noqa: BLE001 - any failure of the user's data code: the planner reads the model alone
        return None


@lru_cache(maxsize=4)
def _loader_shape(data_config: str) -> tuple[int, int]:
    # once per data config: the fixes tried before printing change the layout, not the data
    return datamodule_shape(instantiate(OmegaConf.create(data_config), _convert_="all"))


def meta_model(cfg: DictConfig) -> nn.Module:
    """The config's model on the meta device, as the strategy will see it: a ``from_pretrained`` inside
    reads no weights, and a network built in ``configure_model`` is built too. Built once per model
    config (the checks only read it): the fixes tried before a refusal is printed change the layout, not
    the model, and the model's own loading messages are left to the run that loads its weights."""
    return _meta_model(OmegaConf.to_yaml(cfg.model, resolve=True))


@lru_cache(maxsize=2)
def _meta_model(model_config: str) -> nn.Module:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_parallel.cli.quiet import quiet_model_loading
    from lightning_parallel.strategy.materialize import empty_parameters

    with empty_parameters(draws=False), quiet_model_loading():
        model = instantiate(OmegaConf.create(model_config))
        if isinstance(model, LightningModule) and is_overridden("configure_model", model, LightningModule):
            model.configure_model()
    return model


def device_kind(accelerator) -> str:
    """``"cuda"`` or ``"cpu"`` for a Trainer ``accelerator`` value."""
    if str(accelerator) in ("gpu", "cuda"):
        return "cuda"
    return "cuda" if str(accelerator) == "auto" and torch.cuda.is_available() else "cpu"


def _launch_of(cfg: DictConfig) -> Optional[Launch]:
    """The launch of ``cfg`` for the checks to try fixes on; None where the model builds its network later."""
    model = meta_model(cfg)
    if not any(True for _ in model.parameters()):
        return None
    return Launch(model, parallel_options(cfg), int(cfg.trainer.num_nodes), int(cfg.trainer.devices))


def launch_error(overrides: list[str]) -> Optional[Exception]:
    """What a launch with ``overrides`` would be refused with (outside any SLURM job), or None."""
    try:
        build_plan(compose_config(overrides), env={})
    except (LightningParallelError, HydraException, ValueError, TypeError) as err:
        return err
    return None


def explain_failure(err: Exception, prog: str, overrides: list[str], cfg: DictConfig) -> str:
    """The refusal and, as whole command lines that pass every check, its own fixes and (a layout
    that does not fit the allocation or the model) other layouts of the same launch."""
    if not isinstance(err, LightningParallelError):
        return str(err)
    fixes = list(err.fixes)
    if isinstance(err, LaunchError) and not parallel_options(cfg).is_auto and (launch := _launch_of(cfg)) is not None:
        fixes = checked_fixes(launch, err)  # its own that the model runs, then the layouts it runs
    return explained(err.problem, prog, overrides, fixes, cfg, launch_error)


def _blocks(blocks: tuple[int, ...]) -> str:
    return f"{blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else str(blocks[0])


def format_plan(plan: LaunchPlan) -> str:
    lines = [] if plan.search is None else ["strategy=auto ranks these layouts (planner/auto.py):", report(plan.search)]
    lines += [
        f"model: {plan.model_name}, {plan.parameters / 1e6:,.1f}M parameters",
        f"launch: {plan.num_nodes} node(s) x {plan.devices_per_node} devices, precision {plan.precision}",
        plan.mesh.describe(plan.devices_per_node),
    ]
    if plan.tokens_per_step is not None:
        batch = (f"batch: {plan.micro_batches} micro-batch(es) of {plan.micro_batch_size} sequences per replica, "
                 f"{plan.tokens_per_step:,} tokens per optimizer step")
        lines.insert(len(lines) - 1, batch)  # before the mesh
    if plan.tp_plan:
        lines.append("tp plan: " + ", ".join(f"{k} (x{n})" for k, n in plan.tp_plan.items()))
    if plan.share is not None:
        lines.append(f"holds: {plan.share.describe()}")
    if plan.stages is not None:
        s = plan.stages
        lines.append(f"stages: blocks of {s.blocks_path} (first also {', '.join(s.pre) or '-'}; last also {', '.join(s.post) or '-'})")
        for stage, blocks in enumerate(s.stage_blocks):
            lines.append(f"  stage {stage} (pp rank {s.rank_of_stage(stage)}): blocks {_blocks(tuple(blocks))}")
    cp = plan.mesh.cp_size
    if cp > 1:
        lines.append(f"context parallel: each sequence split over {cp} ranks (chunks i and {2 * cp - 1}-i of {2 * cp}), "
                     f"keys and values passed round a ring: the blocks' activations per device are 1/{cp} of one "
                     "device's; the embedding, head and loss run on the whole sequence on every rank")
    if plan.memory_left_out is not None:
        lines.append(f"memory per device: not estimated: {plan.memory_left_out}")
    if plan.memory:
        peak = max(plan.memory, key=lambda m: m.total_bytes)
        unit, size = ("GiB", 1024**3) if peak.total_bytes >= 1024**3 else ("MiB", 1024**2)
        lines.append(f"memory per device, {unit} (estimate: see lightning_parallel/planner/estimate.py):")
        lines.append("  pp rank  params(M)   params    grads  optimizer  activations(in flight)   total")
        for m in plan.memory:
            lines.append(
                f"  {m.stage:>7}  {m.params / 1e6:>9.1f}  {m.param_bytes / size:>7.2f}  {m.grad_bytes / size:>7.2f}"
                f"  {m.optimizer_bytes / size:>9.2f}  {m.activation_bytes / size:>11.2f} ({m.in_flight:>2})"
                f"          {m.total_bytes / size:>6.2f}"
            )
        lines.append(f"peak per device: {peak.total_bytes / size:.2f} {unit} (pp rank {peak.stage})")
    return "\n".join(lines)


def dry_run(cfg: DictConfig) -> LaunchPlan:
    """Print the plan of `cfg` (what `lp-train dry_run=true` does); raises LaunchError."""
    plan = check_launch(cfg)
    print(format_plan(plan))
    return plan


def check_launch(cfg: DictConfig) -> LaunchPlan:
    """`build_plan` for `lp-train`, whose refusals carry only fixes that pass as whole command lines."""
    try:
        return build_plan(cfg)
    except LightningParallelError as err:
        if not HydraConfig.initialized():
            raise
        overrides = list(HydraConfig.get().overrides.task)
        raise type(err)(explain_failure(err, "lp-train", overrides, cfg)) from None


# ---- lp-plan --search -------------------------------------------------------------------------
