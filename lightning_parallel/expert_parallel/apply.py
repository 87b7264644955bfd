"""Expert parallelism applied to a whole model: every experts module placed, its parameters listed.

The strategy calls ``parallelize_experts`` after the model's values agree on every rank (and after a
tensor-parallel split), before the optimizer is built. It returns an ``ExpertParallel`` that names the
expert parameters (their gradients are averaged over the replicas holding the same experts, not over all
data-parallel ranks: Megatron-LM's "expert data parallel" group) and counts the tokens each expert
received in the last step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_parallel.errors import IncompatibleModelError
from lightning_parallel.expert_parallel.layer import place_experts
from lightning_parallel.expert_parallel.placement import (
    expert_count,
    find_experts,
    owned_experts,
)


class ExpertParallel:
    """The placed experts of one model.

    Args:
        layers: experts module name -> the module, placed (``layer.place_experts``).
    """

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        self.layers = layers

    def parameters(self) -> list[nn.Parameter]:
        """The expert parameters: each rank holds different ones."""
        return [p for layer in self.layers.values() for p in layer.parameters(recurse=False)
                if hasattr(p, "expert_shard")]

    def tokens_per_expert(self) -> dict[str, torch.Tensor]:
        """Layer name -> assignments routed to each of its experts in the last forward (this rank's tokens,
        all experts, global ids), for the layers that ran."""
        return {name: layer.tokens_per_expert for name, layer in self.layers.items()
                if layer.tokens_per_expert is not None}


def parallelize_experts(model: nn.Module, ep_group: Any, ep_size: int, ep_rank: int) -> ExpertParallel:
    """Place the experts of every MoE layer of ``model`` over ``ep_group`` (this rank is ``ep_rank`` of
    ``ep_size``). Refuses a model without routed experts, and an expert count ``ep_size`` does not divide."""
    found = find_experts(model)
    if not found:
        raise IncompatibleModelError(
            f"expert_parallel={ep_size}, but the model has no Mixture-of-Experts layer whose experts are one module "
            "with 3-D parameters called as experts(hidden_states, top_k_index, top_k_weights) (Hugging Face "
            "Mixtral, Qwen-MoE, DeepSeek-V3, OLMoE ...); train it with expert_parallel=1")
    layers = {}
    for name, experts in found.items():
        shard = owned_experts(expert_count(name, experts), ep_size, ep_rank)
        layers[name] = place_experts(experts, shard, ep_group, ep_size)
    return ExpertParallel(layers)
