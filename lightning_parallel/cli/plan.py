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
import sys

import torch
from hydra.errors import HydraException

from lightning_parallel.cli.config_checks import check_config, parallel_options
from lightning_parallel.cli.entry import enter_command
from lightning_parallel.cli.launch_plan import (
    data_batch_shape,
    data_example,
    device_kind,
    dry_run,
    explain_failure,
    launch_error,
    meta_model,
)
from lightning_parallel.cli.overrides import compose_config
from lightning_parallel.cli.suggest import (
    command_line,
    has_key,
    with_settings,
)
from lightning_parallel.errors import (
    ConfigurationError,
    LightningParallelError,
)
from lightning_parallel.planner import (
    Cluster,
    Constraints,
    PlanError,
    SearchResult,
    Workload,
    search,
)
from lightning_parallel.planner.auto import device_memory, nothing_to_choose, report
from lightning_parallel.planner.batch import (
    BatchShapeUnknown,
)
from lightning_parallel.planner.calibrate import measure, nominal
from lightning_parallel.planner.estimate import (
    count_parameters,
    transformer_dims,
)
from lightning_parallel.planner.profile import matmul_width
from lightning_parallel.planner.space import Rates


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
    model = meta_model(cfg)
    try:
        batch, seq = data_batch_shape(cfg)
    except BatchShapeUnknown as err:
        if flags.global_batch is None or flags.seq_len is None:
            raise ConfigurationError(f"{prog} ranks layouts for a batch shape, but {err}; give the shape instead:\n"
                                     "    --global-batch <sequences per optimizer step> --seq-len <tokens per sequence>"
                                     ) from None
        batch, seq = None, flags.seq_len
    seq = flags.seq_len or seq
    work = Workload(int(seq), str(cfg.trainer.precision), global_batch=flags.global_batch,
                    replica_batch=None if flags.global_batch else int(batch), options=options,
                    example=None if transformer_dims(model) else data_example(cfg))
    profile = work.profile_of(model)
    rates, source = _rates(flags, kind, devices, matmul_width(profile))
    memory = flags.device_memory * 1024**3 if flags.device_memory else device_memory(kind, devices)
    cluster = Cluster(nodes, devices, memory, rates, shared_compute=kind == "cpu")
    result = search(model, cluster, work, Constraints(cp=options.cp, ep=options.ep), profile)  # CP, EP only where asked
    batch_line = (f"global batch {flags.global_batch}" if flags.global_batch else f"batch {batch} per replica")
    print(f"model: {type(model).__name__}, {count_parameters(model) / 1e6:,.1f}M parameters, {batch_line} x {seq} "
          f"tokens, precision {cfg.trainer.precision}")
    print(f"cluster: {nodes} node(s) x {devices} {kind} devices of {memory / 1024**3:.1f} GiB; "
          f"{rates.flops / 1e12:.3g} TFLOP/s, {rates.intra_bandwidth / 1e9:.3g} GB/s in a node, "
          f"{rates.inter_bandwidth / 1e9:.3g} GB/s across, {rates.latency * 1e6:.0f} us per message, "
          f"AdamW {rates.optimizer:.3g} parameters/s ({source})")
    print(f"costs: {profile.describe()}")
    if result.nothing_to_choose:
        print(nothing_to_choose(result, model))
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
