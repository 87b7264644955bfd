"""``ParallelStrategy``: data, tensor and pipeline parallelism for an unchanged LightningModule.

The strategy owns the process mesh and composes the three parts in a fixed order at setup:

1. every rank receives rank 0's initial parameters, so all replicas, shards and stages start from
   the single-device initialisation;
2. tensor parallelism shards the modules named by a plan (``tensor_parallel/``);
3. pipeline parallelism keeps only this rank's stage (``pipeline/``);
4. the optimizers are created from what is left, and data parallelism hooks the local parameters
   (``data_parallel/``).

After each backward window, gradients are finalised in Megatron-LM's order: data-parallel all-reduce,
then sequence-parallel norm weights over TP, then weights tied between pipeline stages. Clipping by
norm then uses the norm of the whole model (``clipping.py``).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy as _LightningParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.checkpoint import load_sharded, save_sharded
from lightning_parallel.clipping import clip_grads_by_global_norm
from lightning_parallel.data_parallel import GradientSynchronizer
from lightning_parallel.data_parallel.zero import ZeroOneSharding
from lightning_parallel.launcher import MultiProcessingLauncher
from lightning_parallel.init import UnsplitModel, empty_parameters, has_meta_parameters, materialize
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.pipeline import PipelineEngine
from lightning_parallel.requeue import DeferredRequeue
from lightning_parallel.slurm_checks import validate_launch
from lightning_parallel.tensor_parallel import parallelize, sync_sequence_parallel_grads

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ParallelStrategy(_LightningParallelStrategy):
    """Data x tensor x pipeline parallelism on one process mesh.

    Args:
        data_parallel: model replicas; ``"auto"`` takes the processes left over after TP and PP.
        tensor_parallel: ranks that shard each layer, Megatron style (keep it within a node).
        pipeline_parallel: pipeline stages.
        micro_batches: micro-batches per training batch under pipeline parallelism (default: the
            number of stages).
        schedule: pipeline schedule, ``"1f1b"``, ``"gpipe"`` or ``"interleaved_1f1b"``.
        virtual_stages: model chunks per rank for ``"interleaved_1f1b"``.
        sequence_parallel: shard norm and dropout regions along the sequence under TP
            (Korthikanti et al. 2022).
        tp_plan: module-name glob -> style (``colwise``, ``rowwise``, ``vocab``, or a dict with
            ``style`` and options such as ``fused: 3``); ``None`` detects the plan from the model.
        pipeline_blocks: dotted path of the repeated block list; ``None`` finds it.
        pipeline_layout: blocks per stage, e.g. ``[3, 5]``; ``None`` balances by parameter count.
        bucket_size_mb: data-parallel all-reduce bucket size, MiB of gradients.
        zero_stage: ``1`` shards optimizer state over the data-parallel group (ZeRO-1); ``0`` keeps
            a full optimizer on every replica.
        start_method: ``"popen"`` (run the script once per rank, as torchrun does), ``"spawn"``,
            ``"fork"`` or ``"forkserver"``, as in Lightning's ``DDPStrategy``.
        timeout: timeout of collective operations.
    """

    strategy_name = "lp_3d"

    def __init__(
        self,
        data_parallel: Union[int, str] = "auto",
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        micro_batches: Optional[int] = None,
        schedule: str = "1f1b",
        virtual_stages: int = 1,
        sequence_parallel: bool = False,
        tp_plan: Optional[dict] = None,
        pipeline_blocks: Optional[str] = None,
        pipeline_layout: Optional[list[int]] = None,
        bucket_size_mb: float = 25.0,
        zero_stage: int = 0,
        start_method: StartMethod = "popen",
        timeout: Union[timedelta, float] = timedelta(minutes=30),
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
        self.data_parallel = data_parallel
        self.tensor_parallel = int(tensor_parallel)
        self.pipeline_parallel = int(pipeline_parallel)
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.sequence_parallel = sequence_parallel
        self.tp_plan = dict(tp_plan) if tp_plan is not None else None
        self.pipeline_blocks = pipeline_blocks
        self.pipeline_layout = list(pipeline_layout) if pipeline_layout is not None else None
        self.bucket_size_mb = bucket_size_mb
        if zero_stage not in (0, 1):
            raise ValueError(f"zero_stage must be 0 (off) or 1 (shard optimizer state), got {zero_stage!r}")
        self.zero_stage = zero_stage
        self._start_method = start_method
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self.mesh: Optional[ParallelMesh] = None
        self.grad_sync: Optional[GradientSynchronizer] = None
        self.pipeline = None  # pipeline.PipelineEngine when pipeline_parallel > 1
        self.zero: Optional[ZeroOneSharding] = None
        self._sync_blocked = False
        self._requeue = DeferredRequeue(None)

    # ---- what Lightning asks of a parallel strategy ---------------------------------------------
    @property
    def is_distributed(self) -> bool:
        # read by Lightning to inject the DistributedSampler and to honour self.log(sync_dist=True)
        return True

    @property
    def is_model_split(self) -> bool:
        return self.tensor_parallel > 1 or self.pipeline_parallel > 1

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

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # all TP shards and pipeline stages of one replica read the same batch
        mesh = self._planned_mesh()
        return {"num_replicas": mesh.dp_size, "rank": mesh.coords(self.global_rank).dp}

    def _resolve_sizes(self) -> None:
        """Presets fill in the size they spread over all processes (see the subclasses)."""

    def _planned_mesh(self) -> ParallelMesh:
        if self.mesh is not None:
            return self.mesh
        self._resolve_sizes()
        return ParallelMesh(
            self.num_nodes * self.num_processes,
            tensor_parallel=self.tensor_parallel,
            pipeline_parallel=self.pipeline_parallel,
            data_parallel=self.data_parallel,
        )

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ---- process groups ----------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        # every rank checks the allocation, the layout and the model before any collective, so a
        # bad launch fails with the same message everywhere instead of hanging
        self._resolve_sizes()
        sizes = {"tensor_parallel": self.tensor_parallel, "pipeline_parallel": self.pipeline_parallel,
                 "data_parallel": self.data_parallel}
        mesh = validate_launch(
            sizes, self.num_nodes, self.num_processes,
            model=self.lightning_module if self.is_model_split else None,
            tp_plan=self.tp_plan, sequence_parallel=self.sequence_parallel, pipeline_blocks=self.pipeline_blocks,
            virtual_stages=self.virtual_stages, pipeline_layout=self.pipeline_layout,
        )
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self.mesh = mesh.init_process_groups(self.global_rank)
        self._requeue = DeferredRequeue(self.cluster_environment)

    # ---- model set-up --------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None and self.mesh is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.precision_plugin.convert_module(self.model)
        on_meta = has_meta_parameters(module)
        if on_meta:  # nothing to broadcast yet: every rank derives the same values from one seed
            unsplit = UnsplitModel.of(module)
            seed = self.broadcast(torch.initial_seed())
        else:
            self.model_to_device()
            _sync_module_states(module)  # rank 0's initial values everywhere (bucketed broadcasts)
        if self.tensor_parallel > 1:
            parallelize(module, self.mesh, plan=self.tp_plan, sequence_parallel=self.sequence_parallel)
        if self.pipeline_parallel > 1:
            self.pipeline = PipelineEngine(
                module,
                self.mesh,
                micro_batches=self.micro_batches or self.pipeline_parallel,
                schedule=self.schedule,
                virtual_stages=self.virtual_stages,
                blocks=self.pipeline_blocks,
                layout=self.pipeline_layout,
            )
            if getattr(self.precision_plugin, "scaler", None) is not None:
                raise ValueError(
                    "pipeline_parallel > 1 supports precision '32-true', 'bf16-mixed' or 'bf16-true'; "
                    "'16-mixed' needs a loss scaler the pipeline does not apply"
                )
            self.pipeline.partition()
        if on_meta:  # only this rank's stage and shards are ever allocated
            materialize(module, unsplit, self.mesh.tp_rank, self.mesh.tp_size, self.root_device, seed)
            self.model_to_device()
            if self.pipeline is not None:
                self.pipeline.link.device = self.root_device
        if trainer.state.fn == TrainerFn.FITTING:
            if self.mesh.dp_size > 1:
                self.grad_sync = GradientSynchronizer(
                    list(module.parameters()), self.mesh.dp_group, self.bucket_size_mb, shard=self.zero_stage == 1
                )
            if self.pipeline is not None:
                # the pipeline runs forward and backward itself, inside training_step
                trainer.fit_loop._skip_backward = True
            self.setup_optimizers(trainer)
            if self.grad_sync is not None and self.zero_stage == 1:
                self.zero = ZeroOneSharding(self.grad_sync, self.optimizers)
        self.setup_precision_plugin()
        if self.is_model_split or self.zero is not None:
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator:
        """``trainer.init_module(empty_init=True)``: parameters on the meta device, materialised in
        ``setup`` only for this rank's stage and shards (``init.py``)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with empty_parameters(), self.precision_plugin.tensor_init_context():
            yield

    # ---- checkpoints ---------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # load into the set-up (possibly split) model, so each rank reads only what it holds
        return True

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not self.is_model_split:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported with a "
                            "split model: it writes a directory of shards itself, without the CheckpointIO plugin")
        save_sharded(self, checkpoint, filepath)

    def optimizer_state(self, optimizer: Optimizer) -> dict:
        if self.zero is not None:
            raise NotImplementedError(
                "checkpoints with zero_stage=1 are not supported yet: each rank holds a slice of the optimizer "
                "state. Train with zero_stage=0 to checkpoint, or save weights only "
                "(ModelCheckpoint(save_weights_only=True))"
            )
        return super().optimizer_state(optimizer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict:
        # a plain file or a directory of shards, written on any layout
        return load_sharded(self, checkpoint_path, weights_only)

    # ---- steps ---------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().training_step(*args, **kwargs)
        trainer = self.lightning_module.trainer
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            for optimizer in self.optimizers:
                optimizer.zero_grad()
        # every micro-batch's backward accumulates locally; DP averages once, in _finalize_gradients
        no_sync = self.grad_sync.no_sync() if self.grad_sync is not None else nullcontext()
        with self.precision_plugin.train_step_context(), no_sync:
            loss = self.pipeline.training_step(batch, batch_idx, loss_scale=1.0 / trainer.accumulate_grad_batches)
        if not self._sync_blocked:
            self._finalize_gradients()
        return loss

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self.pipeline.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().test_step(*args, **kwargs)
        with self.precision_plugin.test_step_context():
            return self.pipeline.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            return self.pipeline.predict_step(*args, **kwargs)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Lightning registers its signal handlers after setup; take the requeue one over once
        self._requeue.install()
        self._requeue.at_batch_boundary(self.root_device)

    # ---- gradients -----------------------------------------------------------------------------
    @contextmanager
    def block_backward_sync(self) -> Generator:
        """Lightning enters this on every batch of an accumulation window but the last."""
        self._sync_blocked = True
        try:
            if self.grad_sync is not None:
                with self.grad_sync.no_sync():
                    yield None
            else:
                yield None
        finally:
            self._sync_blocked = False

    def post_backward(self, closure_loss: Tensor) -> None:
        if not self._sync_blocked:
            self._finalize_gradients()

    def _finalize_gradients(self) -> None:
        """Complete this window's gradients: tied weights, data-parallel mean, sequence-parallel norms.

        Each step is a sum or a mean over a different group of ranks, so they commute; tied weights
        go first because under pipeline parallelism every backward has already run and the
        gradients are still whole (ZeRO-1 keeps only a slice after the DP step).
        """
        if self.pipeline is not None:
            self.pipeline.sync_tied_grads()
        if self.grad_sync is not None:
            if self.pipeline is not None:
                self.grad_sync.sync_now()
            else:
                self.grad_sync.finish()
        if self.zero is not None:
            self.zero.attach_grads()
        if self.sequence_parallel and self.tensor_parallel > 1:
            sync_sequence_parallel_grads(self._grad_holders(), self.mesh)

    def _grad_holders(self) -> torch.nn.Module:
        """The module whose parameters hold the gradients now (ZeRO-1's pieces, when sharded)."""
        return self.lightning_module if self.zero is None else self.zero.holder

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = list(self.precision_plugin.main_params(optimizer))
        counted_once = self.pipeline.is_counted_once if self.pipeline is not None else (lambda p: True)
        if self.zero is not None:
            original = self.zero.original
            clip_grads_by_global_norm(params, float(clip_val), self.mesh, lambda p: counted_once(original[p]),
                                      sharded_over_dp=True)
        else:
            clip_grads_by_global_norm(params, float(clip_val), self.mesh, counted_once)

    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.zero is not None:
            self.zero.gather_params()
        return output

    # ---- collectives ---------------------------------------------------------------------------
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def teardown(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.remove()
            self.grad_sync = None
        if self.pipeline is not None and self.lightning_module is not None and self.lightning_module._trainer:
            self.lightning_module.trainer.fit_loop._skip_backward = False
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets = (
            ("lp_dp", DataParallelStrategy, "data parallelism with bucketed, overlapped all-reduce"),
            ("lp_tp", TensorParallelStrategy, "Megatron-style tensor parallelism over all devices"),
            ("lp_pp", PipelineParallelStrategy, "pipeline parallelism (1F1B) over all devices"),
            ("lp_3d", ParallelStrategy, "data x tensor x pipeline parallelism"),
        )
        for name, strategy, description in presets:
            if name not in strategy_registry:
                strategy_registry.register(name, strategy, description=description)


class DataParallelStrategy(ParallelStrategy):
    """Data parallelism only: each process holds the whole model and a share of the batch."""

    strategy_name = "lp_dp"

    def __init__(self, bucket_size_mb: float = 25.0, start_method: StartMethod = "popen", **kwargs: Any) -> None:
        super().__init__(bucket_size_mb=bucket_size_mb, start_method=start_method, **kwargs)


class TensorParallelStrategy(ParallelStrategy):
    """Tensor parallelism; ``tensor_parallel=None`` shards over every process (no data parallelism)."""

    strategy_name = "lp_tp"

    def __init__(self, tensor_parallel: Optional[int] = None, **kwargs: Any) -> None:
        self._tp_all = tensor_parallel is None
        super().__init__(tensor_parallel=tensor_parallel or 1, **kwargs)

    def _resolve_sizes(self) -> None:
        if self._tp_all:
            self.tensor_parallel = max(1, self.num_nodes * self.num_processes // self.pipeline_parallel)


class PipelineParallelStrategy(ParallelStrategy):
    """Pipeline parallelism; ``pipeline_parallel=None`` makes one stage per process."""

    strategy_name = "lp_pp"

    def __init__(self, pipeline_parallel: Optional[int] = None, **kwargs: Any) -> None:
        self._pp_all = pipeline_parallel is None
        super().__init__(pipeline_parallel=pipeline_parallel or 1, **kwargs)

    def _resolve_sizes(self) -> None:
        if self._pp_all:
            self.pipeline_parallel = max(1, self.num_nodes * self.num_processes // self.tensor_parallel)
