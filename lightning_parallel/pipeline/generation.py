"""Steps that generate: a decoding loop cannot run across pipeline stages, and is refused at setup.

``model.generate(...)`` (Hugging Face's ``GenerationMixin``, nanoGPT's loop) calls the model's forward
once per new token, under ``torch.no_grad()``, inside one call of the user's step. A pipeline stage
runs a step once per micro-batch and leaves it at its stage boundary with one hidden state for the
next stage (``stage_modules``): the first forward of the loop would end the step on every stage but
the last, and the last stage would decode from stand-in values. Stages that each keep their own
layers' KV cache and pass every decoding step through the pipeline would need the engine to drive
the model's forward rather than the step; until then a step that generates is refused before the
setup trace (which would otherwise stop at the first block run with gradients disabled and blame
activation checkpointing), with what does work.

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


def refuse_generation(module: nn.Module, steps: list[str]) -> None:
    """Raise ``PipelineIncompatibleModel`` if one of ``steps`` generates (see the module docstring)."""
    step = generating_step(module, steps)
    if step is None:
        return
    during_fit = step == "validation_step" and "training_step" in steps
    raise PipelineIncompatibleModel(
        f"{step} calls generate(), which runs the model's forward once per new token inside one call of the "
        f"step; a pipeline stage runs {step} once per micro-batch and hands a single hidden state to the next "
        "stage, so a decoding loop and its KV cache cannot run across pipeline stages. What works: generate with "
        "tensor or data parallelism (pipeline_parallel=1, tensor_parallel=N: one device's tokens), or train with "
        "pipelining and generate from its checkpoint on one device (MyModule.load_from_checkpoint(dir), or "
        "lp-export and from_pretrained); a step that computes a loss or logits with one forward runs under "
        "pipelining"
        + ("; to train with pipelining now, skip this validation (Trainer(limit_val_batches=0))" if during_fit else "")
    )
