"""Pipeline parallelism for an unchanged LightningModule: schedules, partition, engine."""

from lightning_parallel.pipeline.engine import PipelineEngine
from lightning_parallel.pipeline.errors import (
    PipelineConfigError,
    PipelineIncompatibleModel,
)
from lightning_parallel.pipeline.partition import StagePlan, plan_stages
from lightning_parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Op,
    Simulation,
    build_schedule,
    simulate,
    validate,
)

__all__ = [
    "Action",
    "Op",
    "PipelineConfigError",
    "PipelineEngine",
    "PipelineIncompatibleModel",
    "SCHEDULES",
    "Simulation",
    "StagePlan",
    "build_schedule",
    "plan_stages",
    "simulate",
    "validate",
]
