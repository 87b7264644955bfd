"""`lp-plan` and `lp-train dry_run=true`: print the parallel plan of a config, train nothing.

    lp-plan +recipe=gpt_1p3b_3d                       # the same overrides lp-train takes
    lp-plan +recipe=gpt_1p3b_3d strategy.tensor_parallel=8
    lp-plan --search +recipe=llama_7b_3d --nodes 4 --devices-per-node 8 --device-memory 80 \
            --tflops 400 --intra-bandwidth 200 --inter-bandwidth 25 --global-batch 64

The report shows the mesh (the global ranks of every TP, PP and DP group, and the node of each
rank), the blocks of every pipeline stage, and the memory per device from `planner/estimate.py`. It
refuses, with the corrected `#SBATCH` lines and overrides, a layout that does not fit the
allocation, a TP group that spans nodes, or sizes the model does not divide (`checks/`).
Inside a SLURM job it checks the real allocation too, so the sbatch script runs it before `srun`.
The model is built on the meta device: a 7B plan takes a second and no memory.

``--search`` ranks every layout of the cluster instead (``planner/``): TP, PP, DP, micro-batches,
schedule, ZeRO-1 and activation checkpointing, memory per device, predicted step time, bubble and
bytes moved, and why the first wins. Rates not given as flags are measured on this machine in a
few seconds (``planner/calibrate.py``). A config with ``strategy=auto`` is planned as the strategy
will plan it at setup.

The batch shape (for the memory estimate, the micro-batch check and the search) is read from the
data the run will use (``planner/batch.py``): the data config's ``batch_size`` and ``block_size``,
else the first batch of the data module's training loader.

Every fix printed is a whole command line, tried first: the user's overrides with the fix merged
in, composed again and passing the same checks (``cli/suggest.py``). `lp-train` runs
`check_launch` in the launching process, so the mistakes found here stop a run before any rank
starts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_parallel.checks.share import Share, planned_share
from lightning_parallel.checks.launch import check_allocation, check_layout
from lightning_parallel.checks.model import check_model
from lightning_parallel.cli.config_checks import check_config, parallel_options
from lightning_parallel.cli.entry import enter_command
from lightning_parallel.cli.overrides import compose_config
from lightning_parallel.cli.suggest import command_line, explained, has_key, with_settings
from lightning_parallel.errors import ConfigurationError, Fix, LaunchError, LightningParallelError
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.pipeline.partition import StagePlan
from lightning_parallel.planner import (
    Cluster,
    Constraints,
    PlanError,
    SearchResult,
    Workload,
    search,
)
from lightning_parallel.planner.auto import choose, device_memory, pinned, report
from lightning_parallel.planner.batch import BatchShapeUnknown, argument_shape, datamodule_shape
from lightning_parallel.planner.calibrate import measure, nominal
from lightning_parallel.planner.estimate import (
    RankMemory,
    count_parameters,
    estimate_memory,
    tp_sharded_parameters,
)
from lightning_parallel.planner.space import Rates
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
    model, searched, shape, unknown = None, None, None, None
    try:
        shape = data_batch_shape(cfg)
    except BatchShapeUnknown as err:
        unknown = str(err)
    if options.is_auto:  # the layout the strategy will choose at setup
        model = _meta_model(cfg)
        if shape is None:
            raise LaunchError(f"strategy=auto chooses the layout for the model and its batch shape, but {unknown}; "
                              "give the sizes instead, e.g.", [pinned(options)])
        searched = choose(model, num_nodes, devices, device_kind(cfg.trainer.accelerator), shape[0], shape[1],
                          str(cfg.trainer.precision), options)
        options = options.resolved(searched.best.candidate.layout.options())
    mesh = check_layout(options, num_nodes, devices)
    if model is None:
        model = _meta_model(cfg)
    # a network built in the module's setup hook exists only once the run starts: the strategy checks it then
    built = any(True for _ in model.parameters())
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
        memory = estimate_memory(
            model, stages, tp_sharded_parameters(assignments), mesh.tp_size, seq, batch // micro_batches,
            micro_batches, options.schedule_name, options.sequence_parallel,
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
        micro_batch_size=shape[0] // micro_batches if shape is not None else None,
        tokens_per_step=shape[0] * shape[1] * mesh.dp_size * accumulate if shape is not None else None,
        tp_plan=dict(Counter(f"{a.glob}: {a.entry.style}" for a in assignments if a.entry.style)),
        search=searched,
        memory_left_out=None if memory else unknown,
        share=planned_share(model, assignments, mesh.tp_size, stages if mesh.pp_size > 1 else None),
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


@lru_cache(maxsize=4)
def _loader_shape(data_config: str) -> tuple[int, int]:
    # once per data config: the fixes tried before printing change the layout, not the data
    return datamodule_shape(instantiate(OmegaConf.create(data_config), _convert_="all"))


def _meta_model(cfg: DictConfig) -> nn.Module:
    """The config's model on the meta device, as the strategy will see it: a ``from_pretrained`` inside
    reads no weights, and a network built in ``configure_model`` is built too."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_parallel.strategy.materialize import empty_parameters

    with empty_parameters(draws=False):
        model = instantiate(cfg.model)
        if isinstance(model, LightningModule) and is_overridden("configure_model", model, LightningModule):
            model.configure_model()
    return model


