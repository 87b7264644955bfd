"""Run the setup trace of a model whose parameters are still on the meta device.

Under ``trainer.init_module(empty_init=True)`` parameters are created on the meta device and each
rank materialises only its own stage after the split, so the order the modules run in has to be
learnt before any real weight exists. Meta tensors carry shapes and dtypes but no values, and most
operators (matrix products, attention, cross entropy, autograd) run on them without computing, so
the user's step runs there too once its batch (``meta_batch``) and the module's buffers and tensor
attributes (rotary tables, masks, metric states; ``meta_device``) are meta tensors as well: an
operator refuses to mix meta and real tensors. What needs values (``.item()``, ``if mask.any()``,
``torch.equal``) fails; the engine then falls back to registration order, checked while training.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from lightning_parallel.compat import tree_map


def meta_batch(batch: Any) -> Any:
    """``batch`` with every tensor on the meta device."""
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)


@contextmanager
def meta_device(module: nn.Module, active: bool = True) -> Iterator[None]:
    """Inside (when ``active``), ``module``'s buffers and plain tensor attributes are meta tensors; on
    exit the original tensors are back in place."""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    if active:
        for m in module.modules():
            for table in (m._buffers, m.__dict__):
                for name, value in list(table.items()):
                    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not value.is_meta:
                        swapped.append((table, name, value))
                        table[name] = value.to("meta")
    try:
        yield
    finally:
        for table, name, value in swapped:
            table[name] = value
