"""A step that generates, run on every pipeline rank with the model's forwards passing through the stages.

``model.generate(...)`` calls the model's forward once per new token, inside one call of the user's
step, and picks each token from the logits of the one before. Under pipelining that step runs once on
every rank of the pipeline, on the whole batch (no micro-batches: a decoding loop has one forward in
flight at a time), and each forward is run by all ranks together:

* each block runs on the rank that owns it; where the owner changes, the hidden state is sent from
  the rank that ran the block before to the one that runs the next (``relay_route``), so a forward
  passes through the stages in order;
* a rank's own blocks update its key/value cache; the other ranks' blocks add placeholder entries of
  the same length, so the cache's length, which gives positions and masks, is right on every rank
  (``kv_cache``);
* the outputs of the modules after the blocks (final norm, head) are broadcast from the last stage's
  rank, so every rank's decoding loop sees the same logits and picks the same token; those of the
  modules before the blocks (embeddings) reach the other ranks as zeros of their shape and dtype, as
  in a pipelined step;
* the random number generators of the pipeline's ranks start each such step in the last stage's
  state, so sampled tokens agree as well (seeding inside the step, ``torch.manual_seed``, works too).

Every rank thus returns one device's tokens, and a plain forward in the same step (a loss, logits) gives
one device's values on every rank. The pipelined schedule of ``engine`` is not used: its stages stop at
their boundary after one forward, which a loop of forwards cannot.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.pipeline.broadcast import broadcast_object
from lightning_parallel.pipeline.kv_cache import keep_length
from lightning_parallel.pipeline.partition import StagePlan
from lightning_parallel.pipeline.relay_route import block_routes, post_holder
from lightning_parallel.pipeline.stage_modules import TENSOR, _hidden_of, _split_input, wrap

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 8


class Relay:
    """One pipeline rank's part in relayed forwards (see the module docstring).

    Args:
        plan: the stages; ``mesh``: this rank's place in the pipeline; ``device``: where the stage computes.
    """

    def __init__(self, plan: StagePlan, mesh: ParallelMesh, device: torch.device):
        self.routes = block_routes(plan, mesh.pp_rank)
        self.holder = post_holder(plan)
        self.is_holder = mesh.pp_rank == self.holder
        self.mesh, self.device = mesh, device
        self.received: Optional[torch.Tensor] = None
        self.convention = TENSOR

    # ---- around a step -----------------------------------------------------------------------
    def agree_on_randomness(self) -> None:
        """Give every rank of the pipeline the last stage's generator states (CPU, and the stage's CUDA device)."""
        cuda = self.device.type == "cuda"
        states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(self.device)] if cuda else [])
        src = self.mesh.stage_rank(self.holder)
        for n, state in enumerate(states):
            buffer = state.to(self.device)
            dist.broadcast(buffer, src=src, group=self.mesh.pp_group)
            if n == 0:
                torch.set_rng_state(buffer.cpu())
            else:
                torch.cuda.set_rng_state(buffer.cpu(), self.device)

    def end(self) -> None:
        self.received = None

    # ---- a block's call ---------------------------------------------------------------------
    def block(self, index: int, forward: Optional[Callable], cache_index: int, args: tuple, kwargs: dict) -> Any:
        """Block ``index``'s call: run it (``forward``, this rank's), or stand in for another rank's."""
        route = self.routes[index]
        hidden, rest_args, rest_kwargs = _split_input(args, kwargs)
        if route.send_to is not None:
            self._send(hidden, route.send_to)
        if route.owned:
            if self.received is not None:  # the first of a run of this rank's blocks
                hidden, self.received = self.received, None
            if args:
                out = forward(hidden, *rest_args, **rest_kwargs)
            else:
                out = forward(*rest_args, **dict(rest_kwargs, hidden_states=hidden))
            _, self.convention = _hidden_of(out)
            return out
        keep_length(args, kwargs, hidden, cache_index)
        if route.receive_from is not None:
            self.received, self.convention = self._receive(route.receive_from)
        return wrap(self.received if route.hands_over else hidden, self.convention)

    def _send(self, hidden: torch.Tensor, rank: int) -> None:
        if hidden.dtype not in _DTYPES or hidden.dim() > _MAX_DIMS:
            raise RuntimeError(f"a hidden state of dtype {hidden.dtype} and {hidden.dim()} dimensions cannot cross "
                               f"pipeline stages (floating point, at most {_MAX_DIMS} dimensions)")
        header = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64)
        header[:3] = torch.tensor([_DTYPES.index(hidden.dtype), self.convention, hidden.dim()])
        header[3:3 + hidden.dim()] = torch.tensor(hidden.shape, dtype=torch.int64)
        dst = self.mesh.stage_rank(rank)
        dist.send(header.to(self.device), dst=dst, group=self.mesh.pp_group)
        dist.send(hidden.detach().contiguous(), dst=dst, group=self.mesh.pp_group)

    def _receive(self, rank: int) -> tuple[torch.Tensor, int]:
        src = self.mesh.stage_rank(rank)
        header = torch.empty(3 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        dist.recv(header, src=src, group=self.mesh.pp_group)
        dtype, convention, dims, *shape = header.tolist()
        hidden = torch.empty(shape[:dims], dtype=_DTYPES[dtype], device=self.device)
        dist.recv(hidden, src=src, group=self.mesh.pp_group)
        return hidden, convention

    # ---- the modules before and after the blocks -------------------------------------------------
    def share(self, rank: int, values: bool) -> Callable:
        """A forward hook for a module before or after the blocks, run by pipeline rank ``rank`` (the first
        or the last stage's; the stand-ins elsewhere return None). Its output on every rank of the pipeline:
        with ``values``, as ``rank`` computed it (the head's logits); else zeros of its structure, shapes and
        dtypes, as in a pipelined step (an embedding's output: the other ranks' blocks before their own
        pass it through, and a caller that keeps its own copy of the hidden state adds zeros to the received
        state, see ``stage_modules``)."""
        return lambda module, args, output: self._share(output, rank, values)

    def _share(self, output: Any, rank: int, values: bool) -> Any:
        src, is_src = self.mesh.stage_rank(rank), self.mesh.pp_rank == rank
        leaves, spec = tree_flatten(output)
        described = None
        if is_src:  # the structure, each tensor's shape and dtype, every other value
            described = spec, [(True, leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else (False, leaf, None)
                               for leaf in leaves]
        spec, described = broadcast_object(described, src, self.mesh.pp_group, self.device, is_src)
        if is_src and not values:
            return output
        shared = []
        for n, (is_tensor, value, dtype) in enumerate(described):
            if not is_tensor:
                shared.append(value)
            elif not values:
                shared.append(torch.zeros(value, dtype=dtype, device=self.device))
            else:
                buffer = (leaves[n].detach().contiguous() if is_src
                          else torch.empty(value, dtype=dtype, device=self.device))
                dist.broadcast(buffer, src=src, group=self.mesh.pp_group)
                shared.append(buffer)
        return output if is_src else tree_unflatten(shared, spec)
