"""The ordered split of a module over the mesh: one function, the steps in the order they must run.

``split_model`` is what ``ParallelStrategy.setup`` runs once on a module it has not split before.
The order matters and each step says why it comes where it does:

1. **initial values**: every rank starts from rank 0's single-device initialisation. A model with
   values (on the host or already on the device) is broadcast; a model built on the meta device
   broadcasts only what its construction recorded (``materialize.py``), and is materialised in
   step 5;
2. **tensor parallelism** shards the modules a plan names (``tensor_parallel/``); whole copies of one
   unit of each kind for the split check are taken first (``checks/``);
3. **pipeline parallelism** keeps only this rank's stage, traced on the first batch (``pipeline/``);
4. **ZeRO-2/3** shards what is left over the data-parallel replicas (``data_parallel/fully_sharded.py``;
   over runs of ``zero_shard_size`` of them under hybrid sharding), after the TP split has been
   checked against the whole copies;
5. a meta-device model is **materialised**: only this rank's stage and shards are ever allocated,
   with the values construction would have given them; then **expert parallelism** keeps this rank's
   whole experts of every MoE layer (``strategy/experts.py``), each split by TP already, so the TP
   hooks around an experts module enclose its all-to-all exchange. It comes after materialisation so
   that one step serves models built with values and on meta alike (whole experts exist on a rank only
   for that moment), and it composes with neither pipeline parallelism nor ZeRO-2/3 (refused), which
   therefore never see placed experts;
6. what is left moves to the rank's device.

Context parallelism hooks the blocks afterwards (it changes no parameter), and data parallelism
hooks the parameters left once the optimizers exist (``parallel.py``). The layout of the steps
follows torchtitan's one ordered ``parallelize`` function; the sharding of every step is Megatron-LM's
(Shoeybi et al. 2019, arXiv 1909.08053; Narayanan et al. 2021, arXiv 2104.04473).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_parallel.checks.share import measured_share
from lightning_parallel.checks.verify_split import check_split_against_whole, prepare_split_check
from lightning_parallel.compat import _sync_module_states, attached_trainer
from lightning_parallel.data_parallel.fully_sharded import FullySharded
from lightning_parallel.errors import LaunchError
from lightning_parallel.pipeline import PipelineEngine
from lightning_parallel.pipeline.errors import PipelineConfigError, PipelineIncompatibleModel
from lightning_parallel.pipeline.example import first_batch
from lightning_parallel.pipeline.partition import find_blocks
from lightning_parallel.strategy.experts import place_experts
from lightning_parallel.strategy.materialize import (
    UnsplitModel,
    broadcast_on_host,
    broadcast_recorded_values,
    has_meta_parameters,
    materialize,
    on_host,
)
from lightning_parallel.strategy.whole_state_dict import accept_whole_state_dicts
from lightning_parallel.tensor_parallel import parallelize

if TYPE_CHECKING:
    from lightning_parallel.strategy.parallel import ParallelStrategy


def split_model(strategy: "ParallelStrategy", module: Any) -> None:
    """Steps 1 to 6 of the module docstring, in order, on ``strategy``'s module ``module``."""
    options, mesh = strategy.options, strategy.mesh
    strategy.pipeline = None
    on_meta = has_meta_parameters(module)
    _agree_on_build(strategy, on_meta)
    # 1. initial values
    if on_meta:  # nothing to broadcast but values construction computed: the rest is replayed from one seed
        unsplit = UnsplitModel.of(module)
        seed = strategy.broadcast(torch.initial_seed())
        broadcast_recorded_values(module)
    elif on_host(module):  # split in host memory: only this rank's stage and shards reach the device
        broadcast_on_host(module)
    else:  # built on the device already (trainer.init_module() without empty_init)
        strategy.model_to_device()
        _sync_module_states(module)
    # 2. tensor parallelism
    if options.tp > 1:
        if options.verify_split:  # whole copies, before the split
            strategy._split_check = prepare_split_check(module, mesh, options)
        parallelize(module, mesh, plan=options.tp_plan, sequence_parallel=options.sequence_parallel)
    # 3. pipeline parallelism
    if options.pp > 1:
        _keep_stage(strategy, module, on_meta)
    # 4. ZeRO-2/3
    if options.shards_parameters and mesh.dp_size > 1:
        _check_split_before_sharding(strategy, module, on_meta)
        _shard_over_replicas(strategy, module)
    # 5. materialisation of a meta-device model
    if on_meta:
        materialize(module, unsplit, mesh.tp_rank, mesh.tp_size, strategy.root_device, seed)
    # 5b. expert parallelism: each rank keeps its whole experts (of its TP shard), tokens sent to them
    strategy.experts = place_experts(module, mesh)
    # 6. to the device
    strategy.model_to_device()
    if strategy.fully_sharded is not None:
        strategy.fully_sharded.ready()
    if strategy.pipeline is not None:
        strategy.pipeline.link.device = strategy.root_device
    if strategy.splits_parameters:
        accept_whole_state_dicts(module, mesh.tp_rank, mesh.tp_size)  # load_state_dict of the unsplit model's
        strategy._split_module = weakref.ref(module)
        strategy.parameter_share = measured_share(module, strategy._unsplit_counts[""][0])


