"""Optimizers created before the split, pointed at the parameters the split left (pure logic).

Fabric's usual loop builds the optimizer from ``model.parameters()`` and then calls
``fabric.setup(model, optimizer)``. The split replaces parameters (tensor-parallel shards, ZeRO-2/3
DTensors, a meta-device model's materialised values), so such an optimizer would step tensors the model
no longer uses. Each of its parameters is found again by its name in the module, as Fabric does for
XLA's copies (``Fabric._move_model_to_device``).
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` (its first name, tied weights appearing once)."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def rebind(optimizer: Optimizer, names: dict[int, str], module: nn.Module) -> None:
    """Point ``optimizer``'s groups at ``module``'s parameters of the same names (``names``: taken before
    the split); a parameter this rank no longer holds leaves its group.

    Raises ``ValueError`` for an optimizer that has stepped (its state belongs to the old tensors) or that
    holds a tensor which is not one of the module's parameters.
    """
    if optimizer.state:
        raise ValueError("the optimizer has stepped before Fabric set it up; set the model and the optimizer up "
                         "before the first step (fabric.setup(model, optimizer))")
    now = dict(module.named_parameters(remove_duplicate=False))
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in names]
    if foreign:
        raise ValueError(f"the optimizer holds {len(foreign)} tensors that are not parameters of the model being "
                         "set up; build it from model.parameters()")
    for group in optimizer.param_groups:
        group["params"] = [now[names[id(p)]] for p in group["params"] if names[id(p)] in now]
