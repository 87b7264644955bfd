"""An experts module that holds only this rank's whole experts and sends every token to its expert.

``place_experts`` keeps the module a Hugging Face model built (same name, same parameter names, its own
forward for the experts it computes) and changes its class to a subclass whose forward wraps the
original one in GShard's dispatch and combine (Lepikhin et al. 2020, arXiv 2006.16668 §2.2; Megatron-LM's
all-to-all token dispatcher):

1. the router (replicated, run before) gave each token ``k`` experts and weights; the ``tokens x k``
   assignments are sorted by expert, hence by owning rank;
2. the counts per (rank, expert) are exchanged, then each assignment's hidden state is sent to the rank
   holding its expert (``all_to_all``);
3. that rank runs the original forward on what it received, each row with weight 1 for its local
   expert; an expert that received nothing is skipped there, as on one device;
4. the outputs travel back (the reverse all-to-all), are scaled by the routing weights where the
   weights were computed (so their gradient needs no communication), and summed per token.

Every step is differentiable: a token's gradient comes back from its expert's rank, and an expert's
parameters receive the gradients of every rank's tokens. Each rank's loss is the mean over its own
batch, so the experts' gradient summed over the replicas holding them is divided by the whole
data-parallel size (``strategy/experts.py``). The experts' parameters always join the graph (times 0
when no token reaches them), so they get a zero gradient where one device would: the optimizer then
steps them alike (AdamW's decay).

Under tensor parallelism the experts may also be split by their intermediate features
(``moe_experts``): the TP hooks around this module see the whole exchange as the experts' compute, each
TP rank exchanges with the EP ranks of its own TP coordinate, and the partial outputs are summed by the
TP all-reduce after the combine, as one device's sum over experts would be.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_parallel.expert_parallel.comm import all_to_all, exchange_counts
from lightning_parallel.expert_parallel.placement import (
    ExpertShard,
    per_expert_parameter_names,
)


class ExpertParallelMixin:
    """The dispatch/compute/combine forward, mixed in before a Hugging Face experts class."""

    expert_shard: ExpertShard
    ep_group: Any
    ep_size: int
    tokens_per_expert: Optional[torch.Tensor]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        shard, ep = self.expert_shard, self.ep_size
        k = top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)  # (tokens * k,) global expert ids
        # by expert, hence by owning rank; an id past the last expert (a dropped assignment, which the
        # Hugging Face loops skip) sorts last and is not sent
        order = torch.argsort(experts, stable=True)
        per_expert = torch.bincount(experts.clamp(max=shard.total), minlength=shard.total + 1)[: shard.total]
        self.tokens_per_expert = per_expert.detach()
        send_counts = per_expert.view(ep, shard.count)
        recv_counts = exchange_counts(send_counts, self.ep_group)
        both = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # the layer's one host read
        send, recv = both[0], both[1]
        order = order[: sum(send)]
        token_of = order // k
        received = all_to_all(hidden_states[token_of], send, recv, self.ep_group)  # (received, hidden)
        local_ids = torch.arange(shard.count, device=experts.device).repeat(ep)
        local_index = local_ids.repeat_interleave(recv_counts.reshape(-1)).unsqueeze(1)
        ones = torch.ones(local_index.shape, dtype=top_k_weights.dtype, device=top_k_weights.device)
        computed = super().forward(received, local_index, ones)  # type: ignore[misc]
        computed = computed + self._touch(received)
        returned = all_to_all(computed, recv, send, self.ep_group)  # (tokens * k, hidden), in ``order``
        weights = top_k_weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token_of, (returned * weights).to(out.dtype))

    def _touch(self, received: torch.Tensor) -> torch.Tensor:
        """0, depending on one element of every expert parameter and on what was received: the parameters'
        gradient exists (zero where no token went) on every rank, as on one device, and the dispatch's
        backward all-to-all runs on every rank even where no token arrived (else the others would wait)."""
        anchors = [getattr(self, n).reshape(-1)[0] for n in per_expert_parameter_names(self)]
        return (sum(anchors) + received[:1].sum()) * 0.0


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def place_experts(experts: nn.Module, shard: ExpertShard, group: Any, ep_size: int) -> nn.Module:
    """Keep ``shard``'s experts of ``experts`` (in place) and route its tokens over ``group``.

    Each per-expert parameter is replaced by its rows ``shard.ids`` (a new, smaller parameter carrying
    ``expert_shard`` and any attribute the old one carried, e.g. a TP split); an ``num_experts``
    attribute becomes the local count, which the original forward sizes its masks by.
    """
    for name in per_expert_parameter_names(experts):
        old = getattr(experts, name)
        new = nn.Parameter(old.detach()[shard.first : shard.first + shard.count].clone(),
                           requires_grad=old.requires_grad)
        for attribute, value in vars(old).items():
            setattr(new, attribute, value)
        new.expert_shard = shard
        setattr(experts, name, new)
    if getattr(experts, "num_experts", None) == shard.total:
        experts.num_experts = shard.count
    experts.__class__ = _expert_parallel_class(type(experts))
    experts.expert_shard, experts.ep_group, experts.ep_size = shard, group, ep_size
    experts.tokens_per_expert = None
    return experts
