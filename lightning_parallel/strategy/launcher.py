"""Lightning's launchers for ``ParallelStrategy``: checked before any worker starts, and, for
``start_method`` fork, spawn or forkserver, returning a split model's trained weights.

Both run the strategy's launch checks (``ParallelStrategy.check_launch``: sizes given as "auto"
resolved from the batch the run will read, the layout, the model's split) in the launching
process, before any worker exists: a refusal is raised once, as the last line of the output,
instead of once per worker inside torch's ``ProcessRaisedException``. Fork and spawn workers
inherit the resolved sizes; popen workers re-run the script and check again, as every rank does.


The workers train copies of the parent's module; when they finish, the parent's module must hold
the trained weights, or a ``trainer.validate``/``test``/``predict`` that follows would evaluate
the untrained model. Lightning's launcher saves rank 0's ``state_dict`` and loads it in the parent,
which works for data parallelism only: with tensor or pipeline parallelism rank 0 holds one shard
of one stage, and with ZeRO-2/3 its rows of each parameter. Here every rank writes its pieces as a sharded checkpoint (``checkpoint/``), rank 0
consolidates them into the full, unsplit state dict, and the parent loads that into its unsplit
module, checking that it covers every parameter. A parent module on the meta device (built under
``trainer.init_module(empty_init=True)``) takes the tensors as they are (``assign``).

Lightning refuses a second ``fit`` on the same Trainer with this launcher (its loops and callbacks
do not come back from the workers). A ``fit(ckpt_path=...)`` restores all of that from the
checkpoint, so it is allowed here.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn

from lightning_parallel.checkpoint import consolidate, save_sharded
from lightning_parallel.compat import (
    _MultiProcessingLauncher,
    _SubprocessScriptLauncher,
    _WorkerOutput,
    attach_fit_data,
    fit_ckpt_path,
)
from lightning_parallel.strategy.materialize import has_meta_parameters

_EVALUATE_IN_PLACE = ("Train and evaluate in the same processes: start_method='popen' (the default) or torchrun; "
                      "or resume from a checkpoint: trainer.fit(model, ckpt_path='last')")


def check_before_workers(strategy: Any, trainer: Optional[Any], args: tuple, forks: bool = False) -> None:
    """``strategy.check_launch`` in the launching process; ``args`` are the Trainer call's (a fit's
    data is attached first when "auto" sizes need its first batch). Workers ``forks``-ed from this
    process on CUDA choose "auto" sizes themselves: the search reads the device, and CUDA started
    here would not work in them."""
    if trainer is None:
        return
    if strategy.searches_layout:
        if forks and strategy.root_device.type == "cuda":
            return
        if trainer.state.fn == TrainerFn.FITTING:
            attach_fit_data(trainer, args)
    strategy.check_launch(trainer)


class SubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's popen launcher (the script re-run once per rank), checked before the first re-run."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self._strategy = strategy

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        check_before_workers(self._strategy, trainer, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class MultiProcessingLauncher(_MultiProcessingLauncher):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weights_left_behind: Optional[str] = None  # why the parent's module is not the trained one

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        resumes = trainer is not None and trainer.state.fn == TrainerFn.FITTING and fit_ckpt_path(args) is not None
        if self.weights_left_behind is not None and not resumes:
            raise RuntimeError(self.weights_left_behind)
        if resumes:
            self._already_fit = False  # everything a second fit needs comes from the checkpoint
        check_before_workers(self._strategy, trainer, args, forks=self._start_method == "fork")
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Optional[_WorkerOutput]:
        # the parent reads the weights file as soon as this worker ends: it must be written now
        with synchronous_writes(self._strategy):
            return self._rank_zero_results(trainer, results)

    def _rank_zero_results(self, trainer: Any, results: Any) -> Optional[_WorkerOutput]:
        full_state = None
        if trainer.state.fn == TrainerFn.FITTING and self._strategy.splits_parameters:
            full_state = gather_full_state_dict(self._strategy)  # collective: every rank takes part
        output = super()._collect_rank_zero_results(trainer, results)
        if output is None or output.weights_path is None or not self._strategy.splits_parameters:
            return output
        if full_state is None:  # the first process of another node: the full state is on global rank 0
            self._strategy.checkpoint_io.remove_checkpoint(output.weights_path)
            output.extra["weights_left_behind"] = (
                f"the trained weights stay in the workers of node 0: on node {self._strategy.node_rank} the "
                f"module is untrained, so this Trainer refuses to evaluate or predict with it. {_EVALUATE_IN_PLACE}"
            )
            return output._replace(weights_path=None)
        # rank 0's own state dict is one shard of one stage: replace it by the whole model's
        self._strategy.checkpoint_io.save_checkpoint(full_state, output.weights_path)
        return output

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: Any) -> None:
        module = trainer.lightning_module
        self.weights_left_behind = worker_output.extra.pop("weights_left_behind", None)
        if worker_output.weights_path is not None and (self._strategy.splits_parameters or has_meta_parameters(module)):
            # the whole model's state (Lightning's loading would also copy into meta tensors, keeping nothing)
            state = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            self.weights_left_behind = load_full_state_dict(module, state)
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)


@contextmanager
def synchronous_writes(strategy: Any) -> Iterator[None]:
    """Inside, ``strategy.checkpoint_io`` writes before returning: ``AsyncCheckpointIO`` is set aside."""
    plugin = strategy.checkpoint_io
    if type(plugin) is not AsyncCheckpointIO:
        yield
        return
    strategy.checkpoint_io = plugin.checkpoint_io
    try:
        yield
    finally:
        strategy.checkpoint_io = plugin


def gather_full_state_dict(strategy: Any) -> Optional[dict[str, torch.Tensor]]:
    """The unsplit model's state dict on global rank 0 (None elsewhere), from every TP shard and
    pipeline stage. Collective: every rank calls it."""
    folder = Path(strategy.broadcast(tempfile.mkdtemp() if strategy.global_rank == 0 else None))
    try:
        save_sharded(strategy, {"state_dict": strategy.lightning_module.state_dict()}, folder / "weights")
        strategy.barrier()
        return consolidate(folder / "weights")["state_dict"] if strategy.global_rank == 0 else None
    finally:
        strategy.barrier()
        if strategy.global_rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def load_full_state_dict(module: Any, state: dict[str, torch.Tensor]) -> Optional[str]:
    """Load the workers' consolidated weights into the parent's unsplit ``module``.

    Returns None, or, when the state does not cover every parameter, the refusal for the next
    Trainer call: a module whose trained weights did not come back must not be evaluated with its
    initial ones.
    """
    missing = sorted({n for n, _ in module.named_parameters(remove_duplicate=False)} - set(state))
    if missing:
        return (
            f"the trained weights of {type(module).__name__} did not come back from the worker processes "
            f"({len(missing)} parameters missing, e.g. {', '.join(missing[:3])}), so this Trainer refuses to "
            f"evaluate or predict with its initial weights. {_EVALUATE_IN_PLACE}"
        )
    module.load_state_dict(state, strict=False, assign=has_meta_parameters(module))
    return None
