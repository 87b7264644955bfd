"""Lightning's multiprocessing launcher, made safe for models split across ranks.

The stock launcher hands rank 0's ``state_dict`` back to the parent process and loads it there. With
tensor or pipeline parallelism rank 0 holds only a shard or a stage, which does not fit the parent's
full model, so for a split model the weights stay in the workers (save a checkpoint to keep them).
A model the parent created on the meta device takes rank 0's tensors as they are (``assign``),
since there is nothing to copy them into.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput

from lightning_parallel.init import has_meta_parameters


class MultiProcessingLauncher(_MultiProcessingLauncher):
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Optional[_WorkerOutput]:
        output = super()._collect_rank_zero_results(trainer, results)
        if output is None or not getattr(self._strategy, "is_model_split", False) or output.weights_path is None:
            return output
        self._strategy.checkpoint_io.remove_checkpoint(output.weights_path)
        return output._replace(weights_path=None)

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: Any) -> None:
        module = trainer.lightning_module
        if worker_output.weights_path is not None and has_meta_parameters(module):
            state = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            module.load_state_dict(state, strict=False, assign=True)
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)
