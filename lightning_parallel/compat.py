"""Every private name of Lightning and torch that the plugin relies on, in one place.

Lightning offers no public hook for what a strategy needs to do here (take over backward for the
pipeline, return a split model's weights from worker processes, broadcast module states), so the
plugin uses a few ``_``-prefixed names, as Lightning's own strategies and NeMo do (and rebinds
Lightning's private checkpoint reader: ``lightning_hooks.CHECKPOINT_READERS``). ``lp-export`` repeats
two undocumented steps of transformers' ``save_pretrained`` (``hf_save_steps``). The rest of the
package imports them from this module only, and ``tests/strategy/test_compat.py`` checks that each
still exists, so a Lightning, torch or transformers release that moves one fails that test by name
instead of misbehaving at run time. Tested with lightning 2.6.6 and torch 2.13, hence the dependency
``lightning>=2.6,<2.7``. torch's ``nn.Module._parameters``, which ``init.py`` reads and writes to
materialise each module's own parameters, is the one private name used in place: it is how every
torch utility that walks a module's parameters works.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional

import torch
from lightning.fabric.utilities.distributed import (  # noqa: F401 - re-exported
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device  # noqa: F401 - re-exported
from lightning.pytorch.overrides.distributed import _sync_module_states  # noqa: F401 - re-exported
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher  # noqa: F401 - re-exported
from lightning.pytorch.strategies.launchers.multiprocessing import (  # noqa: F401 - re-exported
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from torch import nn
from torch.distributed.utils import _sync_module_states as _sync_module_states_over  # noqa: F401 - re-exported
from torch.distributed.utils import _sync_params_and_buffers  # noqa: F401 - re-exported
from torch.utils._pytree import tree_flatten, tree_map  # noqa: F401 - re-exported

#: Lightning hooks and attributes the plugin overrides or reads on classes it subclasses;
#: checked by ``tests/strategy/test_compat.py``.
OVERRIDDEN = {
    "lightning.pytorch.strategies.Strategy": ("_configure_launcher", "_launcher", "_lightning_module"),
    "lightning.pytorch.Trainer": ("_data_connector", "_accelerator_connector"),
    "lightning.pytorch.strategies.ParallelStrategy": ("_layer_sync",),
    "lightning.pytorch.callbacks.ModelSummary": ("_summary", "_max_depth"),
    "lightning.pytorch.callbacks.WeightAveraging": ("_average_model", "_device", "_use_buffers", "_kwargs"),
    "lightning.pytorch.callbacks.StochasticWeightAveraging": ("_average_model", "_device"),
    "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher": (
        "_collect_rank_zero_results", "_recover_results_in_main_process", "_already_fit", "_strategy", "_start_method",
    ),
}


def hf_save_steps() -> tuple[Callable, Callable]:
    """transformers' own steps of ``PreTrainedModel.save_pretrained`` that ``lp-export`` repeats on the meta
    device: ``remove_tied_weights_from_state_dict(state_dict, model)`` and
    ``revert_weight_conversion(model, state_dict)`` (module functions without a documented API)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    return remove_tied_weights_from_state_dict, revert_weight_conversion


def set_skip_backward(trainer: Any, skip: bool) -> None:
    """Make Lightning's automatic optimisation call neither ``backward`` nor ``zero_grad`` (the
    pipeline runs both inside ``training_step``); the switch NeMo's Megatron strategy uses."""
    trainer.fit_loop._skip_backward = skip


def training_steps(trainer: Any) -> tuple[int, int]:
    """A fitting Trainer's ``global_step`` (optimizer steps) and the step its logger writes at."""
    return trainer.global_step, trainer.fit_loop.epoch_loop._batches_that_stepped


def set_training_steps(trainer: Any, global_step: int, batches_that_stepped: int) -> None:
    """Set what ``training_steps`` reads, from inside an optimizer step (automatic optimisation: counted
    ready, not yet completed), as resuming from a checkpoint sets them; Lightning has no public setter."""
    epoch_loop = trainer.fit_loop.epoch_loop
    step_progress = epoch_loop.automatic_optimization.optim_progress.optimizer.step
    step_progress.total.completed = global_step
    step_progress.total.ready = global_step + 1
    epoch_loop._batches_that_stepped = batches_that_stepped


def replace_summary(callback: Any, summary: Any) -> None:
    """Make a ``ModelSummary`` callback build its summary with ``summary(pl_module, max_depth)``
    (the callback has no public way to choose the summary class)."""
    callback._summary = lambda trainer, pl_module: summary(pl_module, callback._max_depth)


def averaging_arguments(callback: Any) -> tuple[Any, bool, dict]:
    """``(device, use_buffers, AveragedModel's other arguments)`` a ``WeightAveraging`` callback was given."""
    return callback._device, callback._use_buffers, callback._kwargs


def set_average_model(callback: Any, model: nn.Module) -> None:
    """Make a ``WeightAveraging`` (an ``AveragedModel``) or ``StochasticWeightAveraging`` (a module) callback
    average into ``model`` (neither has a public way to choose what it copies)."""
    callback._average_model = model


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers that its ``state_dict`` leaves out (``persistent=False``)."""
    return module._non_persistent_buffers_set


def uses_distributed_sampler(trainer: Any) -> bool:
    """``Trainer(use_distributed_sampler=...)`` as the Trainer keeps it (no public attribute)."""
    return trainer._accelerator_connector.use_distributed_sampler


def loop_data_source(trainer: Any, loop_name: str) -> Any:
    """The data source (``_DataConnectorSource``) of ``trainer.<loop_name>``, before its loaders exist."""
    return getattr(trainer, loop_name)._data_source


def attach_fit_data(trainer: Any, fit_args: tuple) -> None:
    """Attach ``Trainer.fit``'s data to ``trainer`` as ``Trainer._fit_impl`` does first (it does so again
    later), so that the launching process can read the first batch before any worker starts."""
    model, train_dataloaders, val_dataloaders, datamodule = (list(fit_args) + [None] * 4)[:4]
    from lightning.pytorch import LightningDataModule

    if isinstance(train_dataloaders, LightningDataModule):  # fit(model, datamodule) given positionally
        datamodule, train_dataloaders = train_dataloaders, None
    trainer._data_connector.attach_data(model, train_dataloaders=train_dataloaders, val_dataloaders=val_dataloaders,
                                        datamodule=datamodule)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def attached_trainer(module: nn.Module) -> Optional[Any]:
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises instead)."""
    return getattr(module, "_trainer", None)


