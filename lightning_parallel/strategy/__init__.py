"""The Lightning integration: ``ParallelStrategy`` and its presets, with the helpers only it uses
(launcher, materialisation of meta models, gradient finalisation, clipping, metric sync, requeue)."""

from lightning_parallel.strategy.parallel import ParallelStrategy
from lightning_parallel.strategy.presets import (
    DataParallelStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)

__all__ = ["DataParallelStrategy", "ParallelStrategy", "PipelineParallelStrategy", "TensorParallelStrategy"]
