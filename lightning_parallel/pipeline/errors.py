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
NO_GRAD = (
    "block {index} runs with gradients disabled inside the step itself (torch.no_grad() or torch.inference_mode() "
    "around the model call); the pipeline's setup trace follows the hidden state from block to block through "
    "autograd, which records nothing there. Remove it from the step: Lightning already runs validation, test and "
    "predict without gradients, and a frozen part is frozen with requires_grad_(False)"
)


def without_gradients(index: int) -> str:
    """Why block ``index`` running with gradients disabled in a training forward or the setup trace is
    refused: reentrant activation checkpointing runs it so, or the step itself disables them."""
    import traceback

    checkpointing = any(f.filename.replace("\\", "/").endswith("torch/utils/checkpoint.py")
                        for f in traceback.extract_stack())
    return (REENTRANT if checkpointing else NO_GRAD).format(index=index)


REPEATED_FORWARD = (
    "the first block of pipeline stage {stage} ran twice in one step, the second time on an input of another shape: "
    "the step runs the model's forward more than once (a decoding loop written in the step), and a pipelined step "
    "passes one forward through the stages. A "
    "decoding loop in an evaluation step runs through the stages when it is a method named generate (of the module "
    "or the model) that the step calls"
)
