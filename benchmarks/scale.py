"""A 4,096-rank setup rehearsal in one process: what each rank builds and holds, without a cluster.

torch's ``"fake"`` process-group backend lets one process be rank ``r`` of a ``W``-rank job: groups
are created as on a cluster, and collectives return at once without communicating. For each model
and world size the process plays rank 0, the middle rank and the last rank in turn and runs the
strategy's setup pieces in the strategy's order (``ParallelStrategy.setup_environment`` and
``_split``), with the package's own code:

1. the mesh: ``ParallelMesh.init_process_groups`` (this rank's TP, DP and PP groups and the
   ``DeviceMesh`` over them);
2. the model, built on the meta device from the recipe's config (as ``lp-plan`` does);
3. TP sharding: ``tensor_parallel.parallelize`` with the detected plan;
4. the stage partition: ``PipelineEngine.partition`` (drops the other stages, creates the
   tied-weight groups);
5. the DP gradient buckets: ``GradientSynchronizer`` (data_parallel > 1);
6. the optimizer: the module's ``configure_optimizers()``, then one AdamW step on meta gradients,
   which allocates its two moment tensors as the first real step does.

Parameters stay on the meta device throughout, so a 70B model costs no memory; the bytes below are
those of the meta tensors each rank holds: parameters, gradients (the DP buckets, or one gradient per
parameter without DP) and AdamW state. They are compared with the estimate of ``lp-plan``
(``estimate.py``) for the same config. The models: the recipes ``gpt_1p3b_3d`` and ``llama_7b_3d``,
and a Llama-2-70B shape (``llama_7b_3d`` with h=8192, 80 layers, 64 heads, 8 KV heads, FFN 28,672).

Not rehearsed, because the fake backend cannot or need not do it: materialising this rank's shards
(``init.materialize`` allocates real memory, the very thing avoided here); tracing the run order on a
first batch (meta parameters cannot run a forward; the strategy skips it on meta models too); every
collective's result (broadcast of the seed and of module states, the tied-weight and DP gradient
reductions, the pipeline's point-to-point warm-up); and the TCP rendezvous of ``init_process_group``.

    python benchmarks/scale.py [--worlds 64 1024 4096] [--models gpt-1.3b llama-7b llama-70b]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch.distributed.device_mesh import init_device_mesh

from lightning_parallel import compat
from lightning_parallel.cli.launch_plan import build_plan
from lightning_parallel.cli.overrides import compose_config
from lightning_parallel.data_parallel.grad_sync import GradientSynchronizer
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline import PipelineEngine
from lightning_parallel.tensor_parallel import parallelize

GiB = 2**30
LLAMA_70B = [
    "model.config.hidden_size=8192", "model.config.intermediate_size=28672", "model.config.num_hidden_layers=80",
    "model.config.num_attention_heads=64", "model.config.num_key_value_heads=8",
]
# name: (recipe overrides, tensor_parallel, pipeline_parallel)
MODELS = {
    "gpt-1.3b": (["+recipe=gpt_1p3b_3d"], 2, 2),
    "llama-7b": (["+recipe=llama_7b_3d"], 4, 2),
    "llama-70b": (["+recipe=llama_7b_3d", *LLAMA_70B], 8, 8),
}
DEVICES_PER_NODE = 8


def config_overrides(model: str, world: int) -> list[str]:
    """The `lp-train` overrides of ``model`` on ``world`` ranks (8 per node, DP takes the rest)."""
    overrides, tp, pp = MODELS[model]
    return [*overrides, f"trainer.num_nodes={world // DEVICES_PER_NODE}", f"trainer.devices={DEVICES_PER_NODE}",
            f"strategy.tensor_parallel={tp}", f"strategy.pipeline_parallel={pp}",
            f"strategy.data_parallel={world // (tp * pp)}"]


@dataclass
class RankSetup:
    """What one rank built and holds after setup."""

    model: str
    world: int
    rank: int
    stage: int
    dp: int
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    estimate: tuple[int, float, float, float]  # lp-plan: parameters, their bytes, gradient and AdamW bytes
    seconds: float
    mesh_seconds: float
    new_group_calls: int
    groups_held: int


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rehearse(model_name: str, world: int, rank: int, cfg, estimate) -> RankSetup:
    """Play ``rank`` of ``world`` with the composed `lp-train` config ``cfg``: the setup pieces listed
    in the module docstring, timed. ``estimate``: ``lp_plan_estimate(cfg)``."""
    tp, pp = cfg.strategy.tensor_parallel, cfg.strategy.pipeline_parallel
    dist.init_process_group("fake", store=compat.fake_store(), rank=rank, world_size=world)
    try:
        quiet = contextlib.redirect_stdout(io.StringIO())  # parallelize prints its plan on one rank per stage
        with compat.counting_new_group_calls() as calls, quiet:
            start = time.perf_counter()
            mesh = ParallelMesh(world, tensor_parallel=tp, pipeline_parallel=pp).init_process_groups(rank)
            mesh_seconds = time.perf_counter() - start
            with torch.device("meta"):
                model = instantiate(cfg.model)
            options = cfg.strategy
            sequence_parallel = options.get("sequence_parallel", False)
            parallelize(model, mesh, plan=options.get("tp_plan"), sequence_parallel=sequence_parallel)
            engine = PipelineEngine(model, mesh, ParallelOptions(micro_batches=options.micro_batches, schedule=options.schedule))
            engine.partition()
            params = [p for p in model.parameters() if p.requires_grad]
            if mesh.dp_size > 1:
                sync = GradientSynchronizer(params, mesh.dp_group, 25.0)
                grad_bytes = sum(_bytes([b.buffer]) for b in sync.buckets)
                for bucket in sync.buckets:  # where the gradients live during training
                    for p, view in zip(bucket.params, bucket.views):
                        p.grad = view
            else:
                for p in params:
                    p.grad = torch.empty_like(p)
                grad_bytes = _bytes(p.grad for p in params)
            optimizer = model.configure_optimizers()
            optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
            optimizer.step()  # allocates AdamW's moments, on meta like the parameters
            seconds = time.perf_counter() - start
        # AdamW's step counters are CPU scalars, not per-element state
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        return RankSetup(
            model_name, world, rank, mesh.pp_rank, mesh.dp_size, sum(p.numel() for p in model.parameters()),
            _bytes(model.parameters()), grad_bytes, _bytes(state), estimate[mesh.pp_rank], seconds, mesh_seconds,
            calls[0], compat.groups_held(),
        )
    finally:
        dist.destroy_process_group()


def lp_plan_estimate(cfg) -> list[tuple[int, float, float, float]]:
    """``lp-plan``'s per-stage parameters and parameter, gradient and AdamW bytes for ``cfg``."""
    with contextlib.redirect_stdout(io.StringIO()):
        plan = build_plan(cfg, env={})
    return [(m.params, m.param_bytes, m.grad_bytes, m.optimizer_bytes) for m in plan.memory]


