"""Errors raised when a pipeline cannot be built or cannot serve a model."""


class PipelineConfigError(ValueError):
    """The requested pipeline (stages, micro-batches, schedule, layout) is not realisable."""


class PipelineIncompatibleModel(ValueError):
    """The model's forward passes something other than one hidden state between its blocks."""
