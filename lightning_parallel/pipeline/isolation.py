"""Run the user's step at setup without it leaving anything behind on the module.

The pipeline runs the user's own step once at setup, whole (``order.trace_run_order``) and then
stage by stage (``PipelineEngine._probe``), to learn the order the modules run in. Those calls are
not part of training or evaluation, so nothing they do may show afterwards: a torchmetrics
``Metric`` updated in ``validation_step`` would otherwise count the example batch once more on every
stage (its ``add_state`` states, ``_update_count``, ``_computed``, ``_forward_cache`` all change), and
a list the step appends to (``self.outputs.append(loss)``) would hold one entry too many.

``untouched(module)`` records, for the module and every submodule, the plain attributes of its
``__dict__`` (everything but the parameter, buffer, submodule and hook tables of ``nn.Module``,
which the trace handles itself), and on exit puts back what was there: attributes rebound or deleted
are rebound, attributes added are deleted, the items of ``list``/``dict``/``set`` attributes and the
values of tensor attributes (torchmetrics states are plain tensor attributes, updated in place) are
restored in the very objects the module holds, so references to them stay valid. What it cannot
undo: changes inside other objects the module refers to (an attribute of a config object, a nested
container), and anything outside the module (globals, files). ``self.log`` is not reached: the
trace runs with logging suppressed (``LogCapture.suppressed``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

_MODULE_TABLES = frozenset(vars(nn.Module()))  # _parameters, _buffers, _modules, hook dicts, training
_MISSING = object()


def _saved(value: Any) -> Any:
    """What ``value`` holds now, kept apart from later in-place changes."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, set):
        return set(value)
    return None


def _put_back(value: Any, saved: Any) -> Any:
    """``value`` with the contents it had when ``saved`` was taken; a fresh copy where that is impossible."""
    if isinstance(value, torch.Tensor):
        same = value.shape == saved.shape and value.dtype == saved.dtype and value.device == saved.device
        if not same or value.is_inference():
            return saved
        with torch.no_grad():
            value.copy_(saved)
    elif isinstance(value, list):
        value[:] = saved
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(saved)
    return value


def _snapshot(module: nn.Module) -> list[tuple[nn.Module, dict]]:
    state = []
    for m in module.modules():
        attrs = {name: (value, _saved(value)) for name, value in vars(m).items() if name not in _MODULE_TABLES}
        state.append((m, attrs))
    return state


def _restore(state: list[tuple[nn.Module, dict]]) -> None:
    for m, attrs in state:
        for name in [n for n in vars(m) if n not in _MODULE_TABLES and n not in attrs]:
            del m.__dict__[name]  # added by the step
        for name, (value, saved) in attrs.items():
            m.__dict__[name] = _put_back(value, saved) if saved is not None else value


@contextmanager
def untouched(module: nn.Module) -> Iterator[None]:
    """Inside, ``module``'s plain attributes (metric states included) may change; on exit they are back."""
    state = _snapshot(module)
    try:
        yield
    finally:
        _restore(state)
