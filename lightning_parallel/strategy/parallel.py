"""``ParallelStrategy``: data, tensor, pipeline, context and expert parallelism for an unchanged LightningModule.

The strategy owns the process mesh and, at setup, composes the parts in a fixed order:

1. the module is split once, by ``compose.split_model``: every rank starts from rank 0's initial
   values, tensor parallelism shards the modules a plan names, pipeline parallelism keeps this rank's
   stage, ZeRO-2/3 shards what is left over the replicas, and a model built on the meta device is
   materialised with only this rank's part;
2. context parallelism hooks the model's blocks to split each sequence over the CP ranks
   (``context_parallel/``);
3. the optimizers are created from what is left, and data parallelism hooks the local parameters
   (``data_parallel/``), averaging gradients over the DP and CP ranks together;
4. the split is checked against the whole model on a real batch (``checks/``): in the run's first step,
   so the user's step runs exactly as often as under Lightning's ``ddp`` (``checks/first_step.py``), or
   at setup where the pipeline traces its stages anyway.

After each backward window, gradients are finalised in Megatron-LM's order (``gradients.py``).
Clipping by norm then uses the norm of the whole model (``clipping.py``). With ``replica_groups > 1`` the optimizer
step is wrapped by torchft's quorum and commit, the gradients averaged over the live groups
(``fault_tolerance/``). Checkpoints
(``checkpointing.py``) and collectives (``collectives.py``) are mixed in. A module is split once:
later ``validate``/``test``/``predict``/``fit`` calls on the same Trainer reuse the split (launched
by popen or torchrun), or receive the trained full weights in the parent process (fork, spawn:
``launcher.py``).
"""

from __future__ import annotations

