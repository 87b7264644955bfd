"""Launch checks that catch a bad layout before a job waits in the queue or starts a collective.

Three kinds of mistakes, each refused with the lines that would fix it:

1. the SLURM allocation (``--nodes``, ``--ntasks-per-node``) differs from the Trainer's
   ``num_nodes`` x ``devices``, or uses ``-n`` alone (Lightning needs ``--ntasks-per-node``);
2. the layout's ``data x tensor x pipeline`` product is not the number of processes, or a tensor
   parallel group would span two nodes (TP groups are runs of consecutive ranks, see mesh.py, and
   need the fast intra-node links: Narayanan et al. 2021, arXiv 2104.04473 §3.3);
3. the model cannot be split as asked: heads, hidden or vocabulary not divisible by the TP size,
   a plan that names no module or an unknown style, or fewer blocks than pipeline stages;
4. the model trains in a way the pipeline cannot run: manual optimisation, or a loss scaler
   (precision ``16-mixed``).

Pure apart from reading the environment: every rank raises the same error before any collective.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from torch import nn

from lightning_parallel.mesh import MeshError, ParallelMesh
from lightning_parallel.pipeline.errors import (
    PipelineConfigError,
    PipelineIncompatibleModel,
)
from lightning_parallel.pipeline.partition import StagePlan, find_blocks, plan_stages
from lightning_parallel.tensor_parallel.detect import detect_plan
from lightning_parallel.tensor_parallel.plan import TensorParallelError, parse_plan
from lightning_parallel.tensor_parallel.resolve import (
    Assignment,
    divisors,
    resolve_plan,
)

# Lightning treats a job with one of these names as an interactive shell, not a SLURM launch.
_INTERACTIVE_JOB_NAMES = ("bash", "interactive")


class LaunchConfigError(ValueError):
    """A launch whose allocation, layout and model do not fit together; the message says how to fix it."""


def _allocation_lines(nodes: int, tasks_per_node: int) -> str:
    return (
        f"    #SBATCH --nodes={nodes}\n"
        f"    #SBATCH --ntasks-per-node={tasks_per_node}\n"
        f"    trainer.num_nodes={nodes} trainer.devices={tasks_per_node}"
    )


def slurm_allocation(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """``(nodes, tasks per node)`` of the SLURM job this process runs in; None outside SLURM.

    Raises ``LaunchConfigError`` for allocations Lightning cannot use.
    """
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env:
        return None
    name = env.get("SLURM_JOB_NAME", "")
    if name in _INTERACTIVE_JOB_NAMES:
        raise LaunchConfigError(
            f"the job name {name!r} makes Lightning treat this job as an interactive shell and ignore SLURM; "
            "name the job:\n    #SBATCH --job-name=lp-train"
        )
    nodes = int(env["SLURM_NNODES"])
    if "SLURM_NTASKS_PER_NODE" not in env:
        tasks = int(env.get("SLURM_NTASKS", nodes))
        raise LaunchConfigError(
            f"the job sets --ntasks={tasks} without --ntasks-per-node, which Lightning rejects; allocate "
            f"one task per device per node instead:\n{_allocation_lines(nodes, max(1, tasks // nodes))}"
        )
    return nodes, int(env["SLURM_NTASKS_PER_NODE"])


def check_allocation(num_nodes: int, devices_per_node: int, env: Mapping[str, str] = os.environ) -> None:
    """Refuse a SLURM allocation that differs from the Trainer's ``num_nodes`` x ``devices``."""
    allocation = slurm_allocation(env)
    if allocation is None or allocation == (num_nodes, devices_per_node):
        return
    nodes, tasks = allocation
    raise LaunchConfigError(
        f"SLURM allocated {nodes} node(s) x {tasks} task(s) per node, but the Trainer asks for "
        f"num_nodes={num_nodes} x devices={devices_per_node}. Either submit with\n"
        f"{_allocation_lines(num_nodes, devices_per_node)}\n"
        f"or train on what was allocated:\n    trainer.num_nodes={nodes} trainer.devices={tasks}"
    )


