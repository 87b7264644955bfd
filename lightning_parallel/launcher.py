"""Lightning's multiprocessing launcher, made safe for models split across ranks.

The stock launcher hands rank 0's ``state_dict`` back to the parent process and loads it there. With
tensor or pipeline parallelism rank 0 holds only a shard or a stage, which does not fit the parent's
full model, so for a split model the weights stay in the workers (save a checkpoint to keep them).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput


class MultiProcessingLauncher(_MultiProcessingLauncher):
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Optional[_WorkerOutput]:
        output = super()._collect_rank_zero_results(trainer, results)
        if output is None or not getattr(self._strategy, "is_model_split", False) or output.weights_path is None:
            return output
        self._strategy.checkpoint_io.remove_checkpoint(output.weights_path)
        return output._replace(weights_path=None)