@contextmanager
def module_hidden_from_teardown(strategy: Any) -> Generator[None, None, None]:
    """Inside, ``strategy.lightning_module`` is None, so Lightning's ``Strategy.teardown`` does not
    move it to the CPU (which fails on parameters still on the meta device)."""
    module = strategy._lightning_module
    strategy._lightning_module = None
    try:
        yield
    finally:
        strategy._lightning_module = module


def fit_ckpt_path(args: tuple) -> Any:
    """``ckpt_path`` among the positional arguments ``Trainer.fit`` passes its launcher
    (model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)."""
    return args[4] if len(args) > 4 else None


def autograd_engine() -> Any:
    """torch's autograd engine, whose ``run_backward`` back-propagates from several roots at once."""
    return torch.autograd.Variable._execution_engine


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def cpu_flash_attention() -> tuple[Callable, Callable]:
    """torch's fused CPU attention kernel, the one ``scaled_dot_product_attention`` runs on CPU, as
    ``(forward, backward)``: forward ``(q, k, v, dropout_p, is_causal, scale=)`` returns the output and the
    log-sum-exp of each query's scores; backward ``(grad_out, q, k, v, out, lse, dropout_p, is_causal, scale=)``
    returns the three input gradients. Grouped key/value heads are accepted as they are."""
    aten = torch.ops.aten
    return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward


def packed_in_projection(attention: nn.MultiheadAttention) -> bool:
    """Whether ``nn.MultiheadAttention`` keeps one packed ``in_proj_weight`` (kdim = vdim = embed_dim)."""
    return attention._qkv_same_embed_dim


def fake_store() -> Any:
    """torch's in-memory store for the ``"fake"`` process-group backend, with which one process plays
    any rank of any world size (collectives return without communicating); used by ``benchmarks/scale.py``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


# ---- torch's FSDP2 (``fully_shard``): what its public methods do not reach -------------------------
def fsdp_param_groups(root: nn.Module) -> list[Any]:
    """Every FSDP2 parameter group under ``root`` (a module ``fully_shard`` wrapped last, above all the
    others), making ``root`` FSDP's root first: FSDP otherwise takes the first module whose forward runs,
    and a LightningModule's own forward may never run."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(root)
    state._lazy_init()
    return [group for s in state._state_ctx.all_states for group in s._fsdp_param_groups]


def fsdp_group_parameters(group: Any) -> list[Any]:
    """The ``FSDPParam`` records of one FSDP2 parameter group (``.sharded_param``: the DTensor parameter)."""
    return list(group.fsdp_params)


def fsdp_has_unsharded_grad(fsdp_param: Any) -> bool:
    """Whether an ``FSDPParam`` holds a gradient its next reduce-scatter will send."""
    if not hasattr(fsdp_param, "_unsharded_param"):
        return False
    return fsdp_param.unsharded_accumulated_grad is not None or fsdp_param.unsharded_param.grad is not None


def before_fsdp_post_backward(group: Any, hook: Callable[[Any], None]) -> None:
    """Call ``hook(group)`` whenever FSDP2 is about to finish ``group``'s backward (reduce-scatter its
    gradients, or keep accumulating them): from its autograd node or its root's end-of-backward callback,
    which both look the method up on the group."""
    original = group.post_backward

    def post_backward(*args: Any) -> Any:
        hook(group)
        return original(*args)

    group.post_backward = post_backward


def fsdp_reshard(group: Any) -> None:
    """Free an FSDP2 group's gathered parameters and leave it idle, also after a forward that ended by an
    exception (a pipeline stage ends its forward so): FSDP then keeps the group in its forward state, in
    which it does not reshard a group that is kept gathered after forward (the root)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    group._training_state = TrainingState.IDLE
    group.reshard()


def fsdp_reduces(group: Any) -> bool:
    """Whether an FSDP2 parameter group reduce-scatters its gradients when its backward ends."""
    return group.reduce_grads


def fsdp_reduce_now(root: nn.Module, groups: list[Any]) -> None:
    """End FSDP2's backward of ``groups`` (under ``root``) now: reduce-scatter the gradients they
    accumulated, then run the root's end-of-backward callback (what torch's pipelining does after a
    stage's last micro-batch, ``_PipelineStageBase.perform_reduce_grad``)."""
    from torch.distributed.fsdp import fully_shard

    for group in groups:
        group.post_backward()
    fully_shard.state(root)._root_post_backward_final_callback()


def groups_held() -> int:
    """Process groups this rank is a member of (the default group included)."""
    return len(torch.distributed.distributed_c10d._world.pg_names)


@contextmanager
def counting_new_group_calls() -> Generator[list[int], None, None]:
    """Count this rank's ``new_group`` calls, also those that ``DeviceMesh`` makes and those for
    groups the rank is not in; yields a one-element list holding the count."""
    c10d = torch.distributed.distributed_c10d
    original, calls = c10d._new_group_with_tag, [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    c10d._new_group_with_tag = counted
    try:
        yield calls
    finally:
        c10d._new_group_with_tag = original