def torch_device_mesh_calls(world: int, shape: tuple[int, int, int]) -> tuple[int, float]:
    """``new_group`` calls and seconds of torch's ``init_device_mesh`` on the last rank (no split_group)."""
    dist.init_process_group("fake", store=compat.fake_store(), rank=world - 1, world_size=world)
    try:
        with compat.counting_new_group_calls() as calls:
            start = time.perf_counter()
            init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
            return calls[0], time.perf_counter() - start
    finally:
        dist.destroy_process_group()


def _ratio(measured: float, estimated: float) -> str:
    return f"{measured / estimated:6.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 1024, 4096])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    rows: list[RankSetup] = []
    for name in args.models:
        for i, world in enumerate(args.worlds):
            cfg = compose_config(config_overrides(name, world))
            estimate = lp_plan_estimate(cfg)
            if i == 0:  # first imports and lazy initialisations, not reported
                rehearse(name, world, 0, cfg, estimate)
            for rank in (0, world // 2, world - 1):
                rows.append(rehearse(name, world, rank, cfg, estimate))
    print("Per rank after setup (GiB; 'est' = lp-plan's estimate; ratio = measured / estimate)")
    print(f"{'model':<10} {'world':>5} {'rank':>5} {'stage':>5} {'dp':>5} {'params':>13} {'param':>6} {'grad':>6} "
          f"{'adamw':>6} {'est p/g/o':>17} {'ratio p/g/o':>21} {'setup s':>7} {'mesh ms':>7} {'calls':>5} {'held':>4}")
    for r in rows:
        n, p_est, g_est, o_est = r.estimate
        print(f"{r.model:<10} {r.world:>5} {r.rank:>5} {r.stage:>5} {r.dp:>5} {r.params:>13,} "
              f"{r.param_bytes / GiB:6.2f} {r.grad_bytes / GiB:6.2f} {r.optimizer_bytes / GiB:6.2f} "
              f"{p_est / GiB:5.2f}/{g_est / GiB:5.2f}/{o_est / GiB:5.2f} "
              f"{_ratio(r.param_bytes, p_est)}/{_ratio(r.grad_bytes, g_est)}/{_ratio(r.optimizer_bytes, o_est)} "
              f"{r.seconds:7.2f} {r.mesh_seconds * 1e3:7.1f} {r.new_group_calls:>5} {r.groups_held:>4}")
    print("\n'calls': new_group calls this rank made during setup; 'held': process groups it is in (default included).")
    print("\nPer rank against world size (median of the three ranks; GiB of parameters+gradients+AdamW on the "
          "last rank):")
    print(f"{'model':<10} " + " ".join(f"{f'{w} ranks':>34}" for w in args.worlds))
    for name in args.models:
        cells = []
        for world in args.worlds:
            mine = [r for r in rows if r.model == name and r.world == world]
            last = mine[-1]
            seconds = statistics.median(r.seconds for r in mine)
            mesh_ms = statistics.median(r.mesh_seconds for r in mine) * 1e3
            total = (last.param_bytes + last.grad_bytes + last.optimizer_bytes) / GiB
            cell = f"{seconds:.2f} s (mesh {mesh_ms:.1f} ms) {total:.2f} GiB {last.new_group_calls} calls"
            cells.append(f"{cell:>34}")
        print(f"{name:<10} " + " ".join(cells))
    print("\ntorch's init_device_mesh for the same (pp=8, dp, tp=8) mesh, without NCCL's split_group (gloo, fake):")
    for world in args.worlds:
        calls, seconds = torch_device_mesh_calls(world, (8, world // 64, 8))
        print(f"  {world:>5} ranks: {calls:>5} new_group calls per rank, {seconds * 1e3:7.1f} ms (fake backend)")
    print("\nNot rehearsed (see the module docstring): materialising shards, tracing the run order on a batch, "
          "the results of collectives, the TCP rendezvous.")


if __name__ == "__main__":
    main()
