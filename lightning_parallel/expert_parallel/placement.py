"""Which experts a rank holds, and which modules of a model are experts: pure, no process needed.

Expert parallelism places whole experts (Switch Transformer, Fedus et al. 2021, arXiv 2101.03961 §2.2;
GShard, arXiv 2006.16668): with ``E`` experts in a layer and ``N`` expert-parallel ranks, rank ``r`` holds
the contiguous run ``r * E/N ... (r+1) * E/N - 1``, so a token's owner is ``expert // (E/N)`` and the
experts' 3-D parameters split along their first dimension.

Hugging Face (transformers 5) keeps all experts of a layer in one module with 3-D parameters
(``gate_up_proj``, or ``up_proj`` without a gate, and ``down_proj``, experts first) and calls it as
``experts(hidden_states, top_k_index, top_k_weights)`` after a replicated router: Mixtral, Qwen2/3-MoE,
DeepSeek-V2/V3 (whose shared experts are a plain MLP beside it, and stay replicated), OLMoE and others.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from lightning_parallel.errors import ConfigurationError, IncompatibleModelError

ROUTED_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


@dataclass(frozen=True)
class ExpertShard:
    """Where a rank's experts sit among a layer's: ``count`` experts from ``first``, of ``total``.

    Carried by each expert parameter as ``param.expert_shard``: the parameter holds rows
    ``first ... first + count - 1`` of the unsplit 3-D tensor (dimension 0).
    """

    first: int
    count: int
    total: int

    @property
    def ids(self) -> range:
        return range(self.first, self.first + self.count)


def owned_experts(num_experts: int, ep_size: int, ep_rank: int) -> ExpertShard:
    """The experts rank ``ep_rank`` of ``ep_size`` holds; refuses an expert count that does not divide."""
    if num_experts % ep_size:
        fitting = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
        raise ConfigurationError(
            f"expert_parallel={ep_size} does not divide the {num_experts} experts of a layer: every rank must hold "
            f"the same number of whole experts. Use expert_parallel in ({', '.join(map(str, fitting))})"
        )
    count = num_experts // ep_size
    return ExpertShard(first=ep_rank * count, count=count, total=num_experts)


def owner_of(expert: int, num_experts: int, ep_size: int) -> int:
    """The expert-parallel rank holding ``expert``."""
    return expert // (num_experts // ep_size)


def _forward_arguments(module: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return []


def expert_parameter_names(experts: nn.Module) -> list[str]:
    """The 3-D parameters holding every expert, experts first."""
    return [n for n, p in experts.named_parameters(recurse=False) if p.dim() == 3]


def per_expert_parameter_names(experts: nn.Module) -> list[str]:
    """Every parameter of ``experts`` indexed by expert first: the 3-D weights and, where the experts
    have them (gpt-oss), their 2-D biases."""
    count = {getattr(experts, n).shape[0] for n in expert_parameter_names(experts)}
    return [n for n, p in experts.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] in count]


def is_routed_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds a layer's experts as 3-D parameters and takes the routing as arguments."""
    return bool(expert_parameter_names(module)) and all(a in _forward_arguments(module) for a in ROUTED_INPUTS)


def expert_count(name: str, experts: nn.Module) -> int:
    """The number of experts ``experts`` holds (the first dimension all its 3-D parameters share)."""
    sizes = {getattr(experts, n).shape[0] for n in expert_parameter_names(experts)}
    if len(sizes) != 1:
        raise IncompatibleModelError(f"{name}: the experts' 3-D parameters disagree on the expert count {sorted(sizes)}")
    return sizes.pop()


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Every experts module of ``model`` by name; refuses experts expert parallelism cannot place."""
    found = {}
    for name, module in model.named_modules():
        if not is_routed_experts(module):
            if _looks_like_experts(module):
                raise IncompatibleModelError(
                    f"{name}: experts called as experts(hidden_states) with tokens already routed (Llama-4 style) "
                    "cannot be placed on ranks by expert parallelism (the routing is not an argument); train it "
                    "with expert_parallel=1, or split its experts with tensor parallelism (moe_experts)")
            continue
        found[name] = module
    return found


def _looks_like_experts(module: nn.Module) -> bool:
    return bool(expert_parameter_names(module)) and _forward_arguments(module) == ["hidden_states"] and any(
        n in ("gate_up_proj", "down_proj") for n in expert_parameter_names(module))
