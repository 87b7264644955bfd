"""Point-to-point exchange of hidden states and their gradients between pipeline stages.

The first hidden state of each micro-batch size that a stage receives in a step comes behind a
fixed-size header (ndim, dtype, output convention, shape), so a receiver needs no prior knowledge
of shapes or dtypes (bf16 under autocast, an uneven last micro-batch). Later micro-batches of the
same size reuse it, as Megatron-LM does for fixed shapes, which saves the receiver a round trip per
micro-batch; a sender whose output would not match the header it sent stops with an error. A
gradient has the shape and dtype of the output it belongs to, which the receiver kept. Every message has its own tag, derived from (kind, micro-batch, stage), so
messages match whatever order the two ranks post them in. Each run of consecutive
communication actions is posted as one ``batch_isend_irecv``; sends complete in the background
and receives are waited for, the semantics ``schedules.validate`` proves deadlock-free.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from lightning_parallel.pipeline.errors import PipelineIncompatibleModel

HEADER = 10
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_ACT_HEADER, _ACT, _GRAD = 0, 1, 2


class StageLink:
    """Messages of one rank to and from its neighbouring stages.

    Args:
        peer_rank: global rank of a (virtual) stage.
        num_stages: stages in the pipeline (ranks x virtual stages).
        group: the pipeline process group.
    """

    def __init__(self, peer_rank: Callable[[int], int], num_stages: int, group, device: torch.device):
        self.peer_rank, self.num_stages, self.group, self.device = peer_rank, num_stages, group, device
        # (receiving stage, micro-batch size) -> (shape, dtype index, convention) agreed this step
        self.sent: dict[tuple[int, float], tuple] = {}
        self.received: dict[tuple[int, float], tuple] = {}

    def new_step(self) -> None:
        """Forget the shapes of the last step (each step sends its first headers again)."""
        self.sent.clear()
        self.received.clear()

    def _tag(self, kind: int, microbatch: int, stage: int) -> int:
        return (microbatch * self.num_stages + stage) * 3 + kind

    def exchange(
        self,
        sends_f: list[tuple[int, int, torch.Tensor, int]],
        sends_b: list[tuple[int, int, torch.Tensor]],
        recvs_f: list[tuple[int, int]],
        recvs_b: list[tuple[int, int, torch.Size, torch.dtype]],
        size_of: Callable[[int], float] = lambda mb: 0.0,
    ) -> tuple[dict, dict, list[list[dist.Work]]]:
        """Post sends and receives at once; wait for the receives.

        Returns the received hidden states ``{(mb, stage): (tensor, convention)}``, the received
        gradients ``{(mb, stage): tensor}``, and the works of each send (``sends_f`` then ``sends_b``),
        which keep their tensors alive until waited on.

        ``sends_f`` items are ``(microbatch, stage, output, convention)``: stage's output goes to stage + 1.
        ``sends_b`` items are ``(microbatch, stage, input_grad)``: the gradient goes to stage - 1.
        ``recvs_f`` are ``(microbatch, stage)`` inputs of ``stage``; ``recvs_b`` the output grads of ``stage``.
        ``size_of(mb)`` is the micro-batch's share of the batch, identical on every stage.
        """
        ops: list[dist.P2POp] = []
        send_ops_per_item: list[int] = []
        for mb, stage, out, convention in sends_f:
            dst = self.peer_rank(stage + 1)
            meta = (tuple(out.shape), _DTYPES.index(out.dtype), convention)
            agreed = self.sent.setdefault((stage + 1, size_of(mb)), meta)
            if agreed is meta:  # first of its size this step: the receiver learns the shape
                header = torch.zeros(HEADER, dtype=torch.int64)
                header[:3] = torch.tensor([out.dim(), meta[1], convention])
                header[3 : 3 + out.dim()] = torch.tensor(out.shape)
                ops.append(dist.P2POp(dist.isend, header.to(self.device), dst, self.group, self._tag(_ACT_HEADER, mb, stage + 1)))
            elif agreed != meta:
                raise PipelineIncompatibleModel(
                    f"stage {stage}: micro-batch {mb} produced a hidden state {meta} unlike the earlier micro-batch of "
                    f"the same size {agreed}; equal micro-batches must give equal shapes, dtypes and output conventions"
                )
            ops.append(dist.P2POp(dist.isend, out.detach(), dst, self.group, self._tag(_ACT, mb, stage + 1)))
            send_ops_per_item.append(1 + (agreed is meta))
        for mb, stage, grad in sends_b:
            ops.append(dist.P2POp(dist.isend, grad, self.peer_rank(stage - 1), self.group, self._tag(_GRAD, mb, stage - 1)))
            send_ops_per_item.append(1)
        n_sends = len(ops)
        inputs, headers = {}, []
        for mb, stage in recvs_f:
            known = self.received.get((stage, size_of(mb)))
            if known is None:
                headers.append((mb, stage, torch.empty(HEADER, dtype=torch.int64, device=self.device)))
                ops.append(dist.P2POp(dist.irecv, headers[-1][2], self.peer_rank(stage - 1), self.group,
                                      self._tag(_ACT_HEADER, mb, stage)))
            else:  # shape known: receive the tensor in this same round
                shape, dtype, convention = known
                inputs[(mb, stage)] = (torch.empty(shape, dtype=_DTYPES[dtype], device=self.device), convention)
                ops.append(dist.P2POp(dist.irecv, inputs[(mb, stage)][0], self.peer_rank(stage - 1), self.group,
                                      self._tag(_ACT, mb, stage)))
        grads = {}
        for mb, stage, shape, dtype in recvs_b:
            grads[(mb, stage)] = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, grads[(mb, stage)], self.peer_rank(stage + 1), self.group, self._tag(_GRAD, mb, stage)))
        works = dist.batch_isend_irecv(ops) if ops else []
        send_works, start = [], 0
        for count in send_ops_per_item:
            send_works.append(works[start : start + count])
            start += count
        for w in works[n_sends:]:
            w.wait()
        payload_ops = []
        for mb, stage, header in headers:
            ndim, dtype, convention = header[:3].tolist()
            shape = tuple(header[3 : 3 + ndim].tolist())
            self.received[(stage, size_of(mb))] = (shape, dtype, convention)
            buf = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
            inputs[(mb, stage)] = (buf, convention)
            payload_ops.append(dist.P2POp(dist.irecv, buf, self.peer_rank(stage - 1), self.group, self._tag(_ACT, mb, stage)))
        for w in dist.batch_isend_irecv(payload_ops) if payload_ops else []:
            w.wait()
        return inputs, grads, send_works