def device_kind(accelerator) -> str:
    """``"cuda"`` or ``"cpu"`` for a Trainer ``accelerator`` value."""
    if str(accelerator) in ("gpu", "cuda"):
        return "cuda"
    return "cuda" if str(accelerator) == "auto" and torch.cuda.is_available() else "cpu"


def _closest_first(values: list[int], target: int) -> list[int]:
    return sorted(values, key=lambda v: (abs(math.log(v / target)), -v))


def _candidate_fixes(cfg: DictConfig) -> list[Fix]:
    """Other layouts of the launch, the nearest to what was asked first."""
    options = parallel_options(cfg)
    nodes, devices = int(cfg.trainer.num_nodes), int(cfg.trainer.devices)
    world = nodes * devices
    tp, pp, dp = options.tp, options.pp, options.data_parallel
    strategy = cfg.get("strategy") if isinstance(cfg.get("strategy"), DictConfig) else {}
    fixes = []
    for t in _closest_first(divisors(devices), tp):  # keep the allocation, change the layout
        for p in _closest_first(divisors(world // t), pp):
            settings = {f"strategy.{name}": v for name, v, now in (("tensor_parallel", t, tp), ("pipeline_parallel", p, pp))
                        if v != now}
            if "data_parallel" in strategy and (settings or str(dp) != str(world // (t * p))):
                settings["strategy.data_parallel"] = world // (t * p)  # first: only the DP size changes
            if settings:
                fixes.append(Fix(settings, f"keep {nodes} node(s) x {devices} devices"))
    wanted = tp * pp * (int(dp) if str(dp).isdigit() else max(1, world // (tp * pp)))
    per_node = [d for d in divisors(wanted) if d % tp == 0]  # keep the layout, change the allocation
    for d in _closest_first(per_node, devices) if per_node else []:
        fixes.append(Fix({"trainer.num_nodes": wanted // d, "trainer.devices": d}, f"keep tp={tp} pp={pp}"))
    return fixes


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
    if isinstance(err, LaunchError) and not parallel_options(cfg).is_auto:
        fixes += _candidate_fixes(cfg)
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
def _search_flags() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lp-plan", allow_abbrev=False,
        description="Print the plan of an lp-train config; with --search, rank every layout of a cluster. "
                    "Other arguments are lp-train's Hydra overrides.")
    parser.add_argument("--search", action="store_true", help="rank layouts instead of checking the config's")
    add = parser.add_argument_group("cluster (default: the config's trainer.num_nodes and trainer.devices; "
                                    "rates not given are measured here)").add_argument
    add("--nodes", type=int, help="nodes")
    add("--devices-per-node", type=int, help="devices (processes) per node")
    add("--device-memory", type=float, help="GiB per device (default: the GPU's, or host memory / devices)")
    add("--tflops", type=float, help="sustained matmul TFLOP/s per device")
    add("--intra-bandwidth", type=float, help="all-reduce bus bandwidth inside a node, GB/s")
    add("--inter-bandwidth", type=float, help="all-reduce bus bandwidth across nodes, GB/s")
    add("--latency-us", type=float, help="microseconds per message")
    add("--optimizer-rate", type=float, help="millions of parameters per second an AdamW step updates")
    parser.add_argument("--global-batch", type=int,
                        help="sequences per optimizer step, split over the replicas (default: the batch the data "
                             "yields per replica, as strategy=auto reads it)")
    parser.add_argument("--seq-len", type=int,
                        help="tokens per sequence (default: as strategy=auto reads it from the data)")
    parser.add_argument("--top", type=int, default=5, help="layouts shown")
    return parser


def _rates(flags: argparse.Namespace, kind: str, devices: int, hidden: int) -> tuple[Rates, str]:
    """The rates from the flags, the missing ones measured here (or nominal where no device is)."""
    given = {"flops": flags.tflops and flags.tflops * 1e12,
             "intra_bandwidth": flags.intra_bandwidth and flags.intra_bandwidth * 1e9,
             "inter_bandwidth": flags.inter_bandwidth and flags.inter_bandwidth * 1e9,
             "latency": flags.latency_us and flags.latency_us * 1e-6,
             "optimizer": flags.optimizer_rate and flags.optimizer_rate * 1e6}
    missing = [k for k, v in given.items() if v is None]
    local = devices if kind == "cpu" else min(devices, torch.cuda.device_count())
    if not missing:
        return Rates(**given), "given"
    if local == 0 or missing == ["inter_bandwidth"]:
        source, base = f"nominal for {kind}", nominal(kind)
    else:
        source, base = f"measured with {local} local {kind} process(es)", measure(local, hidden, kind)
    rates = Rates(**{k: getattr(base, k) if v is None else v for k, v in given.items()})
    return rates, f"{', '.join(missing)} {source}; the rest given"


def search_layouts(flags: argparse.Namespace, overrides: list[str], prog: str = "lp-plan --search") -> SearchResult:
    """``lp-plan --search``: print the best layouts of the cluster for the config's model and batch."""
    cfg = compose_config(overrides)
    check_config(cfg)
    options = parallel_options(cfg)
    nodes = flags.nodes or int(cfg.trainer.num_nodes)
    devices = flags.devices_per_node or int(cfg.trainer.devices)
    kind = device_kind(cfg.trainer.accelerator)
    model = _meta_model(cfg)
    try:
        batch, seq = data_batch_shape(cfg)
    except BatchShapeUnknown as err:
        if flags.global_batch is None or flags.seq_len is None:
            raise ConfigurationError(f"{prog} ranks layouts for a batch shape, but {err}; give the shape instead:\n"
                                     "    --global-batch <sequences per optimizer step> --seq-len <tokens per sequence>"
                                     ) from None
        batch, seq = None, flags.seq_len
    seq = flags.seq_len or seq
    from lightning_parallel.planner.search import model_dims

    rates, source = _rates(flags, kind, devices, model_dims(model, options.pipeline_blocks).hidden)
    memory = flags.device_memory * 1024**3 if flags.device_memory else device_memory(kind, devices)
    cluster = Cluster(nodes, devices, memory, rates, shared_compute=kind == "cpu")
    work = Workload(int(seq), str(cfg.trainer.precision), global_batch=flags.global_batch,
                    replica_batch=None if flags.global_batch else int(batch), options=options)
    result = search(model, cluster, work, Constraints())
    batch_line = (f"global batch {flags.global_batch}" if flags.global_batch else f"batch {batch} per replica")
    print(f"model: {type(model).__name__}, {count_parameters(model) / 1e6:,.1f}M parameters, {batch_line} x {seq} "
          f"tokens, precision {cfg.trainer.precision}")
    print(f"cluster: {nodes} node(s) x {devices} {kind} devices of {memory / 1024**3:.1f} GiB; "
          f"{rates.flops / 1e12:.3g} TFLOP/s, {rates.intra_bandwidth / 1e9:.3g} GB/s in a node, "
          f"{rates.inter_bandwidth / 1e9:.3g} GB/s across, {rates.latency * 1e6:.0f} us per message, "
          f"AdamW {rates.optimizer:.3g} parameters/s ({source})")
    print(f"{len(result.ranked)} layouts fit, {len(result.too_big)} do not; best {min(flags.top, len(result.ranked))}:")
    print(report(result, flags.top))
    print(train_with(result, overrides, nodes, devices, per_replica=flags.global_batch is not None))
    return result


def train_with(result: SearchResult, overrides: list[str], nodes: int, devices: int, per_replica: bool) -> str:
    """The `lp-train` command that trains with the best layout: the user's overrides, ``strategy=auto``
    with every size pinned (no search at setup), the cluster's size and (``per_replica``: the search
    split a global batch) the batch per replica; tried before it is printed."""
    best = result.best.candidate
    settings = {f"strategy.{name}": value for name, value in best.layout.options().items()}
    settings.update({"trainer.num_nodes": nodes, "trainer.devices": devices})
    if per_replica:
        settings["data.batch_size"] = best.replica_batch
    auto = compose_config(["strategy=auto"])  # the group that holds every size
    command = ["strategy=auto"]
    for override in overrides:
        key = override.split("=")[0].lstrip("+~")
        if key.startswith("strategy.") and not override.startswith("~"):  # "+" as the auto group needs it
            override = ("" if has_key(auto, key) else "+") + override.lstrip("+")
        if key != "strategy":
            command.append(override)
    try:
        fixed = with_settings(command, settings, compose_config(command))
    except HydraException as err:
        return f"train with it: the overrides do not compose with strategy=auto:\n{err}"
    err = launch_error(fixed)
    if err is not None:
        return f"train with it: this launch would be refused:\n{explain_failure(err, 'lp-train', fixed, auto)}"
    text = f"train with it:\n    {command_line('lp-train', fixed)}"
    if best.layout.recompute:
        text += ("\n    and turn on activation checkpointing of every block in the model "
                 "(e.g. gradient_checkpointing_enable())")
    return text


def _flags_of(argv: list[str], overrides: list[str]) -> list[str]:
    """``argv`` without ``overrides`` (argparse's leftovers, in order): the flags as given."""
    rest, flags = list(overrides), []
    for arg in argv:
        if rest and arg == rest[0]:
            rest.pop(0)
        else:
            flags.append(arg)
    return flags


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = _search_flags()
    flags, overrides = parser.parse_known_args(argv)
    cluster_flags = [k for k, v in vars(flags).items() if v is not None and k not in ("search", "top")]
    if cluster_flags and not flags.search:
        parser.error(f"--{cluster_flags[0].replace('_', '-')} describes the cluster to search: add --search")
    prog = command_line("lp-plan", _flags_of(argv, overrides))
    enter_command(prog, overrides)
    try:
        if flags.search:
            search_layouts(flags, overrides, prog)
        else:
            dry_run(compose_config(overrides))
    except LightningParallelError as err:
        found = "strategy=auto finds no layout" if isinstance(err, PlanError) else "this launch would fail"
        print(f"{prog}: {found}:\n{explain_failure(err, prog, overrides, compose_config(overrides))}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
