"""What a schedule is made of: one rank's actions, each an operation on one micro-batch of one stage.

An action is a forward ``F``, a backward ``B`` or a weight pass ``W`` of one micro-batch on one
(virtual) stage, or the point-to-point traffic around it: ``recv_f``/``send_f`` move the hidden
state from stage ``s`` to ``s + 1``, ``recv_b``/``send_b`` move its gradient back. Where a
schedule has a ``W`` for a micro-batch and stage, its ``B`` computes only the input gradient and
the ``W`` the weight gradients (``backward_split``); without one, ``B`` computes both.

Every schedule builder (``classic``, ``zero_bubble``) composes the same two pieces,
``forward_actions`` and ``backward_actions``, and checks its sizes with ``check_sizes``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lightning_parallel.pipeline.errors import PipelineConfigError


class Op(enum.Enum):
    """The operation of an action; its value is the short name schedules print (``F0@1``, ``send_f0@1``)."""

    F = "F"  # forward of the micro-batch through the stage
    B = "B"  # backward: the input gradient alone where a W follows, else input and weight gradients
    W = "W"  # weight pass: the weight gradients a split B left to compute
    RECV_F = "recv_f"  # receive the stage's input (the previous stage's output)
    SEND_F = "send_f"  # send the stage's output to the next stage
    RECV_B = "recv_b"  # receive the gradient of the stage's output from the next stage
    SEND_B = "send_b"  # send the gradient of the stage's input to the previous stage

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        """Whether the operation computes (F, B, W) rather than communicates."""
        return self in COMPUTE

    @property
    def is_receive(self) -> bool:
        """Whether the operation waits for a message (a blocking receive)."""
        return self in (Op.RECV_F, Op.RECV_B)

    @property
    def is_send(self) -> bool:
        """Whether the operation posts a message (an asynchronous send)."""
        return self in (Op.SEND_F, Op.SEND_B)


COMPUTE = frozenset((Op.F, Op.B, Op.W))


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: ``op`` on micro-batch ``microbatch`` of stage ``stage``."""

    op: Op
    microbatch: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.op}{self.microbatch}@{self.stage}"

    @property
    def unit(self) -> tuple[int, int]:
        """``(micro-batch, stage)``: the unit of work the action belongs to, shared by its F, B, W and messages."""
        return self.microbatch, self.stage


def matching_receive(send: Action) -> Action:
    """The receive that ``send`` satisfies: the next stage's ``recv_f``, or the previous stage's ``recv_b``."""
    if send.op is Op.SEND_F:
        return Action(Op.RECV_F, send.microbatch, send.stage + 1)
    if send.op is Op.SEND_B:
        return Action(Op.RECV_B, send.microbatch, send.stage - 1)
    raise ValueError(f"{send!r} is not a send")


def forward_actions(mb: int, stage: int, num_stages: int) -> list[Action]:
    """Receive the input (unless first stage), compute, send the output (unless last stage)."""
    acts = [] if stage == 0 else [Action(Op.RECV_F, mb, stage)]
    acts.append(Action(Op.F, mb, stage))
    if stage < num_stages - 1:
        acts.append(Action(Op.SEND_F, mb, stage))
    return acts


def backward_actions(mb: int, stage: int, num_stages: int) -> list[Action]:
    """Receive the output's gradient (unless last stage), compute, send the input's gradient."""
    acts = [] if stage == num_stages - 1 else [Action(Op.RECV_B, mb, stage)]
    acts.append(Action(Op.B, mb, stage))
    if stage > 0:
        acts.append(Action(Op.SEND_B, mb, stage))
    return acts


def check_sizes(stages: int, micro_batches: int, rank: int, virtual_stages: int = 1) -> None:
    """Refuse a schedule request with a non-positive size or a rank outside the pipeline."""
    if stages < 1 or micro_batches < 1 or virtual_stages < 1:
        raise PipelineConfigError(
            f"stages ({stages}), micro_batches ({micro_batches}) and virtual_stages ({virtual_stages}) "
            "must all be at least 1"
        )
    if not 0 <= rank < stages:
        raise PipelineConfigError(f"rank {rank} is outside the {stages} pipeline stages (0..{stages - 1})")
