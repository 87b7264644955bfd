"""One module run in float64 on the inputs it received: what the split check compares.

``capture_inputs`` records, in one run of the user's step, the arguments each watched module is
called with (floating tensors copied with whether they required grad; objects a module may change,
such as a key/value cache, copied as they were). ``Float64Run`` runs a module on float64 copies of
them with given parameter values (``torch.func.functional_call``: the module's own parameters and
the hooks on them are not touched), then backward with a given output gradient, and keeps outputs,
input gradients and parameter gradients for comparison.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import keystr, tree_map_with_path

from lightning_parallel.compat import tree_map
from lightning_parallel.pipeline.compare import floating_tensors

from .float64 import KeepFloat64


@dataclass
class Captured:
    args: tuple
    kwargs: dict


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _own_copy(value: Any) -> Any:
    """A copy of an object the unit may change (a key/value cache it appends to), as it is now."""
    if isinstance(value, _PLAIN) or callable(value):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is shared as it is
        return value


def _keep(value: Any) -> Any:
    """A detached copy of a tensor (outside inference mode, so autograd may use it later); a floating
    one remembers whether it required grad. Other objects as they are when the unit is called."""
    if not isinstance(value, torch.Tensor):
        return _own_copy(value)
    with torch.inference_mode(False):
        kept = value.detach().clone()
    if value.is_floating_point():
        kept.needs_grad = value.requires_grad  # the flag travels with the copy
    return kept


def capture_inputs(module: nn.Module, names: list[str], run_step) -> dict[str, Captured]:
    """The inputs each module ``names`` receives in one run of ``run_step`` (its first call)."""
    captured: dict[str, Captured] = {}
    handles = []
    for name in names:
        def hook(_m, args, kwargs, name=name):
            if name not in captured:
                captured[name] = Captured(tree_map(_keep, args), tree_map(_keep, kwargs))
        handles.append(module.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        run_step()
    finally:
        for h in handles:
            h.remove()
    return captured


def float64_inputs(captured: Captured, device: torch.device) -> tuple[tuple, dict, list[tuple[str, torch.Tensor]]]:
    """float64 copies of the captured inputs on ``device``, those that required grad as leaves that do,
    named by where they sit (``input 0``, ``input ['position_embeddings'][0]``)."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def convert(path, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            leaf = value.detach().to(device=device, dtype=torch.float64)
            if getattr(value, "needs_grad", False):
                leaf.requires_grad_(True)
                leaves.append(("input" + keystr(path), leaf))
            return leaf
        return value.to(device) if isinstance(value, torch.Tensor) else _own_copy(value)

    args, kwargs = tree_map_with_path(convert, (captured.args, captured.kwargs))
    return args, kwargs, leaves


class Float64Run:
    """One unit run forward and backward in float64: outputs and the gradients of inputs and parameters."""

    def __init__(self, module: nn.Module, values: dict[str, torch.Tensor], captured: Captured,
                 device: torch.device) -> None:
        self.args, self.kwargs, self.inputs = float64_inputs(captured, device)
        self.params = {n: v for n, v in values.items() if v.requires_grad}
        with KeepFloat64():
            out = functional_call(module, values, self.args, self.kwargs, tie_weights=True, strict=False)
        self.outputs = floating_tensors(out)

    def backward(self, cotangents: list[Optional[torch.Tensor]]) -> dict[str, Optional[torch.Tensor]]:
        """Gradients (by input path and parameter name) of the outputs times ``cotangents``."""
        terms = [(o * c).sum() for o, c in zip(self.outputs, cotangents) if c is not None and o.requires_grad]
        targets = [leaf for _, leaf in self.inputs] + list(self.params.values())
        names = [path for path, _ in self.inputs] + list(self.params)
        if not terms or not targets:
            return {}
        with KeepFloat64():
            grads = torch.autograd.grad(sum(terms), targets, allow_unused=True)
        return dict(zip(names, grads))

    def nbytes(self) -> int:
        tensors = [*self.params.values(), *(leaf for _, leaf in self.inputs), *self.outputs]
        return 2 * sum(t.numel() * t.element_size() for t in tensors)  # values and their gradients
