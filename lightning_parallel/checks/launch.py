"""Launch checks that catch a bad layout before a job waits in the queue or starts a collective.

Three kinds of mistakes, each refused with the settings that would fix it (``errors.Fix``):

1. the SLURM allocation (``--nodes``, ``--ntasks-per-node``) differs from the Trainer's
   ``num_nodes`` x ``devices``, or uses ``-n`` alone (Lightning needs ``--ntasks-per-node``);
2. the layout's ``data x tensor x pipeline x context`` product is not the number of processes, a
   tensor parallel group would span two nodes (TP groups are runs of consecutive ranks, see mesh.py,
   and need the fast intra-node links: Narayanan et al. 2021, arXiv 2104.04473 §3.3), or context
   parallelism is combined with pipelining (not supported), or ``zero_shard_size`` does not divide
   the data-parallel replicas;
3. the model cannot be split as asked: heads, hidden or vocabulary not divisible by the TP size,
   a plan that names no module or an unknown style, fewer blocks than pipeline stages, no block list
   or no ``sdpa`` attention to split the sequence over;
4. the model trains in a way the pipeline cannot run: manual optimisation, or a loss scaler
   (precision ``16-mixed``).

Pure apart from reading the environment: every rank raises the same error before any collective.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Callable
from dataclasses import replace

from torch import nn

from lightning_parallel.checks.model import check_model, check_training_mode
from lightning_parallel.errors import Fix, LaunchError
from lightning_parallel.mesh import MeshError, ParallelMesh
from lightning_parallel.options import ParallelOptions
from lightning_parallel.tensor_parallel.resolve import divisors

# Lightning treats a job with one of these names as an interactive shell, not a SLURM launch.
_INTERACTIVE_JOB_NAMES = ("bash", "interactive")


def _sbatch_lines(nodes: int, tasks_per_node: int) -> str:
    return f"    #SBATCH --nodes={nodes}\n    #SBATCH --ntasks-per-node={tasks_per_node}"


def _allocation(nodes: int, tasks_per_node: int, why: str = "") -> Fix:
    return Fix({"trainer.num_nodes": nodes, "trainer.devices": tasks_per_node}, why)


def slurm_allocation(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """``(nodes, tasks per node)`` of the SLURM job this process runs in; None outside SLURM.

    Raises ``LaunchError`` for allocations Lightning cannot use.
    """
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env:
        return None
    name = env.get("SLURM_JOB_NAME", "")
    if name in _INTERACTIVE_JOB_NAMES:
        raise LaunchError(
            f"the job name {name!r} makes Lightning treat this job as an interactive shell and ignore SLURM; "
            "name the job:\n    #SBATCH --job-name=lp-train"
        )
    nodes = int(env["SLURM_NNODES"])
    if "SLURM_NTASKS_PER_NODE" not in env:
        tasks = int(env.get("SLURM_NTASKS", nodes))
        per_node = max(1, tasks // nodes)
        raise LaunchError(
            f"the job sets --ntasks={tasks} without --ntasks-per-node, which Lightning rejects; allocate "
            f"one task per device per node instead:\n{_sbatch_lines(nodes, per_node)}",
            [_allocation(nodes, per_node)],
        )
    return nodes, int(env["SLURM_NTASKS_PER_NODE"])


def check_allocation(num_nodes: int, devices_per_node: int, env: Mapping[str, str] = os.environ) -> None:
    """Refuse a SLURM allocation that differs from the Trainer's ``num_nodes`` x ``devices``."""
    allocation = slurm_allocation(env)
    if allocation is None or allocation == (num_nodes, devices_per_node):
        return
    nodes, tasks = allocation
    raise LaunchError(
        f"SLURM allocated {nodes} node(s) x {tasks} task(s) per node, but the Trainer asks for "
        f"num_nodes={num_nodes} x devices={devices_per_node}. Either submit with\n"
        f"{_sbatch_lines(num_nodes, devices_per_node)}\n"
        f"or train on what was allocated:",
        [_allocation(nodes, tasks, "what SLURM allocated")],
    )


