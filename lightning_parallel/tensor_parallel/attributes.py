"""Stored sizes that unchanged attention code reshapes with, read and divided by the TP size.

A plan's ``divide`` names integer attributes of the matched module (``num_heads``) or a dotted
path into an object it holds (``config.n_head``, as LitGPT's attention reads its head counts from
its config). That object is usually shared by every layer and by the model itself, so dividing
through a path first gives the module its own shallow copy: the rest of the model keeps the full
counts.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn


def read_attribute(module: nn.Module, path: str) -> Any:
    """The value at ``path`` (``attr`` or ``holder.attr``) of ``module``, or None."""
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def divide_attribute(module: nn.Module, path: str, tp_size: int) -> None:
    """Divide the integer at ``path`` by ``tp_size``, copying each object on the way (see above)."""
    *holders, attr = path.split(".")
    owner: Any = module
    for part in holders:
        own = copy.copy(getattr(owner, part))
        setattr(owner, part, own)
        owner = own
    setattr(owner, attr, getattr(owner, attr) // tp_size)
