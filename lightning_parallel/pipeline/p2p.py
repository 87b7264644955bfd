"""Point-to-point exchange of hidden states and their gradients between pipeline stages.

Shapes. The first hidden state a stage receives for a given micro-batch signature (the shapes and
dtypes of the micro-batch, which every stage computes from its own copy of the batch) comes behind
a fixed-size header (ndim, dtype, output convention, shape); later micro-batches with that
signature, in this step and in later ones, reuse it, as Megatron-LM does for fixed shapes. A
receiver thus needs no prior knowledge of shapes or dtypes (bf16 under autocast, an uneven last
micro-batch, a new sequence length) and pays the header's extra round trip only when a signature
is new. A sender whose output would not match the shape it announced stops with an error. A
gradient has the shape and dtype of the output it belongs to, which the receiver kept.

Matching. Every message has its own tag, derived from (kind, micro-batch, stage), so messages
match whatever order the two ranks post them in. Each run of consecutive communication actions is
posted as one ``batch_isend_irecv``, described by one ``Message`` per action; sends complete in
the background and receives are waited for, the semantics ``schedules.validate`` proves
deadlock-free.

Posting ahead. On CPU (gloo) a send whose receive is not yet posted is announced and then written
by the sender's background thread once the receiver asks for it; with every core busy computing,
that thread waits for the scheduler and the receiver idles for milliseconds. ``post_ahead``
therefore posts the receives of the next exchange, hidden states and gradients, as soon as their
shapes are known, so that the matching send finds its receive waiting and is written at once by the
sending stage (the receive-ahead of Megatron-LM's ``overlap_p2p_comm``). Gradients matter most where
a rank holds two stages (ZB-V, interleaved 1F1B): on the benchmark's two ranks the first stage's
wait for its gradients fell from 35 to 19 ms a step under ZB-V (torch's ``ScheduleZBVZeroBubble``:
18-24 ms). It costs one extra received buffer per rank and direction. NCCL matches point-to-point
operations in issue order on one stream, where an early receive would hold back the sends behind
it, so there receives are posted with their exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, NamedTuple, Optional

import torch
import torch.distributed as dist

from lightning_parallel.pipeline.errors import PipelineIncompatibleModel
from lightning_parallel.pipeline.schedules.actions import Action, Op

HEADER = 10
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_ACT_HEADER, _ACT, _GRAD = 0, 1, 2
_ORDER = (Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B)  # how an exchange posts its messages


@dataclass
class Message:
    """One point-to-point message of an exchange: the communication action that posts it, and its data.

    What the caller gives: a send's ``tensor`` (``send_f``: the stage's output, with the ``convention``
    in which the next stage's first block returns its output; ``send_b``: the gradient of the stage's
    input), and for a gradient receive (``recv_b``) the shape and dtype of the output the gradient
    belongs to (``like``), which the receiving stage kept. What ``exchange`` fills in: a receive's
    ``tensor`` (and for a hidden state its ``convention``), and a send's ``works``, which keep its tensor
    alive until they are waited on.
    """

    action: Action
    tensor: Optional[torch.Tensor] = None
    convention: int = 0
    like: Optional[tuple[torch.Size, torch.dtype]] = None
    works: list[dist.Work] = field(default_factory=list)


class _Posted(NamedTuple):
    """A receive posted ahead of its exchange."""

    works: list[dist.Work]
    buffer: torch.Tensor
    convention: Optional[int]


def _post(ops: list[dist.P2POp]) -> list[list[dist.Work]]:
    """Post ``ops`` as one batch; the works that complete each op (all of them if the backend coalesced)."""
    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    if len(works) == len(ops):
        return [[w] for w in works]
    return [list(works)] * len(ops)  # one work for the whole coalesced batch (NCCL)


def _in_order(messages: list[Message], *ops: Op) -> list[Message]:
    """``messages`` of the operations ``ops``, grouped by operation in that order."""
    return [m for op in ops for m in messages if m.action.op is op]


class StageLink:
    """Messages of one rank to and from its neighbouring stages.

    Args:
        peer_rank: global rank of a (virtual) stage.
        num_stages: stages in the pipeline (ranks x virtual stages).
        group: the pipeline process group.
        device: where received tensors are allocated.
        post_ahead: post receives before their exchange (default: on CPU only, see the module doc).
    """

    def __init__(self, peer_rank: Callable[[int], int], num_stages: int, group, device: torch.device,
                 post_ahead: bool | None = None):
        self.peer_rank, self.num_stages, self.group, self.device = peer_rank, num_stages, group, device
        self.post_ahead = torch.device(device).type == "cpu" if post_ahead is None else post_ahead
        # (receiving stage, micro-batch key) -> (shape, dtype index, convention), agreed once
        self.sent: dict[tuple[int, Hashable], tuple] = {}
        self.received: dict[tuple[int, Hashable], tuple] = {}
        # receive action -> what was posted for it ahead of its exchange
        self.posted: dict[Action, _Posted] = {}

    def new_step(self) -> None:
        """Start a step: nothing may still be posted from the last one."""
        if self.posted:
            raise RuntimeError(f"pipeline receives {list(self.posted)} were posted but never used in the last step")

    def _tag(self, kind: int, microbatch: int, stage: int) -> int:
        return (microbatch * self.num_stages + stage) * 3 + kind

    def _recv_op(self, kind: int, buf: torch.Tensor, mb: int, stage: int) -> dist.P2POp:
        src = self.peer_rank(stage - 1 if kind != _GRAD else stage + 1)
        return dist.P2POp(dist.irecv, buf, src, self.group, self._tag(kind, mb, stage))

    def _known_input(self, mb: int, stage: int, key_of: Callable[[int], Hashable]):
        known = self.received.get((stage, key_of(mb)))
        if known is None:
            return None
        shape, dtype, convention = known
        return torch.empty(shape, dtype=_DTYPES[dtype], device=self.device), convention

    def receive_ahead(self, messages: list[Message], key_of: Callable[[int], Hashable]) -> None:
        """Post now the receives among ``messages`` (of a later exchange) whose shapes are known: hidden
        states of a micro-batch key seen before, and gradients (``like``), if ``post_ahead``."""
        if not self.post_ahead:
            return
        ops, entries = [], []
        for m in _in_order(messages, Op.RECV_F, Op.RECV_B):
            if m.action in self.posted:
                continue
            mb, stage = m.action.unit
            if m.action.op is Op.RECV_F:
                known = self._known_input(mb, stage, key_of)
                if known is None:
                    continue
                (buf, convention), kind = known, _ACT
            else:
                buf, convention, kind = torch.empty(m.like[0], dtype=m.like[1], device=self.device), None, _GRAD
            ops.append(self._recv_op(kind, buf, mb, stage))
            entries.append((m.action, buf, convention))
        for (action, buf, convention), works in zip(entries, _post(ops)):
            self.posted[action] = _Posted(works, buf, convention)

    def _send_ops(self, m: Message, key_of: Callable[[int], Hashable]) -> list[dist.P2POp]:
        """The ops of one send: a gradient to the previous stage; a hidden state to the next, behind a
        header with its shape where it is the first of its micro-batch key."""
        mb, stage = m.action.unit
        if m.action.op is Op.SEND_B:
            return [dist.P2POp(dist.isend, m.tensor, self.peer_rank(stage - 1), self.group,
                               self._tag(_GRAD, mb, stage - 1))]
        out, dst, ops = m.tensor, self.peer_rank(stage + 1), []
        meta = (tuple(out.shape), _DTYPES.index(out.dtype), m.convention)
        agreed = self.sent.setdefault((stage + 1, key_of(mb)), meta)
        if agreed is meta:  # first of its key: the receiver learns the shape
            header = torch.zeros(HEADER, dtype=torch.int64)
            header[:3] = torch.tensor([out.dim(), meta[1], m.convention])
            header[3 : 3 + out.dim()] = torch.tensor(out.shape)
            ops.append(dist.P2POp(dist.isend, header.to(self.device), dst, self.group,
                                  self._tag(_ACT_HEADER, mb, stage + 1)))
        elif agreed != meta:
            raise PipelineIncompatibleModel(
                f"stage {stage}: micro-batch {mb} produced a hidden state {meta} unlike an earlier micro-batch of "
                f"the same shapes {agreed}; equal micro-batches must give equal shapes, dtypes and output conventions"
            )
        ops.append(dist.P2POp(dist.isend, out.detach(), dst, self.group, self._tag(_ACT, mb, stage + 1)))
        return ops

    def exchange(self, messages: list[Message], key_of: Callable[[int], Hashable] = lambda mb: None) -> None:
        """Post the sends and receives of ``messages`` at once; wait for the receives (also those posted ahead).

        Fills in each receive's ``tensor`` (a hidden state's also its ``convention``) and each send's
        ``works``. A hidden state of ``stage`` goes to stage + 1, a gradient of ``stage``'s input to
        stage - 1. ``key_of(mb)`` describes the micro-batch (its share of the batch and its signature),
        identically on every stage; hidden states of micro-batches with one key have one shape.
        """
        ops: list[dist.P2POp] = []
        sends = _in_order(messages, Op.SEND_F, Op.SEND_B)
        ops_per_send = []
        for m in sends:
            send_ops = self._send_ops(m, key_of)
            ops += send_ops
            ops_per_send.append(len(send_ops))
        n_sends = len(ops)
        waiting: list[dist.Work] = []  # receives this exchange must wait for
        headers: list[tuple[Message, Optional[torch.Tensor]]] = []  # hidden states whose shape comes first
        for m in _in_order(messages, Op.RECV_F, Op.RECV_B):
            mb, stage = m.action.unit
            ahead = self.posted.pop(m.action, None)
            if ahead is not None:
                waiting += ahead.works
                m.tensor = ahead.buffer
                if m.action.op is Op.RECV_F:
                    m.convention = ahead.convention
                continue
            if m.action.op is Op.RECV_B:
                m.tensor = torch.empty(m.like[0], dtype=m.like[1], device=self.device)
                ops.append(self._recv_op(_GRAD, m.tensor, mb, stage))
                continue
            known = self._known_input(mb, stage, key_of)
            if known is None:  # first of its key: the header comes first (once per key)
                header = None
                if (stage, key_of(mb)) not in {(h.action.stage, key_of(h.action.microbatch))
                                               for h, buf in headers if buf is not None}:
                    header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
                    ops.append(self._recv_op(_ACT_HEADER, header, mb, stage))
                headers.append((m, header))
            else:  # shape known: receive the tensor in this same round
                m.tensor, m.convention = known
                ops.append(self._recv_op(_ACT, m.tensor, mb, stage))
        works = _post(ops)
        start = 0
        for m, count in zip(sends, ops_per_send):
            m.works = [w for op_works in works[start : start + count] for w in op_works]
            start += count
        for w in waiting + [w for op_works in works[n_sends:] for w in op_works]:
            w.wait()
        payload_ops = []
        for m, header in headers:
            mb, stage = m.action.unit
            if header is not None:
                ndim, dtype, convention = header[:3].tolist()
                self.received[(stage, key_of(mb))] = (tuple(header[3 : 3 + ndim].tolist()), dtype, convention)
            m.tensor, m.convention = self._known_input(mb, stage, key_of)
            payload_ops.append(self._recv_op(_ACT, m.tensor, mb, stage))
        for op_works in _post(payload_ops):
            for w in op_works:
                w.wait()
