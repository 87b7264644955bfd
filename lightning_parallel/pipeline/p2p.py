"""Point-to-point exchange of hidden states and their gradients between pipeline stages.

A forward message is a fixed-size header (ndim, dtype, output convention, shape) followed by the
tensor, so a receiver needs no prior knowledge of shapes or dtypes (bf16 under autocast, varying
micro-batch sizes). A gradient has the shape and dtype of the output it belongs to, which the
receiver kept. Every message has its own tag, derived from (kind, micro-batch, stage), so
messages match whatever order the two ranks post them in. Each run of consecutive
communication actions is posted as one ``batch_isend_irecv``; sends complete in the background
and receives are waited for, the semantics ``schedules.validate`` proves deadlock-free.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

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

    def _tag(self, kind: int, microbatch: int, stage: int) -> int:
        return (microbatch * self.num_stages + stage) * 3 + kind

    def exchange(
        self,
        sends_f: list[tuple[int, int, torch.Tensor, int]],
        sends_b: list[tuple[int, int, torch.Tensor]],
        recvs_f: list[tuple[int, int]],
        recvs_b: list[tuple[int, int, torch.Size, torch.dtype]],
    ) -> tuple[dict, dict, list[list[dist.Work]]]:
        """Post sends and receives at once; wait for the receives.

        Returns the received hidden states ``{(mb, stage): (tensor, convention)}``, the received
        gradients ``{(mb, stage): tensor}``, and the works of each send (``sends_f`` then ``sends_b``),
        which keep their tensors alive until waited on.

        ``sends_f`` items are ``(microbatch, stage, output, convention)``: stage's output goes to stage + 1.
        ``sends_b`` items are ``(microbatch, stage, input_grad)``: the gradient goes to stage - 1.
        ``recvs_f`` are ``(microbatch, stage)`` inputs of ``stage``; ``recvs_b`` the output grads of ``stage``.
        """
        ops: list[dist.P2POp] = []
        for mb, stage, out, convention in sends_f:
            dst = self.peer_rank(stage + 1)
            header = torch.zeros(HEADER, dtype=torch.int64)
            header[:3] = torch.tensor([out.dim(), _DTYPES.index(out.dtype), convention])
            header[3 : 3 + out.dim()] = torch.tensor(out.shape)
            ops.append(dist.P2POp(dist.isend, header.to(self.device), dst, self.group, self._tag(_ACT_HEADER, mb, stage + 1)))
            ops.append(dist.P2POp(dist.isend, out.detach(), dst, self.group, self._tag(_ACT, mb, stage + 1)))
        for mb, stage, grad in sends_b:
            ops.append(dist.P2POp(dist.isend, grad, self.peer_rank(stage - 1), self.group, self._tag(_GRAD, mb, stage - 1)))
        n_sends = len(ops)
        headers = []
        for mb, stage in recvs_f:
            headers.append(torch.empty(HEADER, dtype=torch.int64, device=self.device))
            ops.append(dist.P2POp(dist.irecv, headers[-1], self.peer_rank(stage - 1), self.group, self._tag(_ACT_HEADER, mb, stage)))
        grads = {}
        for mb, stage, shape, dtype in recvs_b:
            grads[(mb, stage)] = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, grads[(mb, stage)], self.peer_rank(stage + 1), self.group, self._tag(_GRAD, mb, stage)))
        works = dist.batch_isend_irecv(ops) if ops else []
        send_works = [works[2 * i : 2 * i + 2] for i in range(len(sends_f))]
        send_works += [[w] for w in works[2 * len(sends_f) : n_sends]]
        for w in works[n_sends:]:
            w.wait()
        inputs = {}
        if recvs_f:
            payload_ops = []
            for (mb, stage), header in zip(recvs_f, headers):
                ndim, dtype, convention = header[:3].tolist()
                buf = torch.empty(header[3 : 3 + ndim].tolist(), dtype=_DTYPES[dtype], device=self.device)
                inputs[(mb, stage)] = (buf, convention)
                payload_ops.append(dist.P2POp(dist.irecv, buf, self.peer_rank(stage - 1), self.group, self._tag(_ACT, mb, stage)))
            for w in dist.batch_isend_irecv(payload_ops):
                w.wait()
        return inputs, grads, send_works