import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy as _LightningParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.checks.launch import validate_launch
from lightning_parallel.checks.first_step import FirstStepCheck
from lightning_parallel.checks.share import Share
from lightning_parallel.checkpoint.background import BackgroundSaves
from lightning_parallel.checks.trainer_flags import refuse_split_model_flags
from lightning_parallel.checks.verify_split import SplitChecker, Verification, check_split_against_whole
from lightning_parallel.compat import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _optimizers_to_device,
    attached_trainer,
    module_hidden_from_teardown,
    set_skip_backward,
    tree_flatten,
    uses_distributed_sampler,
)
from lightning_parallel.context_parallel import ContextParallel
from lightning_parallel.data_parallel import GradientSynchronizer
from lightning_parallel.data_parallel.buffers import BufferBroadcast
from lightning_parallel.data_parallel.fully_sharded import FullySharded
from lightning_parallel.data_parallel.zero import ZeroOneSharding, refuse_whole_tensor_optimizers
from lightning_parallel.errors import LightningParallelError, python_arguments
from lightning_parallel.expert_parallel import ExpertParallel
from lightning_parallel.fault_tolerance.groups import ReplicaGroups
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline.generation import generating_steps
from lightning_parallel.pipeline.partition import find_blocks
from lightning_parallel.planner import SearchResult
from lightning_parallel.planner.auto import choose_for
from lightning_parallel.strategy.averaging import average_held_parts
from lightning_parallel.strategy.checkpointing import SplitCheckpoints
from lightning_parallel.strategy.clipping import clip_grads_by_global_norm
from lightning_parallel.strategy.collectives import MeshCollectives
from lightning_parallel.strategy.data_order import data_order_note
from lightning_parallel.strategy.compose import split_model
from lightning_parallel.strategy.experts import dense_part, gradient_synchronizer, log_tokens_per_expert
from lightning_parallel.strategy.gradients import GradientFinalizer, shared_across_stages
from lightning_parallel.strategy.launcher import MultiProcessingLauncher, SubprocessScriptLauncher
from lightning_parallel.strategy.materialize import builds_later, empty_parameters, has_meta_parameters
from lightning_parallel.strategy.metric_sync import sync_metrics_per_replica
from lightning_parallel.strategy.requeue import DeferredRequeue
from lightning_parallel.strategy.summary import parameters_per_module, report_whole_model
from lightning_parallel.strategy.watchdog import LostRankError, RankWatchdog

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ParallelStrategy(SplitCheckpoints, MeshCollectives, _LightningParallelStrategy):
    """Data x tensor x pipeline x context x expert parallelism on one process mesh.

    Args:
        data_parallel, tensor_parallel, pipeline_parallel, context_parallel, expert_parallel, micro_batches,
        schedule, virtual_stages, sequence_parallel, tp_plan, pipeline_blocks, pipeline_layout, bucket_size_mb,
        zero_stage, zero_shard_size, broadcast_buffers, verify_split, replica_groups, replica_group, lighthouse:
            the layout and its options, each documented on ``ParallelOptions`` (``options.py``).
            A size given as ``"auto"`` (tensor_parallel, pipeline_parallel, schedule,
            virtual_stages, zero_stage): at setup, every rank takes the planner's best layout for
            the model, the world and the batch shape, searching each such argument (and
            ``micro_batches`` when None) and keeping the others (``planner/auto.py``).
        start_method: ``"popen"`` (run the script once per rank, as torchrun does), ``"spawn"``,
            ``"fork"`` or ``"forkserver"``, as in Lightning's ``DDPStrategy``.
        timeout: timeout of collective operations.
        async_checkpoint: stage each checkpoint in host memory and write it in the background while
            training goes on (``checkpoint/background.py``), as Lightning's ``AsyncCheckpointIO``
            plugin asks for too.
        lost_rank_timeout: seconds without a heartbeat after which a rank counts as lost and the others
            end with an error naming it, instead of waiting for ``timeout`` inside a collective
            (``watchdog.py``); None: no watchdog.
    """

    strategy_name = "lp_3d"
    front_end: Optional[str] = None  # the class a script built, when another front end drives this one (Fabric)

    def __init__(
        self,
        data_parallel: Union[int, str] = "auto",
        tensor_parallel: Union[int, str] = 1,
        pipeline_parallel: Union[int, str] = 1,
        context_parallel: int = 1,
        expert_parallel: int = 1,
        micro_batches: Optional[int] = None,
        schedule: str = "1f1b",
        virtual_stages: Union[int, str] = 1,
        sequence_parallel: bool = False,
        tp_plan: Optional[dict] = None,
        pipeline_blocks: Optional[str] = None,
        pipeline_layout: Optional[list[int]] = None,
        bucket_size_mb: float = 25.0,
        zero_stage: Union[int, str] = 0,
        zero_shard_size: Optional[int] = None,
        broadcast_buffers: bool = True,
        verify_split: bool = True,
        replica_groups: int = 1,
        replica_group: int = 0,
        lighthouse: Optional[str] = None,
        start_method: StartMethod = "popen",
        timeout: Union[timedelta, float] = timedelta(minutes=30),
        async_checkpoint: bool = False,
        lost_rank_timeout: Optional[float] = 60.0,
        process_group_backend: Optional[str] = None,
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got {start_method!r}")
        self.options = ParallelOptions(
            tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel, data_parallel=data_parallel,
            context_parallel=context_parallel, expert_parallel=expert_parallel, micro_batches=micro_batches,
            schedule=schedule, virtual_stages=virtual_stages,
            sequence_parallel=sequence_parallel, tp_plan=tp_plan, pipeline_blocks=pipeline_blocks,
            pipeline_layout=pipeline_layout, bucket_size_mb=bucket_size_mb, zero_stage=zero_stage,
            zero_shard_size=zero_shard_size, broadcast_buffers=broadcast_buffers, verify_split=verify_split,
            replica_groups=replica_groups, replica_group=replica_group, lighthouse=lighthouse,
        )
        self.layout_search: Optional[SearchResult] = None  # the ranked layouts "auto" chose from (once, at setup)
        self._start_method = start_method
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._process_group_backend = process_group_backend
        self._async_checkpoint = async_checkpoint
        self._lost_rank_timeout = lost_rank_timeout
        self.watchdog: Optional[RankWatchdog] = None  # during a Trainer call on several processes
        self._calls = 0  # Trainer calls set up in this process: the same count on every rank
        self._num_nodes = 1
        self.mesh: Optional[ParallelMesh] = None
        self.grad_sync: Optional[GradientSynchronizer] = None
        self.pipeline = None  # pipeline.PipelineEngine when pipeline_parallel > 1
        self.zero: Optional[ZeroOneSharding] = None
        self.context_parallel: Optional[ContextParallel] = None  # the sequence split, when context_parallel > 1
        # evaluation steps that call generate(): under context parallelism they run unsplit (``_in_sequence_split``)
        self._unsplit_steps: frozenset[str] = frozenset()
        self.fully_sharded: Optional[FullySharded] = None  # ZeRO-2/3
        self.experts: Optional[ExpertParallel] = None  # the placed experts, when expert_parallel > 1
        self._sync_blocked = False
        self._backward_split = ExitStack()  # the sequence split from pre_backward to post_backward
        self._requeue = DeferredRequeue(None)
        self._unsplit_counts: dict[str, tuple[int, int]] = {}  # parameters per module before the split
        self._first_step: Optional[FirstStepCheck] = None  # the split checked in the first step (checks/first_step.py)
        self._split_module: Optional[weakref.ref] = None  # the module split by _split, kept across Trainer calls
        self._empty_init = False  # init_module(empty_init=True) was asked: configure_model builds on meta too
        self.finalize_gradients: Optional[GradientFinalizer] = None
        self.buffer_broadcast: Optional[BufferBroadcast] = None  # DDP's broadcast_buffers over the DP group
        self._split_check: Optional[SplitChecker] = None  # the whole copies to compare the split with
        self.split_verification: Optional[Verification] = None  # what the check compared, and its cost
        self.parameter_share: Optional[Share] = None  # what the largest rank holds of the split model
        self.data_order: Optional[str] = None  # the start-of-training note on the training batches' order
        self.replicas: Optional[ReplicaGroups] = None  # this group's place among replica_groups > 1 (torchft)

    # ---- what Lightning asks of a parallel strategy ---------------------------------------------
    @property
    def is_distributed(self) -> bool:
        # read by Lightning to inject the DistributedSampler and to honour self.log(sync_dist=True)
        return True

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(pp, dp, tp)`` DeviceMesh whose dimension groups this strategy communicates on, for
        DTensors or FSDP2 on the same groups (available once the processes are set up)."""
        if self.mesh is None:
            raise RuntimeError("the device mesh exists once the strategy has set up its processes (Trainer.fit)")
        return self.mesh.device_mesh

    @property
    def is_model_split(self) -> bool:
        return self.options.is_model_split

    @property
    def splits_parameters(self) -> bool:
        """Whether a rank holds only part of the model's parameters: a TP shard, a pipeline stage, or
        (ZeRO-2/3 over several replicas) rows of every parameter."""
        return self.is_model_split or (self.options.shards_parameters and self._planned_mesh().dp_size > 1)

    @override
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # all TP shards, CP ranks and pipeline stages of one replica read the same batch; replica groups
        # read their own shares
        mesh, groups = self._planned_mesh(), self.options.replica_groups
        return {"num_replicas": groups * mesh.dp_size,
                "rank": self.options.replica_group * mesh.dp_size + mesh.coords(self.global_rank).dp}

    def _resolve_sizes(self, trainer: Any) -> None:
        """Presets fill in the size they spread over all processes (see ``presets.py``); sizes given
        as "auto" take the planner's best layout for ``trainer``'s data, chosen before any collective
        (in the launching process, or on every rank where processes are started externally)."""
        if self.options.is_auto:
            # a data module building the first batch's loader may ask for the mesh meanwhile: it reads the
            # defaults (any DP size gives the batch shape the search reads: a loader's batch_size is per replica)
            searched, self.options = self.options, self.options.unsearched()
            self.layout_search = choose_for(self, trainer, searched)
            self.options = searched.resolved(self.layout_search.best.candidate.layout.options())

    @property
    def searches_layout(self) -> bool:
        """Whether sizes given as "auto" are still to be chosen (from the model and the batch shape)."""
        return self.options.is_auto

    def _planned_mesh(self) -> ParallelMesh:
        if self.mesh is not None:
            return self.mesh
        module = self.lightning_module
        self._resolve_sizes(attached_trainer(module) if module is not None else None)
        return ParallelMesh(self.num_nodes * self.num_processes, **self.options.mesh_sizes)

    def check_launch(self, trainer: Any) -> ParallelMesh:
        """Every check that needs no process group, for ``trainer``'s module: sizes given as "auto"
        resolved, then the allocation, the layout, the model's split and the Trainer's features.

        The launchers run it in the launching process before any worker starts, and every rank runs
        it again before its first collective, so a bad launch fails once, as the last line, or on
        every rank alike instead of hanging. Raises ``LaunchError`` with its fixes written as this
        class's arguments (`lp-train`, which checks first, writes them as overrides).
        """
        module = self.lightning_module
        with self._refusals_in_arguments():
            self._resolve_sizes(trainer)
            mesh = validate_launch(
                self.options, self.num_nodes, self.num_processes,
                model=module if self._checks_model(module) and not builds_later(module) else None,
                automatic_optimization=module is None or module.automatic_optimization,
                loss_scaler=getattr(self.precision_plugin, "scaler", None) is not None,
            )
            if trainer is not None and self.splits_parameters:
                refuse_split_model_flags(trainer, self.options, self._layer_sync, self.checkpoint_io)
        return mesh

    @contextmanager
    def _refusals_in_arguments(self) -> Generator:
        """Refusals raised inside have their fixes written as this class's arguments (a script built it)."""
        try:
            yield
        except LightningParallelError as err:
            front_end = self.front_end
            writer = python_arguments(front_end, "Fabric") if front_end else python_arguments(type(self).__name__)
            raise err.in_language(writer) from None

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = SubprocessScriptLauncher(self)
        else:
            self._launcher = MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ---- process groups ----------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        # every rank checks before any collective (again, after the launching process): a bad launch
        # fails with the same message everywhere instead of hanging
        module = self.lightning_module
        mesh = self.check_launch(attached_trainer(module) if module is not None else None)
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if self.mesh is None:  # a later Trainer call in the same process keeps the groups
            self.mesh = mesh.init_process_groups(self.global_rank, self.root_device.type)
            if self.async_checkpoint:
                self.background_saves = BackgroundSaves(self._timeout)
        self._requeue = DeferredRequeue(self.cluster_environment)
        self._calls += 1
        if self._lost_rank_timeout and self.world_size > 1:
            env = self.cluster_environment
            self.watchdog = RankWatchdog(env.main_address, env.main_port, self.global_rank, self.world_size,
                                         self._calls, float(self._lost_rank_timeout))
            self.watchdog.start()

    def _checks_model(self, module: Any) -> bool:
        return module is not None and (self.is_model_split or self.options.cp > 1) and not self._has_split(module)

    # ---- model set-up --------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None and self.mesh is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.precision_plugin.convert_module(self.model)
        if self._has_split(module):  # a later fit/validate/test/predict in this process: split and hook once
            self.model_to_device()
            if self.pipeline is not None:
                self.pipeline.link.device = self.root_device
        else:
            self.split(module)
        if self.is_model_split:  # Lightning's summary would count rank 0's shard of its stage
            report_whole_model(trainer.callbacks, self._unsplit_counts)
        sync_metrics_per_replica(module, self.mesh)  # TP ranks' identical metric states count once
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # the averaging callbacks copied the module before the split (and before rank 0's values reached all)
            average_held_parts(trainer.callbacks, module)
            self._prepare_training(trainer, module)
        self.setup_precision_plugin()
        if self.is_model_split or self.zero is not None or self.fully_sharded is not None:
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            if self.options.replica_groups > 1 and self.replicas is None:
                self.replicas = ReplicaGroups.join(self, trainer)
        self._check_split(trainer)
        if self.options.broadcast_buffers and self.mesh.dp_cp_size > 1:
            self.buffer_broadcast = BufferBroadcast(module, self.mesh.dp_cp_group)

    def split(self, module: Any) -> None:
        """Split ``module`` over the mesh once (``compose.split_model``) and hook context parallelism:
        the part of ``setup`` that needs no Trainer, shared with the Fabric front end (``fabric/``)."""
        if self._checks_model(module):  # as built now (configure_model, setup): checked again before the split
            with self._refusals_in_arguments():
                validate_launch(self.options, self.num_nodes, self.num_processes, model=module,
                                automatic_optimization=getattr(module, "automatic_optimization", True),
                                loss_scaler=getattr(self.precision_plugin, "scaler", None) is not None)
        self._unsplit_counts = parameters_per_module(module)
        split_model(self, module)
        if self.options.cp > 1:
            path, blocks = find_blocks(module, self.options.pipeline_blocks)
            self.context_parallel = ContextParallel(blocks, self.mesh.cp_group, path)
            self._unsplit_steps = generating_steps(module)
            self._split_module = weakref.ref(module)

    def _prepare_training(self, trainer: Any, module: Any) -> None:
        """For ``fit``: synchronised BatchNorm, the data-parallel gradient hooks, the optimizers of what is
        left after the split (ZeRO-1 sharding their state), and the order gradients are finalised in."""
        if self._layer_sync is not None:
            self.model = self._apply_layer_sync(self.model)
        self.hook_gradients(module)
        if self.pipeline is not None:
            # the pipeline runs forward and backward itself, inside training_step
            set_skip_backward(trainer, True)
        self.setup_optimizers(trainer)
        self.prepare_optimizers(module)

    def hook_gradients(self, module: Any) -> None:
        """The data-parallel gradient hooks on the parameters left after the split (before the optimizers
        exist; ZeRO-2/3 reduces its own). Shared with the Fabric front end."""
        if self.mesh.dp_cp_size > 1 and self.fully_sharded is None:  # CP ranks hold the replica's parameters too
            self.grad_sync = gradient_synchronizer(
                module, self.mesh, self.options.bucket_size_mb, shard=self.options.zero == 1,
                deferred=shared_across_stages(module, self.pipeline) if self.pipeline is not None else (),
                experts=self.experts)

    def prepare_optimizers(self, module: Any) -> None:
        """Once ``self.optimizers`` hold what is left after the split: ZeRO-1 shards their state, and the
        order gradients are finalised in is fixed. Shared with the Fabric front end."""
        if self.fully_sharded is not None:
            refuse_whole_tensor_optimizers(self.optimizers, self.options.zero)
        if self.grad_sync is not None and self.options.zero == 1:
            self.zero = ZeroOneSharding(dense_part(self.grad_sync), self.optimizers)
        sequence_parallel = self.options.sequence_parallel and self.options.tp > 1
        self.finalize_gradients = GradientFinalizer(module, self.pipeline, self.grad_sync, self.zero,
                                                    self.mesh if sequence_parallel else None, self.fully_sharded)

    def _check_split(self, trainer: Any) -> None:
        """The split against the whole model on a real batch (``checks/``): at setup under pipeline
        parallelism, whose stages are cut on a traced run of the step already; otherwise in the first
        step the Trainer runs (``checks/first_step.py``), for tensor and context parallelism."""
        if self._split_check is not None and self.pipeline is not None:
            self.split_verification = check_split_against_whole(self, trainer, self._split_check)
            self._split_check = None
        if self._first_step is None and (self.options.tp > 1 or self.context_parallel is not None):
            self._first_step = FirstStepCheck(self.lightning_module, self._split_check, self.options.tp,
                                              self.context_parallel, self.root_device)
            self._split_check = None

    def _step(self, step: str, run: Any) -> Any:
        """``run()``, the user's ``step`` on the split model; the first one checked (``checks/first_step.py``).
        A step run without the sequence split is not the one checked."""
        if self._first_step is None or self._first_step.done or step in self._unsplit_steps:
            return run()
        try:
            return self._first_step.run(step, run)
        finally:
            self.split_verification = self._first_step.verification

    def _apply_layer_sync(self, model: Any) -> Any:
        """``Trainer(sync_batchnorm=True)``: BatchNorm statistics over the data-parallel replicas only.

        The TP shards and pipeline stages of one replica read the same samples, so the statistics of a
        batch are those of the replicas' batches together (``mesh.dp_group``), not of the world.
        Torch's ``SyncBatchNorm`` normalises CUDA (or XPU, HPU) tensors only.
        """
        if isinstance(self._layer_sync, TorchSyncBatchNorm):
            return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=self.mesh.dp_group)
        return self._layer_sync.apply(model)

    @contextmanager
    def _gathered(self) -> Generator:
        """Inside, the root unit's parameters are gathered (ZeRO-2/3); afterwards every parameter is sharded
        again. Around an evaluation step, a probe, and what runs the user's code outside a training step."""
        if self.fully_sharded is None:
            yield
            return
        self.fully_sharded.gather_root()
        try:
            yield
        finally:
            self.fully_sharded.reshard()

    def _has_split(self, module: Any) -> bool:
        """Whether ``module`` is the one this strategy split (checking or splitting it again would fail)."""
        return self._split_module is not None and self._split_module() is module

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator:
        """``trainer.init_module(empty_init=True)``: parameters on the meta device, materialised in
        ``setup`` only for this rank's stage and shards, with the values construction gave them
        (``empty_init.py``, ``materialize.py``). Lightning enters this context without an argument
        around ``configure_model``: there the model is built on meta too when the module was
        (``init_module(empty_init=True)``), as Lightning's own sharded strategies do, and with values
        otherwise, as one device would build it."""
        if empty_init:
            self._empty_init = True
        elif empty_init is None and self._empty_init:
            empty_init = True
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with empty_parameters(), self.precision_plugin.tensor_init_context():
            yield

    # ---- steps ---------------------------------------------------------------------------------
    def _before_forward(self) -> None:
        if self.buffer_broadcast is not None:
            self.buffer_broadcast.before_forward(synchronising=not self._sync_blocked)

    def _sequence_split(self) -> Any:
        """Around a step or a backward: the sequence split over the CP ranks (``context_parallel/``)."""
        return self.context_parallel.active() if self.context_parallel is not None else nullcontext()

    def _in_sequence_split(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        """The user's ``step`` with the sequence split active; the first step's split check runs outside
        it (``checks/first_step.py``), on the inputs the units received.

        An evaluation step that calls ``generate()`` runs unsplit, the whole sequence on each CP rank (which
        holds the replica's parameters and reads the replica's batch): each decoding step adds one token
        per sequence, which cannot be cut into ``2 x context_parallel`` chunks, and the key/value cache
        would hold each rank's chunks only. Every CP rank then returns one device's tokens."""
        if getattr(step, "__name__", None) in self._unsplit_steps:
            return step(*args, **kwargs)
        with self._sequence_split():
            return step(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        if self.fully_sharded is not None:  # freed again at the end of backward
            self.fully_sharded.gather_root()
        if self.pipeline is None:
            step = super().training_step
            output = self._step("training_step", lambda: self._in_sequence_split(step, *args, **kwargs))
            if self.experts is not None:
                log_tokens_per_expert(self.lightning_module, self.experts, self.mesh.dp_group)
            return output
        trainer = self.lightning_module.trainer
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            for optimizer in self.optimizers:
                optimizer.zero_grad()
        # micro-batches accumulate locally; at the window's end each stage's last backward launches its DP buckets
        no_sync = self.grad_sync.no_sync() if self.grad_sync is not None else nullcontext()
        overlap = self.finalize_gradients.overlapped(window_ends=not self._sync_blocked)
        with self.precision_plugin.train_step_context(), no_sync, overlap:
            loss = self.pipeline.training_step(batch, batch_idx, loss_scale=1.0 / trainer.accumulate_grad_batches)
        if not self._sync_blocked:
            self.finalize_gradients()
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        with self._gathered():
            if self.pipeline is None:
                step = super().validation_step
                return self._step("validation_step", lambda: self._in_sequence_split(step, *args, **kwargs))
            with self.precision_plugin.val_step_context():
                return self.pipeline.validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        with self._gathered():
            if self.pipeline is None:
                step = super().test_step
                return self._step("test_step", lambda: self._in_sequence_split(step, *args, **kwargs))
            with self.precision_plugin.test_step_context():
                return self.pipeline.test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        with self._gathered():
            if self.pipeline is None:
                step = super().predict_step
                return self._step("predict_step", lambda: self._in_sequence_split(step, *args, **kwargs))
            with self.precision_plugin.predict_step_context():
                return self.pipeline.predict_step(*args, **kwargs)

    @override
    def on_train_start(self) -> None:
        # the training loaders exist now: say whether Lightning's sampler reorders them (data_order.py)
        trainer = self.lightning_module.trainer
        loaders = tree_flatten(trainer.train_dataloader)[0]  # a loader, or a list or dict of them
        self.data_order = data_order_note(loaders, uses_distributed_sampler(trainer), self.mesh.dp_size)
        if self.data_order is not None:
            rank_zero_info(self.data_order)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Lightning registers its signal handlers after setup; take the requeue one over once
        self._requeue.install()
        self._requeue.at_batch_boundary(self.root_device)

    # ---- gradients -----------------------------------------------------------------------------
    @override
    @contextmanager
    def block_backward_sync(self) -> Generator:
        """Lightning enters this on every batch of an accumulation window but the last."""
        self._sync_blocked = True
        try:
            if self.grad_sync is not None or self.fully_sharded is not None:
                with (self.grad_sync or self.fully_sharded).no_sync():
                    yield None
            else:
                yield None
        finally:
            self._sync_blocked = False

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # blocks that activation checkpointing recomputes split their sequence again, and attend over the ring.
        # Entered here and left in post_backward, around Lightning's own ``Strategy.backward``, which this
        # class leaves as it is (tests that wrap ``Strategy.backward`` then call it once, as under ``ddp``)
        self._backward_split = ExitStack()
        self._backward_split.enter_context(self._sequence_split())

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # after the window's last backward (manual optimisation: after every manual_backward)
        try:
            if not self._sync_blocked:
                self.finalize_gradients()
        finally:
            self._backward_split.close()

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> Tensor:
        """Clip ``optimizer``'s gradients by the norm of the whole model (``clipping.py``); return that norm
        before clipping (the Fabric front end returns it from ``clip_gradients``)."""
        params = list(self.precision_plugin.main_params(optimizer))
        counted_once = self.pipeline.is_counted_once if self.pipeline is not None else (lambda p: True)
        if self.zero is not None:
            original = self.zero.original
            return clip_grads_by_global_norm(params, float(clip_val), self.mesh,
                                             lambda p: counted_once(original.get(p, p)),
                                             sharded_over=self.mesh.dp_cp_group)
        if self.fully_sharded is not None:
            return clip_grads_by_global_norm(params, float(clip_val), self.mesh, counted_once,
                                             sharded_over=self.mesh.zero_shard_group)
        return clip_grads_by_global_norm(params, float(clip_val), self.mesh, counted_once)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.replicas is not None:  # quorum, closure, average over the groups, and the step if it commits
            return self.replicas.step(closure, lambda ran: self._optimizer_step(optimizer, ran, model, **kwargs))
        return self._optimizer_step(optimizer, closure, model, **kwargs)

    def _optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.zero is not None:
            self.zero.gather_params()
        return output

    @override
    def on_exception(self, exception: BaseException) -> None:
        # the peers learn which rank failed; a collective that failed because a peer vanished names it
        ended = self.watchdog.failed(exception) if self.watchdog is not None else None
        if ended is not None:
            raise LostRankError(f"rank {self.global_rank} stopped: {ended}") from exception

    @override
    def teardown(self) -> None:
        self.wait_for_checkpoint()  # the end of fit: the last checkpoint is on disk before the processes end
        if self.replicas is not None:
            self.replicas.shutdown()
            self.replicas = None
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.grad_sync is not None:
            self.grad_sync.remove()
            self.grad_sync = None
        module = self.lightning_module
        trainer = attached_trainer(module) if module is not None else None
        if self.pipeline is not None and trainer is not None:
            set_skip_backward(trainer, False)
        if module is not None and has_meta_parameters(module):  # a refused setup left nothing to move
            with module_hidden_from_teardown(self):
                super().teardown()
        else:
            super().teardown()