def _layouts(world: int, devices_per_node: int, runs: Callable[[int, int], bool]) -> list[str]:
    """Layouts that fill ``world`` processes with TP groups inside a node, those the model ``runs(tp, pp)``."""
    return [
        f"tp={t} pp={p} dp={world // (t * p)}"
        for t in divisors(devices_per_node)
        if world % t == 0
        for p in divisors(world // t)
        if runs(t, p)
    ]


def check_layout(options: ParallelOptions, num_nodes: int, devices_per_node: int,
                 runs: Callable[[int, int], bool] = lambda tp, pp: True) -> ParallelMesh:
    """The mesh of ``options``' sizes on ``num_nodes`` x ``devices_per_node`` processes; refuses a
    product that does not match, a TP group that would span nodes, or context with pipeline parallelism.
    A refusal suggests only TP x PP sizes the model splits into, ``runs(tp, pp)`` (where the model is known:
    ``checks/layouts.py``'s ``splits``)."""
    tp, pp, dp, cp = options.tp, options.pp, options.data_parallel, options.cp
    world = num_nodes * devices_per_node
    if cp > 1 and pp > 1:
        raise LaunchError(
            f"context_parallel={cp} with pipeline_parallel={pp} is not supported: context parallelism splits the "
            "sequence at the model's first block and gathers it after the last, which pipeline stages hold apart. "
            "Context parallelism composes with data and tensor parallelism; split the model over tensor parallel "
            "ranks, or pipeline without splitting the sequence:",
            [Fix({"strategy.pipeline_parallel": 1}, f"keep context_parallel={cp}"),
             Fix({"strategy.context_parallel": 1}, f"keep pipeline_parallel={pp}")])
    split = tp * pp * cp
    sizes = f"tensor_parallel={tp} x pipeline_parallel={pp}" + (f" x context_parallel={cp}" if cp > 1 else "")
    try:
        mesh = ParallelMesh(world, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp, context_parallel=cp)
    except MeshError:
        fixed_dp = isinstance(dp, int) and dp > 0
        wanted = split * (dp if fixed_dp else 1)
        lines = [
            f"the layout {sizes} x data_parallel={dp} "
            + (f"needs {wanted} processes" if fixed_dp else f"needs a multiple of {split} processes")
            + f", but the allocation has {num_nodes} node(s) x {devices_per_node} = {world}."
        ]
        fixes = []
        # the nodes stay those the allocation has: only the devices per node change
        per_node = wanted // num_nodes if fixed_dp and wanted % num_nodes == 0 else None
        if per_node is not None and per_node % tp == 0 and runs(tp, pp):
            lines.append(f"Allocate for the layout:\n{_sbatch_lines(num_nodes, per_node)}")
            fixes.append(_allocation(num_nodes, per_node, f"keep tp={tp} pp={pp}" + (f" cp={cp}" if cp > 1 else "")))
        if world % split == 0:  # data parallelism takes the rest
            fixes.append(Fix({"strategy.data_parallel": world // split},
                             f"keep {num_nodes} node(s) x {devices_per_node} devices"))
        fitting = _layouts(world, devices_per_node, runs)
        lines.append(f"Layouts that fit {world} processes with TP inside a node: "
                     f"{', '.join(fitting[:10]) or 'none'}" + (":" if fixes else ""))
        raise MeshError("\n".join(lines), fixes) from None
    if devices_per_node % tp:
        fitting = [t for t in divisors(devices_per_node) if world % (t * pp * cp) == 0]
        best = max(t for t in fitting if t <= tp)
        raise MeshError(
            f"tensor_parallel={tp} does not divide the {devices_per_node} devices per node, so a tensor "
            f"parallel group would span two nodes (every layer all-reduces within it). Use a TP size that "
            f"divides {devices_per_node} ({', '.join(map(str, fitting))}), e.g.",
            [Fix({"strategy.tensor_parallel": best, "strategy.data_parallel": world // (best * pp * cp)})],
        )
    if options.ep > 1:
        return _with_experts(mesh, options.ep)
    if options.shards_parameters and options.zero_shard_size is not None:
        return _with_shard_size(mesh, options.zero_shard_size, devices_per_node)
    return mesh


def _with_experts(mesh: ParallelMesh, ep: int) -> ParallelMesh:
    """``mesh`` with its expert-parallel groups carved from the data-parallel replicas (``ep`` must divide them)."""
    dp = mesh.dp_size
    if dp % ep:
        fitting = [e for e in divisors(dp) if e > 1]
        raise MeshError(
            f"expert_parallel={ep} does not divide data_parallel={dp}: the ranks holding different experts are "
            f"data-parallel replicas of one another. Use expert_parallel in ({', '.join(map(str, fitting)) or 'none'})"
            f", or launch a multiple of {ep} replicas" + (":" if fitting else "."),
            [Fix({"strategy.expert_parallel": max(fitting)})] if fitting else [])
    return replace(mesh, data_parallel=dp, expert_parallel=ep)


def _with_shard_size(mesh: ParallelMesh, size: int, devices_per_node: int) -> ParallelMesh:
    """``mesh`` with ZeRO-2/3 sharding over runs of ``size`` data-parallel replicas (hybrid sharding); ``size``
    must divide them. The fix offered is the replicas one node holds, where that divides them."""
    dp = mesh.dp_size
    if dp % size:
        fitting = divisors(dp)
        split = mesh.tp_size * mesh.cp_size
        per_node = devices_per_node // split if devices_per_node % split == 0 else 0  # replicas in one node
        best = per_node if per_node in fitting else max(k for k in fitting if k <= size)
        raise LaunchError(
            f"zero_shard_size={size} does not divide data_parallel={dp}: the parameters are sharded over runs of "
            f"zero_shard_size data-parallel replicas, replicated across the runs. Use zero_shard_size in "
            f"({', '.join(map(str, fitting))}) ({dp} shards over every replica, as without it), e.g.",
            [Fix({"strategy.zero_shard_size": best})])
    return replace(mesh, zero_shard_size=size)


def validate_launch(
    options: ParallelOptions,
    num_nodes: int,
    devices_per_node: int,
    model: nn.Module | None = None,
    *,
    automatic_optimization: bool = True,
    loss_scaler: bool = False,
) -> ParallelMesh:
    """All launch checks, for a strategy to call in ``setup_environment`` before any collective.

    Args:
        options: the layout and its options (sizes already resolved from "auto").
        num_nodes, devices_per_node: the Trainer's ``num_nodes`` and ``devices``.
        model: when given, also check that it splits into the TP and PP sizes with ``options``, and
            that it trains in a way the pipeline runs (``automatic_optimization``, no ``loss_scaler``);
            a refusal then suggests only layouts this model runs on this allocation (``checks/layouts.py``).

    Returns the mesh (sizes only; no process groups). Raises ``LaunchError``.
    """
    check_allocation(num_nodes, devices_per_node)
    if model is None:
        return check_layout(options, num_nodes, devices_per_node)
    # imported here: the layouts a refusal suggests are tried with these very checks
    from lightning_parallel.checks.layouts import Launch, checked_layout, with_runnable_fixes

    launch = Launch(model, options, num_nodes, devices_per_node, automatic_optimization, loss_scaler)
    try:
        mesh = checked_layout(launch)
        check_training_mode(model, mesh.pp_size, automatic_optimization, loss_scaler)
        check_model(model, mesh, options)
    except LaunchError as err:  # its fixes, and other layouts, only where this model runs them
        raise with_runnable_fixes(err, launch) from None
    return mesh