def _layouts(world: int, devices_per_node: int) -> list[str]:
    """Layouts that fill ``world`` processes with TP groups inside a node."""
    return [
        f"tp={t} pp={p} dp={world // (t * p)}"
        for t in divisors(devices_per_node)
        if world % t == 0
        for p in divisors(world // t)
    ]


def check_layout(mesh_sizes: Mapping, num_nodes: int, devices_per_node: int) -> ParallelMesh:
    """The mesh of ``mesh_sizes`` (tensor_parallel, pipeline_parallel, data_parallel) on
    ``num_nodes`` x ``devices_per_node`` processes; refuses a product that does not match or a TP
    group that would span nodes."""
    tp = int(mesh_sizes.get("tensor_parallel", 1))
    pp = int(mesh_sizes.get("pipeline_parallel", 1))
    dp = mesh_sizes.get("data_parallel", "auto")
    world = num_nodes * devices_per_node
    try:
        mesh = ParallelMesh(world, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp)
    except MeshError:
        fixed_dp = isinstance(dp, int) and dp > 0
        wanted = tp * pp * (dp if fixed_dp else 1)
        lines = [
            f"the layout tensor_parallel={tp} x pipeline_parallel={pp} x data_parallel={dp} "
            + (f"needs {wanted} processes" if fixed_dp else f"needs a multiple of {tp * pp} processes")
            + f", but the allocation has {num_nodes} node(s) x {devices_per_node} = {world}."
        ]
        if fixed_dp and wanted % devices_per_node == 0:
            lines.append(f"Allocate for the layout:\n{_allocation_lines(wanted // devices_per_node, devices_per_node)}")
        elif fixed_dp and wanted < devices_per_node:
            lines.append(f"Allocate for the layout:\n{_allocation_lines(1, wanted)}")
        if world % (tp * pp) == 0:
            lines.append(f"Or keep the allocation and let data parallelism take the rest:\n    strategy.data_parallel={world // (tp * pp)}")
        lines.append(f"Layouts that fit {world} processes with TP inside a node: {', '.join(_layouts(world, devices_per_node)[:10])}")
        raise LaunchConfigError("\n".join(lines)) from None
    if devices_per_node % tp:
        fitting = [t for t in divisors(devices_per_node) if world % (t * pp) == 0]
        best = max(t for t in fitting if t <= tp)
        raise LaunchConfigError(
            f"tensor_parallel={tp} does not divide the {devices_per_node} devices per node, so a tensor "
            f"parallel group would span two nodes (every layer all-reduces within it). Use a TP size that "
            f"divides {devices_per_node} ({', '.join(map(str, fitting))}), e.g.\n"
            f"    strategy.tensor_parallel={best} strategy.data_parallel={world // (best * pp)}"
        )
    return mesh


def check_model(
    model: nn.Module,
    mesh: ParallelMesh,
    tp_plan: Mapping | None = None,
    sequence_parallel: bool = False,
    pipeline_blocks: str | None = None,
    virtual_stages: int = 1,
    pipeline_layout: list[int] | None = None,
    placement: str = "loop",
) -> tuple[list[Assignment], StagePlan | None]:
    """The TP assignments and pipeline stages of ``model`` on ``mesh`` (stages placed on ranks by
    ``placement``, see ``pipeline.placement``); refuses sizes the model does not divide, naming the
    sizes that would work. Works on a model built on the meta device."""
    assignments: list[Assignment] = []
    if mesh.tp_size > 1:
        try:
            assignments = _tp_assignments(model, mesh.tp_size, tp_plan, sequence_parallel)
        except TensorParallelError as err:
            fits = [
                t for t in divisors(mesh.world_size)
                if t < mesh.tp_size and _tp_fits(model, t, tp_plan, sequence_parallel)
            ]
            # a plan that fits no size (a glob that names no module, an unknown style) has its own fix
            hint = (f"\nTP sizes this model and world allow: {fits}, e.g.\n"
                    f"    strategy.tensor_parallel={max(fits)} strategy.data_parallel=auto") if fits else ""
            raise LaunchConfigError(f"{err}{hint}") from None
    try:
        blocks = len(find_blocks(model, pipeline_blocks)[1])
    except (PipelineIncompatibleModel, PipelineConfigError) as err:
        if mesh.pp_size == 1:
            return assignments, None
        raise LaunchConfigError(f"{err}; or train without pipelining:\n    strategy.pipeline_parallel=1") from None
    try:
        stages = plan_stages(model, mesh.pp_size, virtual_stages, pipeline_blocks, pipeline_layout,
                             placement=placement)
    except PipelineConfigError as err:
        if pipeline_layout is not None:  # the message already gives a layout that works
            raise LaunchConfigError(str(err)) from None
        fits = [p for p in divisors(mesh.world_size // mesh.tp_size) if p * virtual_stages <= blocks]
        hint = (f". Pipeline sizes that fit the model and the world: {fits}, e.g.\n"
                f"    strategy.pipeline_parallel={max(fits)} strategy.data_parallel=auto") if fits else (
                "; or train without pipelining:\n    strategy.pipeline_parallel=1")
        raise LaunchConfigError(f"{err}{hint}") from None
    return assignments, stages


def _tp_assignments(model: nn.Module, tp: int, tp_plan: Mapping | None, sequence_parallel: bool) -> list[Assignment]:
    plan = parse_plan(tp_plan) if tp_plan is not None else detect_plan(model, sequence_parallel)
    return resolve_plan(model, plan, tp, sequence_parallel)


def _tp_fits(model: nn.Module, tp: int, tp_plan: Mapping | None, sequence_parallel: bool) -> bool:
    try:
        _tp_assignments(model, tp, tp_plan, sequence_parallel)
    except TensorParallelError:
        return False
    return True


def check_training_mode(model: nn.Module, pipeline_parallel: int, automatic_optimization: bool,
                        loss_scaler: bool) -> None:
    """Refuse what the pipeline cannot run: it calls forward and backward of every micro-batch
    itself, inside ``training_step``, and scales no loss."""
    if pipeline_parallel == 1:
        return
    name = type(model).__name__
    if not automatic_optimization:
        raise LaunchConfigError(
            f"{name} sets automatic_optimization = False, which pipeline_parallel={pipeline_parallel} does not "
            "support: the pipeline runs forward and backward of every micro-batch itself, inside training_step, "
            "so manual_backward and optimizer.step() calls there have no gradients to act on. Return the loss "
            "from training_step and let Lightning optimise (automatic_optimization = True), or train without "
            "pipelining (data and tensor parallelism support manual optimisation):\n"
            "    strategy.pipeline_parallel=1"
        )
    if loss_scaler:
        raise LaunchConfigError(
            f"{name}: precision '16-mixed' needs a loss scaler, which pipeline_parallel={pipeline_parallel} does "
            "not apply; train in bfloat16 or float32:\n    trainer.precision=bf16-mixed"
        )


def validate_launch(
    mesh_sizes: Mapping,
    num_nodes: int,
    devices_per_node: int,
    model: nn.Module | None = None,
    *,
    tp_plan: Mapping | None = None,
    sequence_parallel: bool = False,
    pipeline_blocks: str | None = None,
    virtual_stages: int = 1,
    pipeline_layout: list[int] | None = None,
    placement: str = "loop",
    automatic_optimization: bool = True,
    loss_scaler: bool = False,
) -> ParallelMesh:
    """All launch checks, for a strategy to call in ``setup_environment`` before any collective.

    Args:
        mesh_sizes: ``tensor_parallel``, ``pipeline_parallel``, ``data_parallel`` (int or "auto").
        num_nodes, devices_per_node: the Trainer's ``num_nodes`` and ``devices``.
        model: when given, also check that it splits into the TP and PP sizes, with the strategy's
            ``tp_plan``, ``sequence_parallel``, ``pipeline_blocks``, ``virtual_stages`` and
            ``pipeline_layout`` (stages placed by ``placement``), and that it trains in a way the pipeline runs (``automatic_optimization``,
            no ``loss_scaler``).

    Returns the mesh (sizes only; no process groups). Raises ``LaunchConfigError``.
    """
    check_allocation(num_nodes, devices_per_node)
    mesh = check_layout(mesh_sizes, num_nodes, devices_per_node)
    if model is not None:
        check_training_mode(model, mesh.pp_size, automatic_optimization, loss_scaler)
        check_model(model, mesh, tp_plan, sequence_parallel, pipeline_blocks, virtual_stages, pipeline_layout,
                    placement)
    return mesh
