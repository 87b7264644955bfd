"""`lp-plan` and `lp-train dry_run=true`: print the parallel plan of a config, train nothing.

    lp-plan +recipe=gpt_1p3b_3d                       # the same overrides lp-train takes
    lp-plan +recipe=gpt_1p3b_3d strategy.tensor_parallel=8

The report shows the mesh (the global ranks of every TP, PP and DP group, and the node of each
rank), the blocks of every pipeline stage, and the memory per device from `estimate.py`. It
refuses, with the corrected `#SBATCH` lines and overrides, a layout that does not fit the
allocation, a TP group that spans nodes, or sizes the model does not divide (`slurm_checks.py`).
Inside a SLURM job it checks the real allocation too, so the sbatch script runs it before `srun`.
The model is built on the meta device: a 7B plan takes a second and no memory.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_parallel.estimate import (
    RankMemory,
    count_parameters,
    estimate_memory,
    tp_sharded_parameters,
)
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.pipeline.partition import StagePlan
from lightning_parallel.slurm_checks import (
    LaunchConfigError,
    check_allocation,
    check_layout,
    check_model,
)


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
    micro_batch_size: int
    tokens_per_step: int


def _strategy_options(cfg: DictConfig) -> dict:
    """The strategy's keyword arguments; Lightning's own strategies ("auto", "ddp") give none."""
    strategy = cfg.get("strategy")
    if not isinstance(strategy, DictConfig):
        return {}
    return OmegaConf.to_container(strategy, resolve=True)


def _mesh_sizes(options: dict, world: int) -> dict:
    """TP, PP and DP sizes; the presets read ``tensor_parallel=None`` (TensorParallelStrategy) or
    ``pipeline_parallel=None`` (PipelineParallelStrategy) as "every process"."""
    tp, pp = options.get("tensor_parallel", 1), options.get("pipeline_parallel", 1)
    return {
        "tensor_parallel": tp if tp is not None else max(1, world // (pp or 1)),
        "pipeline_parallel": pp if pp is not None else max(1, world // (tp or 1)),
        "data_parallel": options.get("data_parallel", "auto"),
    }


def build_plan(cfg: DictConfig) -> LaunchPlan:
    """Check the launch described by a composed `lp-train` config and estimate its memory."""
    options = _strategy_options(cfg)
    num_nodes, devices = int(cfg.trainer.num_nodes), int(cfg.trainer.devices)
    check_allocation(num_nodes, devices)
    mesh = check_layout(_mesh_sizes(options, num_nodes * devices), num_nodes, devices)
    with torch.device("meta"):
        model: nn.Module = instantiate(cfg.model)
    assignments, stages = check_model(
        model,
        mesh,
        tp_plan=options.get("tp_plan"),
        sequence_parallel=options.get("sequence_parallel", False),
        pipeline_blocks=options.get("pipeline_blocks"),
        virtual_stages=options.get("virtual_stages", 1),
        pipeline_layout=options.get("pipeline_layout"),
    )
    batch = int(cfg.data.batch_size)
    micro_batches = options.get("micro_batches") or mesh.pp_size
    if batch % micro_batches:
        raise LaunchConfigError(
            f"data.batch_size={batch} (per replica) is not divisible by micro_batches={micro_batches}; "
            f"use a batch size that is a multiple of it, e.g.\n    data.batch_size={batch - batch % micro_batches or micro_batches}"
        )
    seq = int(cfg.data.block_size)
    memory = []
    if stages is not None:
        memory = estimate_memory(
            model, stages, tp_sharded_parameters(assignments), mesh.tp_size, seq, batch // micro_batches,
            micro_batches, options.get("schedule", "1f1b"), options.get("sequence_parallel", False),
            cfg.trainer.precision,
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
        micro_batch_size=batch // micro_batches,
        tokens_per_step=batch * seq * mesh.dp_size * accumulate,
    )


def _blocks(blocks: tuple[int, ...]) -> str:
    return f"{blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else str(blocks[0])


def format_plan(plan: LaunchPlan) -> str:
    lines = [
        f"model: {plan.model_name}, {plan.parameters / 1e6:,.1f}M parameters",
        f"launch: {plan.num_nodes} node(s) x {plan.devices_per_node} devices, precision {plan.precision}",
        (
            f"batch: {plan.micro_batches} micro-batch(es) of {plan.micro_batch_size} sequences per replica, "
            f"{plan.tokens_per_step:,} tokens per optimizer step"
        ),
        plan.mesh.describe(plan.devices_per_node),
    ]
    if plan.stages is not None:
        s = plan.stages
        lines.append(f"stages: blocks of {s.blocks_path} (first also {', '.join(s.pre) or '-'}; last also {', '.join(s.post) or '-'})")
        for stage, blocks in enumerate(s.stage_blocks):
            lines.append(f"  stage {stage} (pp rank {s.rank_of_stage(stage)}): blocks {_blocks(tuple(blocks))}")
    if plan.memory:
        peak = max(plan.memory, key=lambda m: m.total_bytes)
        unit, size = ("GiB", 1024**3) if peak.total_bytes >= 1024**3 else ("MiB", 1024**2)
        lines.append(f"memory per device, {unit} (estimate: see lightning_parallel/estimate.py):")
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
    """Print the plan of `cfg` (what `lp-train dry_run=true` does); raises LaunchConfigError."""
    plan = build_plan(cfg)
    print(format_plan(plan))
    return plan


def main(argv: list[str] | None = None) -> None:
    overrides = sys.argv[1:] if argv is None else argv
    with initialize_config_module("lightning_parallel.conf", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    try:
        dry_run(cfg)
    except LaunchConfigError as err:
        print(f"lp-plan: this launch would fail:\n{err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
