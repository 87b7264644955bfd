"""The state of one pipeline step on one rank: what the step's actions hand each other.

The engine executes a rank's action list (``schedules``) in order; each action leaves behind what
a later one needs: a forward the output its backward starts from, a receive the hidden state a
forward takes, a split backward the weight pass its ``W`` runs. ``StepState`` holds it for one step,
one ``Slot`` per (micro-batch, stage) this rank works on, so each item has a name and a type and is
dropped (set to None) by the action that uses it last, releasing its memory as early as the
schedule allows. On the last stage it also holds what the user's step returned for each
micro-batch, and combines those into what one call on the whole batch would have returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch

from lightning_parallel.compat import tree_map
from lightning_parallel.pipeline.backward_split import WeightPass
from lightning_parallel.pipeline.microbatch import batch_size, merge_outputs


@dataclass
class Slot:
    """One micro-batch on one stage, between the actions of a step."""

    input: Optional[torch.Tensor] = None  # the hidden state received; kept for backward while training
    convention: Optional[int] = None  # how the stage's first block returns its output (``stage_modules``)
    output: Optional[torch.Tensor] = None  # the stage's output, kept for backward (storage released once sent)
    output_like: Optional[tuple[torch.Size, torch.dtype]] = None  # its shape and dtype: those of its gradient
    output_grad: Optional[torch.Tensor] = None  # the gradient of the output, received
    input_grad: Optional[torch.Tensor] = None  # the gradient of the input, to send
    weight_pass: Optional[WeightPass] = None  # left by a split backward for its W


class PendingSend(NamedTuple):
    """A send posted and not yet waited on: its works, and the bytes of activation its buffer keeps alive."""

    works: list
    nbytes: int


@dataclass
class StepState:
    """What one step's actions share.

    Fields:
        micro: the micro-batches, as the user's step receives them.
        shares: each micro-batch's share of the batch's samples.
        step_fn: the user's step (``training_step``, ``validation_step``, ...); ``step_args`` follow the batch.
        loss_scale: what the loss is multiplied by before backward; None outside training.
        split: the (micro-batch, stage) pairs whose backward a W completes (``RankPlan.split``).
        loss_shares: each micro-batch's weight in the batch's loss, once known (``PipelineEngine._loss_shares``).
        slots: (micro-batch, stage) -> its ``Slot`` (``slot``).
        results: micro-batch -> what the user's step returned on the last stage (its loss, detached, once
            backwarded).
        extras: micro-batch -> what ``training_step`` returned beside ``"loss"``.
        sending: index of a send action -> the send, until it is known delivered.
    """

    micro: list
    shares: list[float]
    step_fn: Callable
    step_args: tuple
    loss_scale: Optional[float]
    split: frozenset
    loss_shares: Optional[list[float]] = None
    slots: dict[tuple[int, int], Slot] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)
    extras: dict[int, Any] = field(default_factory=dict)
    sending: dict[int, PendingSend] = field(default_factory=dict)

    @property
    def training(self) -> bool:
        return self.loss_scale is not None

    @property
    def name(self) -> str:
        return getattr(self.step_fn, "__name__", "step")

    def slot(self, microbatch: int, stage: int) -> Slot:
        """The slot of ``microbatch`` on ``stage``, created empty on first use."""
        found = self.slots.get((microbatch, stage))
        if found is None:
            found = self.slots[(microbatch, stage)] = Slot()
        return found

    def batch_loss(self, loss_shares: list[float]) -> torch.Tensor:
        """The batch's loss on the last stage: the micro-batches' losses weighted by ``loss_shares``.

        Summed in at least float32 (a bf16 loss in float32, float64 under ``64-true``), in one copy to the
        host; a micro-batch without targets (its mean is NaN) takes no part, as on one device.
        """
        losses = torch.stack([self.results[mb] for mb in range(len(loss_shares))])
        losses = losses.to(torch.promote_types(losses.dtype, torch.float32)).cpu()
        return sum(w * losses[mb] for mb, w in enumerate(loss_shares) if w)

    def merged_extras(self) -> Optional[Any]:
        """What ``training_step`` returned beside the loss, merged over the micro-batches on the host
        (``microbatch.merge_outputs``); None unless every micro-batch returned more than its loss."""
        if len(self.extras) != len(self.results):
            return None
        merged = merge_outputs([self.extras[mb] for mb in sorted(self.extras)], [batch_size(m) for m in self.micro])
        return tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, merged)

    def merged_results(self) -> Any:
        """The evaluation step's outputs merged over the micro-batches: what one call on the whole batch
        would have returned (``microbatch.merge_outputs``)."""
        return merge_outputs([self.results[mb] for mb in sorted(self.results)], [batch_size(m) for m in self.micro])
