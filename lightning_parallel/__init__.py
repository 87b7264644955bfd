"""lightning-parallel: data, tensor and pipeline parallelism for unchanged Lightning modules.

    from lightning_parallel import ParallelStrategy
    trainer = Trainer(devices=8, strategy=ParallelStrategy(tensor_parallel=2, pipeline_parallel=2))

Importing the package registers the strategy names ``lp_dp``, ``lp_tp``, ``lp_pp`` and ``lp_3d``
with Lightning, so ``Trainer(strategy="lp_dp")`` works too.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.mesh import MeshError, ParallelMesh
from lightning_parallel.strategy import (
    DataParallelStrategy,
    ParallelStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)

ParallelStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "DataParallelStrategy",
    "MeshError",
    "ParallelMesh",
    "ParallelStrategy",
    "PipelineParallelStrategy",
    "TensorParallelStrategy",
]
