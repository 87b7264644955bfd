"""Pipeline parallelism under Fabric: the module ``setup_module`` returns runs the schedule.

Under the Trainer, the pipeline engine (``pipeline/engine.py``) runs ``training_step`` once per
micro-batch on every stage and back-propagates each inside the step. A Fabric loop owns its loss, so it
hands the loss to the model instead of computing it after a forward:

    model = fabric.setup_module(model)             # or fabric.setup(model, optimizer)
    loss = model(batch, loss_fn=lambda m, micro: m(input_ids=micro, labels=micro).loss)
    fabric.backward(loss)                          # the gradients are complete: finalised here
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()

``model(batch, loss_fn)`` splits ``batch`` into ``micro_batches`` along dim 0, runs ``loss_fn(module,
micro_batch)`` for each on the schedule, forward and backward, and returns the batch's loss (each
micro-batch weighted by its share of the batch's targets) on every rank, without a graph: the
backward has run. ``fabric.backward`` then only finalises the gradients (tied weights, data-parallel
reduction), as the Trainer strategy does after its pipelined step; inside ``fabric.no_backward_sync``
nothing leaves the rank. ``loss_scale`` scales the gradients (``1 / accumulation`` when accumulating).
Without ``loss_fn``, a call runs the module itself (evaluation on the whole stage set is not pipelined).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
from torch import nn


class PipelinedModule(nn.Module):
    """``module`` (this rank's stages) whose call with ``loss_fn`` runs one pipelined training step."""

    def __init__(self, module: nn.Module, strategy: Any) -> None:
        super().__init__()
        self.module = module
        self._strategy = [strategy]  # a list: not a submodule, not in the state dict

    def forward(self, batch: Any, loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
                loss_scale: float = 1.0) -> torch.Tensor:
        if loss_fn is None:
            raise TypeError("under pipeline parallelism the model runs a training step over micro-batches: call it "
                            "as model(batch, loss_fn=lambda module, micro_batch: loss), then fabric.backward(loss)")
        engine = self._strategy[0].engine
        module = self.module

        def step(micro_batch: Any) -> torch.Tensor:
            return loss_fn(module, micro_batch)

        step.__name__ = "training_step"  # the name the engine learns the loss's targets under
        blocked = engine._sync_blocked
        # as the Trainer strategy's pipelined step: micro-batches accumulate locally; at the window's end
        # each stage's last backward launches its data-parallel buckets
        no_sync = engine.grad_sync.no_sync() if engine.grad_sync is not None else nullcontext()
        overlap = engine.finalize_gradients.overlapped(window_ends=not blocked)
        with no_sync, overlap:
            return engine.pipeline._run(step, batch, (), loss_scale)
