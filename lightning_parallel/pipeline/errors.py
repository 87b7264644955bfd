"""Errors raised when a pipeline cannot be built or cannot serve a model."""

from lightning_parallel.errors import ConfigurationError, IncompatibleModelError


class PipelineConfigError(ConfigurationError):
    """The requested pipeline (stages, micro-batches, schedule, layout) is not realisable."""


class PipelineIncompatibleModel(IncompatibleModelError):
    """The model's forward passes something other than one hidden state between its blocks."""


REENTRANT = (
    "block {index} runs with gradients disabled in a training forward, as reentrant activation checkpointing "
    "(torch.utils.checkpoint(..., use_reentrant=True)) runs it; its recomputation in backward cannot start from the "
    "hidden state a pipeline stage receives. Use use_reentrant=False, which pipeline stages support"
)
