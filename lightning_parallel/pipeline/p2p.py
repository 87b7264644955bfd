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
posted as one ``batch_isend_irecv``; sends complete in the background and receives are waited
for, the semantics ``schedules.validate`` proves deadlock-free.

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

from typing import Callable, Hashable

import torch
import torch.distributed as dist

from lightning_parallel.pipeline.errors import PipelineIncompatibleModel

HEADER = 10
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_ACT_HEADER, _ACT, _GRAD = 0, 1, 2


def _post(ops: list[dist.P2POp]) -> list[list[dist.Work]]:
    """Post ``ops`` as one batch; the works that complete each op (all of them if the backend coalesced)."""
    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    if len(works) == len(ops):
        return [[w] for w in works]
    return [list(works)] * len(ops)  # one work for the whole coalesced batch (NCCL)


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
        # (micro-batch, stage) -> (works, buffer, convention) of hidden-state receives posted ahead
        self.posted: dict[tuple[int, int], tuple] = {}

    def new_step(self) -> None:
        """Start a step: nothing may still be posted from the last one."""
        if self.posted:
            raise RuntimeError(f"pipeline receives {sorted(self.posted)} were posted but never used in the last step")

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

    def receive_ahead(self, recvs_f: list[tuple[int, int]], key_of: Callable[[int], Hashable],
                      recvs_b: list[tuple[int, int, torch.Size, torch.dtype]] = ()) -> None:
        """Post now the hidden-state receives of a later exchange whose shapes are known, and the
        gradient receives ``recvs_b`` (as in ``exchange``), if ``post_ahead``."""
        if not self.post_ahead:
            return
        ops, entries = [], []
        for mb, stage in recvs_f:
            known = None if (mb, stage) in self.posted else self._known_input(mb, stage, key_of)
            if known is not None:
                ops.append(self._recv_op(_ACT, known[0], mb, stage))
                entries.append(((mb, stage), *known))
        for mb, stage, shape, dtype in recvs_b:
            if ("grad", mb, stage) not in self.posted:
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                ops.append(self._recv_op(_GRAD, buf, mb, stage))
                entries.append((("grad", mb, stage), buf, None))
        for (key, buf, convention), works in zip(entries, _post(ops)):
            self.posted[key] = (works, buf, convention)

    def exchange(
        self,
        sends_f: list[tuple[int, int, torch.Tensor, int]],
        sends_b: list[tuple[int, int, torch.Tensor]],
        recvs_f: list[tuple[int, int]],
        recvs_b: list[tuple[int, int, torch.Size, torch.dtype]],
        key_of: Callable[[int], Hashable] = lambda mb: None,
    ) -> tuple[dict, dict, list[list[dist.Work]]]:
        """Post sends and receives at once; wait for the receives (also those posted ahead).

        Returns the received hidden states ``{(mb, stage): (tensor, convention)}``, the received
        gradients ``{(mb, stage): tensor}``, and the works of each send (``sends_f`` then ``sends_b``),
        which keep their tensors alive until waited on.

        ``sends_f`` items are ``(microbatch, stage, output, convention)``: stage's output goes to stage + 1.
        ``sends_b`` items are ``(microbatch, stage, input_grad)``: the gradient goes to stage - 1.
        ``recvs_f`` are ``(microbatch, stage)`` inputs of ``stage``; ``recvs_b`` the output grads of ``stage``.
        ``key_of(mb)`` describes the micro-batch (its share of the batch and its signature), identically
        on every stage; hidden states of micro-batches with one key have one shape.
        """
        ops: list[dist.P2POp] = []
        send_ops_per_item: list[int] = []
        for mb, stage, out, convention in sends_f:
            dst = self.peer_rank(stage + 1)
            meta = (tuple(out.shape), _DTYPES.index(out.dtype), convention)
            agreed = self.sent.setdefault((stage + 1, key_of(mb)), meta)
            if agreed is meta:  # first of its key: the receiver learns the shape
                header = torch.zeros(HEADER, dtype=torch.int64)
                header[:3] = torch.tensor([out.dim(), meta[1], convention])
                header[3 : 3 + out.dim()] = torch.tensor(out.shape)
                ops.append(dist.P2POp(dist.isend, header.to(self.device), dst, self.group, self._tag(_ACT_HEADER, mb, stage + 1)))
            elif agreed != meta:
                raise PipelineIncompatibleModel(
                    f"stage {stage}: micro-batch {mb} produced a hidden state {meta} unlike an earlier micro-batch of "
                    f"the same shapes {agreed}; equal micro-batches must give equal shapes, dtypes and output conventions"
                )
            ops.append(dist.P2POp(dist.isend, out.detach(), dst, self.group, self._tag(_ACT, mb, stage + 1)))
            send_ops_per_item.append(1 + (agreed is meta))
        for mb, stage, grad in sends_b:
            ops.append(dist.P2POp(dist.isend, grad, self.peer_rank(stage - 1), self.group, self._tag(_GRAD, mb, stage - 1)))
            send_ops_per_item.append(1)
        n_sends = len(ops)
        waiting: list[dist.Work] = []  # receives this exchange must wait for
        inputs, headers, grads = {}, [], {}
        for mb, stage in recvs_f:
            ahead = self.posted.pop((mb, stage), None)
            if ahead is not None:
                waiting += ahead[0]
                inputs[(mb, stage)] = ahead[1:]
                continue
            known = self._known_input(mb, stage, key_of)
            if known is None:  # first of its key: the header comes first (once per key)
                header = None
                if (stage, key_of(mb)) not in {(s, key_of(m)) for m, s, h in headers if h is not None}:
                    header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
                    ops.append(self._recv_op(_ACT_HEADER, header, mb, stage))
                headers.append((mb, stage, header))
            else:  # shape known: receive the tensor in this same round
                inputs[(mb, stage)] = known
                ops.append(self._recv_op(_ACT, known[0], mb, stage))
        for mb, stage, shape, dtype in recvs_b:
            ahead = self.posted.pop(("grad", mb, stage), None)
            if ahead is not None:
                waiting += ahead[0]
                grads[(mb, stage)] = ahead[1]
                continue
            grads[(mb, stage)] = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(self._recv_op(_GRAD, grads[(mb, stage)], mb, stage))
        works = _post(ops)
        send_works, start = [], 0
        for count in send_ops_per_item:
            send_works.append([w for op_works in works[start : start + count] for w in op_works])
            start += count
        for w in waiting + [w for op_works in works[n_sends:] for w in op_works]:
            w.wait()
        payload_ops = []
        for mb, stage, header in headers:
            if header is not None:
                ndim, dtype, convention = header[:3].tolist()
                self.received[(stage, key_of(mb))] = (tuple(header[3 : 3 + ndim].tolist()), dtype, convention)
            inputs[(mb, stage)] = self._known_input(mb, stage, key_of)
            payload_ops.append(self._recv_op(_ACT, inputs[(mb, stage)][0], mb, stage))
        for op_works in _post(payload_ops):
            for w in op_works:
                w.wait()
        return inputs, grads, send_works
