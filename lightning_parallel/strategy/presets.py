"""The registered presets: one parallelism over every process, the others left at one."""

from __future__ import annotations

from typing import Any, Union

from lightning_parallel.strategy.parallel import ParallelStrategy, StartMethod


class DataParallelStrategy(ParallelStrategy):
    """Data parallelism only: each process holds the whole model and a share of the batch."""

    strategy_name = "lp_dp"

    def __init__(self, bucket_size_mb: float = 25.0, start_method: StartMethod = "popen", **kwargs: Any) -> None:
        super().__init__(bucket_size_mb=bucket_size_mb, start_method=start_method, **kwargs)


class TensorParallelStrategy(ParallelStrategy):
    """Tensor parallelism; ``tensor_parallel=None`` shards over every process (no data parallelism)."""

    strategy_name = "lp_tp"

    def __init__(self, tensor_parallel: Union[int, str, None] = None, **kwargs: Any) -> None:
        self._tp_all = tensor_parallel is None
        super().__init__(tensor_parallel=tensor_parallel or 1, **kwargs)

    def _resolve_sizes(self, trainer: Any) -> None:
        if self._tp_all:
            self.options = self.options.replace(
                tensor_parallel=max(1, self.num_nodes * self.num_processes // self.options.pp))
        else:  # a size, or "auto" for the planner
            super()._resolve_sizes(trainer)


class PipelineParallelStrategy(ParallelStrategy):
    """Pipeline parallelism; ``pipeline_parallel=None`` makes one stage per process."""

    strategy_name = "lp_pp"

    def __init__(self, pipeline_parallel: Union[int, str, None] = None, **kwargs: Any) -> None:
        self._pp_all = pipeline_parallel is None
        super().__init__(pipeline_parallel=pipeline_parallel or 1, **kwargs)

    def _resolve_sizes(self, trainer: Any) -> None:
        if self._pp_all:
            self.options = self.options.replace(
                pipeline_parallel=max(1, self.num_nodes * self.num_processes // self.options.tp))
        else:  # a size, or "auto" for the planner
            super()._resolve_sizes(trainer)
