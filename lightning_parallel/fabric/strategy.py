"""``FabricParallelStrategy``: the Trainer strategy's parallelisms behind Lightning Fabric's ``Strategy`` API.

Fabric takes only instances of ``lightning.fabric.strategies.Strategy``; the Trainer's
``ParallelStrategy`` (``strategy/parallel.py``) is a ``lightning.pytorch`` strategy. This class is a
thin front end over one instance of it (``engine``), which owns the mesh and every parallelism: Fabric's
calls map onto the same code the Trainer runs.

=================================  ===========================================================
Fabric                             the Trainer strategy's code
=================================  ===========================================================
``launch`` / process set-up        ``ParallelStrategy.setup_environment``: launch checks, mesh
``init_module(empty_init=True)``   ``tensor_init_context``: meta device, recorded values
                                   (``reset_at_setup``: the modules' ``reset_parameters()``
                                   recorded at setup too, as FSDP initialises a meta model)
``setup_module``                   ``ParallelStrategy.split`` (``compose.split_model``),
                                   ``hook_gradients`` (``GradientSynchronizer``); under PP
                                   a module whose call runs the schedule (``pipeline.py``)
``setup_optimizers`` / ``setup``   ``prepare_optimizers`` (ZeRO-1, ``GradientFinalizer``); an
                                   optimizer built before the split is pointed at the split
                                   parameters (``optimizers.py``)
``backward``                       the gradients finalised after the window's last backward
                                   (``GradientFinalizer``)
``no_backward_sync``               ``block_backward_sync``
``clip_gradients(max_norm=...)``   ``clipping.clip_grads_by_global_norm`` (the whole model's norm)
``save`` / ``load``                ``checkpoint.save_sharded`` / ``load_sharded``: Distributed
                                   Checkpoint directories that resume on any layout
``all_reduce`` ... ``broadcast``   ``MeshCollectives`` (a replica's TP ranks count once)
=================================  ===========================================================

Under pipeline parallelism the loop hands its loss function to the model, whose call runs the schedule
(``pipeline.py``); under context parallelism each call of the model, and each backward, runs with the
sequences split at the blocks (gathered after them, so the loop's loss sees whole sequences). Not under
Fabric: ``replica_groups > 1`` and sizes given as "auto" (the planner reads the Trainer's data), refused
at launch; and the split check against the whole model (``verify_split``), which runs inside the
Trainer's first step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Generator, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import ParallelStrategy as _FabricParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.checkpoint import load_sharded, save_sharded
from lightning_parallel.checkpoint.hf_models import RECORD_KEY as HF_RECORD_KEY
from lightning_parallel.checkpoint.hf_models import describe as describe_hf_models
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.fabric import checkpoint as fabric_checkpoint
from lightning_parallel.fabric.optimizers import parameter_names, rebind
from lightning_parallel.fabric.pipeline import PipelinedModule
from lightning_parallel.strategy.empty_init import empty_parameters, reset_recorded
from lightning_parallel.strategy.parallel import ParallelStrategy


class FabricParallelStrategy(_FabricParallelStrategy):
    """Data (ZeRO-1/2/3), tensor, context, expert and pipeline parallelism for an unchanged Fabric loop.

    Args:
        start_method: how Fabric starts the processes: ``"popen"`` (the script once per rank, as
            torchrun does; nothing when they are started externally), ``"spawn"``, ``"fork"`` or
            ``"forkserver"``.
        timeout: timeout of collective operations.
        reset_at_setup: a model built under ``init_module(empty_init=True)`` gets each module's
            ``reset_parameters()`` at ``setup_module``, recorded and replayed for this rank's part
            (``empty_init.reset_recorded``), as FSDP initialises a model built on the meta device;
            construction itself draws no random numbers then (as Fabric's empty init on one device).
            For loops written for FSDP, which skip that call themselves under it (LitGPT's
            ``pretrain``): see ``standing_in_for_fsdp``.
        **options: the layout and its options (``tensor_parallel``, ``data_parallel``, ``zero_stage``,
            ``expert_parallel``, ``bucket_size_mb``, ``sequence_parallel``, ``tp_plan``, ...), exactly
            as ``ParallelStrategy`` (the Trainer's) takes them; see ``ParallelOptions``.
    """

    engine_class: type = ParallelStrategy  # the Trainer strategy (or preset) this front end drives
    strategy_name = "lp_3d"

    def __init__(
        self,
        start_method: str = "popen",
        timeout: Union[timedelta, float] = timedelta(minutes=30),
        process_group_backend: Optional[str] = None,
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        reset_at_setup: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got {start_method!r}")
        # the engine's launcher is never used (Fabric launches) and its rank watchdog follows Trainer calls
        self.engine: ParallelStrategy = self.engine_class(timeout=timeout, process_group_backend=process_group_backend,
                                                          lost_rank_timeout=None, **options)
        self.engine.front_end = type(self).__name__  # refusals write their fixes as this class's arguments
        self._start_method = start_method
        self._reset_at_setup = reset_at_setup
        self._num_nodes = 1
        self._module: Optional[nn.Module] = None  # the module set up (one per strategy)
        self._forward_module: Optional[nn.Module] = None  # what the loop calls: it, or its PipelinedModule
        self._sequence_split = ExitStack()  # context parallelism's split, from a call's start to its end
        self._backward_sync_control = _NoBackwardSync(self)

    @classmethod
    def standing_in_for_fsdp(cls, **options: Any) -> type["FabricParallelStrategy"]:
        """A subclass that a script written for Fabric's ``FSDPStrategy`` can build in its place: it takes
        (and ignores) FSDP's arguments, runs with ``options``, and initialises a model built on the meta
        device as FSDP does (``reset_at_setup=True``). One line runs LitGPT's ``pretrain`` on it, whose
        ``isinstance(fabric.strategy, FSDPStrategy)`` then holds::

            litgpt.pretrain.FSDPStrategy = FabricParallelStrategy.standing_in_for_fsdp(zero_stage=3)
        """
        options = {"reset_at_setup": True, **options}

        def __init__(self: FabricParallelStrategy, *fsdp_args: Any, **fsdp_options: Any) -> None:
            cls.__init__(self, **options)

        return type(f"{cls.__name__}ForFSDP", (cls,), {"__init__": __init__, "__module__": cls.__module__})

    # ---- what Fabric asks of a parallel strategy -------------------------------------------------
    @property
    def options(self) -> Any:
        """The layout and its options (``ParallelOptions``), shared with the engine."""
        return self.engine.options

    @property
    def mesh(self) -> Any:
        """The ``ParallelMesh`` (once the processes are set up)."""
        return self.engine.mesh

    @property
    def device_mesh(self) -> Any:
        return self.engine.device_mesh

    @property
    @override
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
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # a replica's TP shards read the same batch
        self._share_plumbing()
        return self.engine.distributed_sampler_kwargs

    def _share_plumbing(self) -> None:
        """The engine runs in this process with Fabric's accelerator, devices, environment and precision
        (the engine reads them by their Lightning names; the Fabric and Trainer classes offer the same
        methods where it calls them)."""
        engine = self.engine
        engine.accelerator = self.accelerator
        engine.parallel_devices = self.parallel_devices
        engine.cluster_environment = self.cluster_environment
        engine.num_nodes = self.num_nodes
        engine.precision_plugin = self.precision

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:  # torchrun, SLURM: nothing to start
            return
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        """Fabric's launch: every rank checks the layout, then joins the process group and the mesh."""
        self._share_plumbing()
        self._refuse_front_end_limits()
        self.engine.setup_environment()  # the device, the launch checks, the process group and the mesh

    def _refuse_front_end_limits(self) -> None:
        options = self.options
        if options.is_auto:
            raise ConfigurationError("sizes given as 'auto' are chosen from the Trainer's data; under Fabric give "
                                     "them as numbers (lp-plan --search ranks the layouts)")
        if options.replica_groups > 1:
            raise ConfigurationError("replica_groups > 1 under Fabric: the fault-tolerant quorum wraps the "
                                     "Trainer's optimizer step; train with the Trainer")

    # ---- model and optimizers ------------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: parameters on the meta device, materialised by
        ``setup_module`` for this rank's shards only, with the values construction gave them (as under the
        Trainer's ``init_module``: ``strategy/empty_init.py``)."""
        if empty_init and self._reset_at_setup:
            return self._empty_init_for_reset()
        if empty_init:
            return self.engine.tensor_init_context(empty_init=True)
        return super().module_init_context(empty_init)

    @contextmanager
    def _empty_init_for_reset(self) -> Generator[None, None, None]:
        """``init_module(empty_init=True)`` when ``reset_parameters()`` gives the values at setup: construction's
        init calls are recorded without drawing random numbers, as Fabric's empty init on one device skips
        them, so the draws of the reset come from the generator state one device has there."""
        with empty_parameters(draws=False), self.precision.tensor_init_context():
            yield

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # the split moves this rank's part; a module set up already is moved whole (it is this rank's part)
        if module is self._module:
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Split ``module`` over the mesh (the Trainer's ``compose.split_model``) and hook its gradients."""
        engine = self.engine
        if self._module is not None and self._module is not module:
            raise ValueError("FabricParallelStrategy sets up one model; build one strategy (one Fabric) per model")
        if self._module is None:
            if self._reset_at_setup:
                reset_recorded(module)
            engine.connect(module)
            module.register_forward_pre_hook(lambda *_: self._before_forward())
            engine.split(module)
            if engine.context_parallel is not None:
                self._split_sequences_in_calls(module)
            engine.hook_gradients(module)
            if engine.options.zero != 1:  # ZeRO-1 waits for the optimizers, whose state it shards
                engine.prepare_optimizers(module)
            self._module = module
            self._forward_module = PipelinedModule(module, self) if engine.pipeline is not None else module
        return self._forward_module

    def _split_sequences_in_calls(self, module: nn.Module) -> None:
        """Context parallelism: each call of ``module`` runs with the sequences split at its blocks (as the
        Trainer strategy runs a step), left at the call's end, an exception's included."""
        engine = self.engine

        def enter(*_: Any) -> None:
            self._sequence_split.enter_context(engine._sequence_split())

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(lambda *_: self._sequence_split.close(), always_call=True)

    def _before_forward(self) -> None:
        """What the Trainer strategy does before each step: the buffers broadcast over the replicas (DDP's
        ``broadcast_buffers``), and ZeRO-2/3's root parameters gathered (freed after backward)."""
        engine = self.engine
        engine._before_forward()
        if engine.fully_sharded is not None and torch.is_grad_enabled():
            engine.fully_sharded.gather_root()

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, optimizer)``: the optimizers, built on the unsplit model, step its split."""
        names = parameter_names(module)
        forward_module = self.setup_module(module)
        for optimizer in optimizers:
            rebind(optimizer, names, module)
        self._add_optimizers(optimizers)
        return forward_module, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers(optimizer)``, for an optimizer built on the set-up model's parameters."""
        if self._module is None:
            raise ValueError("set the model up first (model = fabric.setup_module(model)), then build the optimizer "
                             "from its parameters, or set both up together: fabric.setup(model, optimizer)")
        self._add_optimizers([optimizer])
        return optimizer

    def _add_optimizers(self, optimizers: list[Optimizer]) -> None:
        engine = self.engine
        if engine.zero is not None:
            raise ValueError("zero_stage=1 shards the optimizers' state once: set every optimizer up in one call "
                             "(fabric.setup(model, opt1, opt2) or fabric.setup_optimizers(opt1, opt2))")
        engine.optimizers = list(engine.optimizers) + list(optimizers)
        engine.prepare_optimizers(self._module)

    # ---- steps ----------------------------------------------------------------------------------------
    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """Fabric's backward, then, after an accumulation window's last backward, the gradients finalised
        as under the Trainer (``strategy/gradients.py``)."""
        engine = self.engine
        if engine.finalize_gradients is None:
            raise RuntimeError("zero_stage=1 shards the optimizers' state: set the optimizers up (fabric.setup(model, "
                               "optimizer) or fabric.setup_optimizers) before the first backward")
        if engine.pipeline is None:
            with engine._sequence_split():  # blocks recomputed in backward split their sequences again
                super().backward(tensor, module, *args, **kwargs)
        elif tensor.requires_grad:
            raise RuntimeError("under pipeline parallelism the model's call runs the backward of every micro-batch: "
                               "pass fabric.backward the loss model(batch, loss_fn=...) returned")
        if not engine._sync_blocked:
            engine.finalize_gradients()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        if self.engine.zero is not None:  # every replica's slices back into the whole parameters
            self.engine.zero.gather_params()
        return output

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """Clip by the 2-norm of the whole model's gradients (``strategy/clipping.py``), as one device
        would; returns that norm, the same on every rank."""
        engine = self.engine
        if not (engine.is_model_split or engine.zero is not None or engine.fully_sharded is not None):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_gradients(norm_type={norm_type}) on a split model: the whole model's norm is "
                             "summed from the shards' squared norms, so only norm_type=2 is supported")
        self.precision.unscale_gradients(optimizer)
        norm = engine._clip_grad_by_global_norm(optimizer, max_norm)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {float(norm)}; clip_gradients(..., "
                               "error_if_nonfinite=False) clips anyway")
        return norm

    # ---- collectives (``strategy/collectives.py``) ----------------------------------------------------
    @override
    def all_reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
                   reduce_op: Optional[Union[Any, str]] = "mean") -> Union[Tensor, Any]:
        """Over the data-parallel replicas: the TP ranks of a replica hold the same values (its loss), so a
        sum counts each replica once, as one device counts its batch once. Fabric passes the world when the
        loop names no group; another group is used as given."""
        if group is torch.distributed.group.WORLD:
            group = None
        return self.engine.reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """One entry per data-parallel replica, not per TP rank (``MeshCollectives.all_gather``)."""
        return self.engine.all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        self.engine.barrier(name)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return self.engine.broadcast(obj, src)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Fabric's name
        return self.engine.reduce_boolean_decision(decision, all)

    # ---- checkpoints (``checkpoint/io.py``) -----------------------------------------------------------
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:  # noqa: A002
        """Write ``state`` as a Distributed Checkpoint directory (every rank writes its part): it resumes on
        any layout, and ``lp-consolidate`` turns it into one file."""
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=..., filter=...) is not "
                            "supported: every rank writes its shards of the whole state to the directory")
        engine, module = self.engine, self._set_up_module()
        state = self._unwrapped(state)
        checkpoint = fabric_checkpoint.to_lightning(state, module, engine.optimizers, engine.optimizer_state)
        checkpoint[HF_RECORD_KEY] = describe_hf_models(module)  # lp-export writes the HF models from it
        if engine.fully_sharded is not None:  # the parameters as the optimizer holds them
            engine.fully_sharded.reshard()
        save_sharded(engine, checkpoint, path)

    @override
    def load_checkpoint(self, path: Any, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read back what ``save_checkpoint`` (on any layout, or a Trainer's checkpoint) wrote, each rank only
        the chunks it holds, into ``state``'s objects; returns what ``state`` did not ask for."""
        module = self._set_up_module()
        if isinstance(state, nn.Module):  # fabric.load_raw(path, model): the weights alone
            state = {"model": state}
        if not isinstance(state, dict) or not state or isinstance(state, Optimizer):
            raise ValueError(f"{type(self).__name__}.load_checkpoint needs the objects to restore, with the model: "
                             "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})")
        engine = self.engine
        checkpoint = load_sharded(engine, path, weights_only, strict=strict)
        unwrapped = self._unwrapped(state)
        remainder = fabric_checkpoint.restore(checkpoint, unwrapped, module, engine.optimizers,
                                              engine.load_optimizer_state_dict, strict)
        state.update((k, v) for k, v in unwrapped.items() if v is not module)  # values restored in place
        return remainder

    def _unwrapped(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with the pipeline's wrapper (what Fabric unwraps its module to) as the module it runs."""
        wrapper = self._forward_module
        return {k: (self._module if v is wrapper and wrapper is not self._module else v) for k, v in state.items()}

    def _set_up_module(self) -> nn.Module:
        if self._module is None:
            raise ValueError("save and load checkpoints of a model set up by Fabric (fabric.setup(model, ...))")
        return self._module

    @override
    def teardown(self) -> None:
        engine = self.engine
        if engine.grad_sync is not None:
            engine.grad_sync.remove()
            engine.grad_sync = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        from lightning_parallel.fabric.presets import register

        register(strategy_registry)


class _NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: gradients accumulate locally (the Trainer strategy's
    ``block_backward_sync``), and the backward after the window reduces them."""

    def __init__(self, strategy: FabricParallelStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.strategy.engine.block_backward_sync() if enabled else nullcontext()
