"""What expert parallelism changes in a plan: the experts' parameters each device holds, and the
all-to-all traffic of dispatching tokens to them and combining the results.

Memory: ``ep`` ranks hold different whole experts (``expert_parallel/``), so the routed experts'
parameters, their gradients and optimizer state are divided by ``ep`` on every device; the router,
attention, shared experts and everything else are held whole. Traffic: per MoE layer and micro-batch,
each token's ``k`` hidden states go to their experts' ranks and come back (GShard, arXiv 2006.16668
§2.2), forward and again backward: four all-to-alls of ``k * tokens * h`` elements of which a share
``(ep - 1) / ep`` leaves the device with a uniform routing (what lands on the same rank stays). The
data-parallel all-reduce is still charged over all DP ranks (the experts' part over ``dp / ep`` only:
an upper bound).
"""

from __future__ import annotations

from torch import nn

from lightning_parallel.expert_parallel.placement import (
    expert_count,
    find_experts,
    per_expert_parameter_names,
)


def expert_elements(model: nn.Module, tp_sharded: set[int], tp: int) -> int:
    """Elements of the routed experts' parameters on one device before expert parallelism (TP-sharded
    ones divided by ``tp``). Works on a model built on the meta device."""
    total = 0
    for experts in find_experts(model).values():
        for name in per_expert_parameter_names(experts):
            p = getattr(experts, name)
            total += p.numel() // tp if id(p) in tp_sharded else p.numel()
    return total


def routed_layers(module: nn.Module) -> int:
    """The MoE layers (experts modules taking the routing) inside ``module``."""
    return len(find_experts(module))


def top_k(model: nn.Module) -> int:
    """Experts per token, from a Hugging Face config's ``num_experts_per_tok`` (2 when not given)."""
    config = getattr(model, "config", None) or next(
        (m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "num_experts_per_tok")), None)
    return int(getattr(config, "num_experts_per_tok", 2) or 2)


def divisible_expert_counts(model: nn.Module) -> set[int]:
    """The expert counts of the model's MoE layers (expert parallelism must divide each)."""
    return {expert_count(name, experts) for name, experts in find_experts(model).items()}


def all_to_all_bytes(tokens: int, hidden: int, k: int, layers: float, ep: int, a_bytes: int) -> float:
    """Bytes one device sends per micro-batch: four all-to-alls per MoE layer (dispatch and combine,
    forward and backward), each of ``k * tokens * hidden`` elements, ``(ep - 1) / ep`` of them to others."""
    if ep == 1:
        return 0.0
    return 4 * layers * k * tokens * hidden * a_bytes * (ep - 1) / ep


def held_with_experts(model: nn.Module, stages, tp_sharded: set[int], mesh) -> list[int]:
    """Parameter elements each pipeline rank holds on one device (``estimate.parameters_per_rank``), the
    routed experts' divided by ``mesh``'s expert-parallel size."""
    from lightning_parallel.planner.estimate import parameters_per_rank

    held = parameters_per_rank(model, stages, tp_sharded, mesh.tp_size)
    if mesh.ep_size == 1:
        return held
    experts = expert_elements(model, tp_sharded, mesh.tp_size)
    return [n - experts * (mesh.ep_size - 1) // mesh.ep_size for n in held]


def experts_placed(share, model: nn.Module, assignments: list, mesh):
    """``share`` (``checks.share.planned_share``) with the routed experts' parameters divided by ``mesh``'s
    expert-parallel size."""
    if mesh.ep_size == 1:
        return share
    from dataclasses import replace

    from lightning_parallel.planner.estimate import tp_sharded_parameters

    experts = expert_elements(model, tp_sharded_parameters(assignments), mesh.tp_size)
    return replace(share, largest=share.largest - experts * (mesh.ep_size - 1) // mesh.ep_size)
