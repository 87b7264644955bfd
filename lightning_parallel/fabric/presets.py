"""The Fabric strategy names, one per Trainer preset (``strategy/presets.py``), with the same options.

``Fabric(strategy="lp_tp")`` builds ``FabricTensorParallelStrategy``, whose engine is the Trainer's
``TensorParallelStrategy``: the same defaults (tensor parallelism over every process) and arguments.
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.fabric.strategy import FabricParallelStrategy
from lightning_parallel.strategy.presets import (
    DataParallelStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)


class FabricDataParallelStrategy(FabricParallelStrategy):
    """Data parallelism only (``zero_stage`` 0-3): each process reads a share of the batch."""

    engine_class = DataParallelStrategy
    strategy_name = "lp_dp"


class FabricTensorParallelStrategy(FabricParallelStrategy):
    """Tensor parallelism; ``tensor_parallel=None`` (the default) shards over every process."""

    engine_class = TensorParallelStrategy
    strategy_name = "lp_tp"


class FabricPipelineParallelStrategy(FabricParallelStrategy):
    """Pipeline parallelism; ``pipeline_parallel=None`` makes one stage per process. The loop hands its loss
    function to the model (``pipeline.py``)."""

    engine_class = PipelineParallelStrategy
    strategy_name = "lp_pp"


FABRIC_STRATEGIES = {
    "lp_dp": (FabricDataParallelStrategy, "data parallelism (ZeRO 0-3) with bucketed, overlapped all-reduce"),
    "lp_tp": (FabricTensorParallelStrategy, "Megatron-style tensor parallelism over all devices"),
    "lp_pp": (FabricPipelineParallelStrategy, "pipeline parallelism (1F1B) over all devices"),
    "lp_3d": (FabricParallelStrategy, "data x tensor x pipeline x context x expert parallelism"),
}


def register(registry: Any) -> None:
    """Add the names to Fabric's ``STRATEGY_REGISTRY`` (those not there yet)."""
    for name, (cls, description) in FABRIC_STRATEGIES.items():
        if name not in registry:
            registry.register(name, cls, description=description)
