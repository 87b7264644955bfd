"""Lightning Fabric front end: the Trainer strategies' parallelisms under ``Fabric(strategy=...)``.

    from lightning.fabric import Fabric
    from lightning_parallel.fabric import FabricParallelStrategy

    fabric = Fabric(accelerator="cuda", devices=8, strategy=FabricParallelStrategy(tensor_parallel=2, zero_stage=3))
    fabric = Fabric(accelerator="cuda", devices=8, strategy="lp_tp")  # the registered names work too

One implementation, two front ends: ``FabricParallelStrategy`` drives the Trainer's ``ParallelStrategy``
(``strategy.py``).
"""

from lightning_parallel.fabric.presets import (
    FabricDataParallelStrategy,
    FabricPipelineParallelStrategy,
    FabricTensorParallelStrategy,
    register,
)
from lightning_parallel.fabric.strategy import FabricParallelStrategy

__all__ = ["FabricDataParallelStrategy", "FabricParallelStrategy", "FabricPipelineParallelStrategy",
           "FabricTensorParallelStrategy", "register"]