def _agree_on_build(strategy: "ParallelStrategy", on_meta: bool) -> None:
    """Refuse, on every rank, a model built on the meta device on some ranks and with values on others
    (their splits would start with different collectives)."""
    flags = torch.tensor([int(on_meta), -int(on_meta)], device=strategy.root_device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0] != -flags[1]:
        raise LaunchError(
            "the model was built on the meta device (empty_init) on some ranks and with values on others; "
            "build it the same way on every rank"
        )


def _keep_stage(strategy: "ParallelStrategy", module: Any, on_meta: bool) -> None:
    """Step 3: the pipeline engine partitions the model on the order its modules run in on the first
    batch (traced on the meta device for a meta-device model) and keeps this rank's stage."""
    if strategy.options.tp > 1 and not on_meta:
        # the trace runs the TP collectives, which NCCL runs on device tensors only: this rank's
        # TP shard of every stage moves now, the other stages are dropped on the device below
        strategy.model_to_device()
    strategy.pipeline = PipelineEngine(module, strategy.mesh, strategy.options)
    trainer = attached_trainer(module)
    example, step = first_batch(trainer, strategy) if trainer is not None else (None, "training_step")
    if not on_meta:  # traced where the parameters are (the CPU unless moved just above)
        example = move_data_to_device(example, next(module.parameters()).device)
    strategy.pipeline.partition(example, step)


def _check_split_before_sharding(strategy: "ParallelStrategy", module: Any, on_meta: bool) -> None:
    """The TP split check (``checks/verify_split.py``) compares split units with whole copies parameter by
    parameter; under ZeRO-2/3 it runs now, on this rank's stage and shards before their rows are spread
    over the replicas. A model built on the meta device has no values yet: it is not checked."""
    if strategy._split_check is None:
        return
    if on_meta:
        rank_zero_warn("ZeRO-2/3 on a model built on the meta device: its tensor-parallel split is not checked "
                       "against the whole model (the check needs values before the parameters are sharded)")
    else:
        strategy.model_to_device()
        if strategy.pipeline is not None:
            strategy.pipeline.link.device = strategy.root_device
        strategy.split_verification = check_split_against_whole(strategy, attached_trainer(module),
                                                                strategy._split_check)
    strategy._split_check = None


def _shard_over_replicas(strategy: "ParallelStrategy", module: Any) -> None:
    """Step 4: ZeRO-2/3 over the data-parallel group, one unit per block; with ``zero_shard_size`` over
    the 2-D mesh of hybrid sharding (sharded inside runs of that many replicas, replicated across them)."""
    strategy.fully_sharded = FullySharded(
        module, sharding_units(module, strategy.pipeline, strategy.options.pipeline_blocks),
        strategy.mesh.zero_mesh, strategy.options.zero, keep_gathered=strategy.pipeline is not None,
        mp_policy=gather_policy(strategy.precision_plugin.precision),
    )
    if strategy.pipeline is not None:
        strategy.pipeline.replace_parameters(strategy.fully_sharded.replaced)


def gather_policy(precision: Any) -> Optional[MixedPrecisionPolicy]:
    """Under ``precision="bf16-mixed"`` (or ``"16-mixed"``) ZeRO-2/3 gathers parameters in the precision
    autocast computes in, halving the bytes gathered and held, and reduces gradients in float32; the
    optimizer steps float32 shards. Otherwise parameters are gathered and reduced as they are."""
    low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low is not None else None


def sharding_units(module: Any, pipeline: Optional[PipelineEngine], blocks: Optional[str]) -> list[Any]:
    """The modules gathered one at a time under ZeRO-3: every module of the type of the model's repeated
    blocks (those the pipeline splits; a ResNet's bottlenecks of every stage), innermost first. A model
    without repeated blocks is one unit, gathered for the whole step."""
    try:
        path = pipeline.plan.blocks_path if pipeline is not None else find_blocks(module, blocks)[0]
    except (PipelineConfigError, PipelineIncompatibleModel):
        return []
    kinds = {type(block) for block in module.get_submodule(path) if any(True for _ in block.parameters())}
    units = [m for m in module.modules() if type(m) in kinds and any(True for _ in m.parameters())]
    return units[::-1]
