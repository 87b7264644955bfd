"""Steps that generate: found at setup, so the engine runs them relayed (``relay``) instead of pipelined.

``model.generate(...)`` (Hugging Face's ``GenerationMixin``, nanoGPT's loop) calls the model's forward
once per new token, under ``torch.no_grad()``, inside one call of the user's step. A pipelined step
stops each stage at its boundary after one forward (``stage_modules``), which a decoding loop cannot
do; so an evaluation step that generates (``validation_step``, ``test_step``, ``predict_step``) runs on
every rank of the pipeline with each of its forwards passing through the stages (``relay``), and the
setup trace, which would run the whole decoding loop, is not taken from it. A ``training_step`` that
generates is refused: its backward would have to run through the same relayed forwards.

Found from the step's code, not by running it: the step, or a method of the module it calls, names
an attribute ``generate`` while a module of the model has a ``generate`` method.
"""

from __future__ import annotations

import types
from typing import Any, Iterator, Optional

from torch import nn

from lightning_parallel.pipeline.errors import PipelineIncompatibleModel


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:  # comprehensions, lambdas and functions defined inside
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _names_generate(module: nn.Module, function: Any, seen: set) -> bool:
    """Whether ``function`` (a bound method of ``module`` or a plain function) names ``generate``, itself
    or through the module's own methods it names."""
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    for inner in _code_objects(code):
        if "generate" in inner.co_names:
            return True
        for name in inner.co_names:
            method = getattr(type(module), name, None)
            if isinstance(method, types.FunctionType) and _names_generate(module, method, seen):
                return True
    return False


def generating_step(module: nn.Module, steps: list[str]) -> Optional[str]:
    """The first of ``steps`` (method names of ``module``) that calls a ``generate`` of the model, or None."""
    if not any(callable(getattr(m, "generate", None)) for m in module.modules()):
        return None
    for step in steps:
        method = getattr(module, step, None)
        if method is not None and _names_generate(module, method, set()):
            return step
    return None


EVALUATION_STEPS = ("validation_step", "test_step", "predict_step")


def generating_steps(module: nn.Module) -> frozenset[str]:
    """The evaluation steps of ``module`` that call a ``generate`` of the model."""
    return frozenset(step for step in EVALUATION_STEPS if generating_step(module, [step]))


def refuse_generating_training(module: nn.Module) -> None:
    """Raise ``PipelineIncompatibleModel`` if ``training_step`` generates (see the module docstring)."""
    if generating_step(module, ["training_step"]) is None:
        return
    raise PipelineIncompatibleModel(
        "training_step calls generate(), which runs the model's forward once per new token inside one call of the "
        "step; under pipeline parallelism a training step's forwards and backwards run per micro-batch through the "
        "stages' schedule, and a decoding loop's forwards cannot be scheduled that way. What works: generate in "
        "validation_step, test_step or predict_step (relayed through the stages: one device's tokens), or train "
        "such a step with tensor or data parallelism (pipeline_parallel=1)"
    )
