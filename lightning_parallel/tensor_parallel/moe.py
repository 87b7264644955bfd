"""Mixture-of-Experts under tensor parallelism: every expert split Megatron style, the router whole.

Hugging Face (transformers 5) stores all experts of a layer in one module with 3-D parameters:
``gate_up_proj`` ``(experts, 2 * inter, hidden)`` (gate and up halves concatenated, or interleaved
pairwise) and ``down_proj`` ``(experts, hidden, inter)``; ``is_transposed`` experts store the last
two dimensions the other way round. The module is called ``experts(hidden_states, top_k_index,
top_k_weights)`` with the routing decided by a replicated router.

Each expert is an MLP, so it splits like one (Shoeybi et al. 2019, arXiv 1909.08053, §3): every
rank keeps its slice of the intermediate features of *every* expert (each half of ``gate_up_proj``
sliced separately, ``down_proj`` by its input features) and computes a partial output; the
combined output of all experts is all-reduced once (``g``). The routing is identical on every
rank, so an expert that receives no token is skipped on all of them alike and no collective
depends on the routing. In backward the input of the experts goes through ``f`` (its gradient is
the sum of the ranks' partial ones), and so do the routing weights: ``dL/dw_k = <dL/dy, E_k(x)>``
and each rank holds only its part of ``E_k(x)``.

Llama-4's experts are called ``experts(hidden_states)`` with tokens already routed: the router
scales each token by its score and repeats it once per expert, so ``hidden_states`` is
``(experts * tokens, hidden)``, and the parameters are stored for ``x @ W``: ``gate_up_proj``
``(experts, hidden, 2 * inter)``, ``down_proj`` ``(experts, inter, hidden)``, with no attribute
saying so (the shapes tell). They split the same way; the input passes through ``f`` and the
output through ``g`` exactly as for style ``all_reduce``, and the layer's sum over experts then
runs on the reduced output.
"""

from __future__ import annotations

import inspect
from typing import Optional

from torch import nn

from .comm import copy_to_region, reduce_from_region
from .replicated import reduce_partial_output
from .shard import TPShard

EXPERT_INPUTS = ("hidden_states", "top_k_weights")  # the arguments routed through ``f``


def _forward_arguments(experts: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(type(experts).forward).parameters)[1:]
    except (TypeError, ValueError):
        return []


def is_pre_routed(experts: nn.Module) -> bool:
    """Whether ``experts`` takes only the routed tokens (Llama-4), not the routing."""
    return _forward_arguments(experts) == ["hidden_states"]


def _is_transposed(experts: nn.Module) -> bool:
    """Whether the experts compute ``x @ W`` (intermediate features last in ``gate_up_proj``): read
    from ``is_transposed`` where the module has it, from the shapes for pre-routed experts."""
    if hasattr(experts, "is_transposed") or not is_pre_routed(experts):
        return bool(getattr(experts, "is_transposed", False))
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and down.dim() == 3):
        return False  # refused by ``check_experts``
    return gate_up.shape[-1] == 2 * down.shape[-2]  # (experts, hidden, 2 * inter) and (experts, inter, hidden)


def expert_layout(experts: nn.Module) -> dict[str, TPShard]:
    """Parameter name -> how it is split, for a Hugging Face experts module."""
    transposed = _is_transposed(experts)
    packed = 2 if getattr(experts, "is_concatenated", True) else 1  # interleaved pairs stay whole
    inter_out, inter_in = (2, 1) if transposed else (1, 2)  # dims holding the intermediate features
    if getattr(experts, "has_gate", True):
        layout = {"gate_up_proj": TPShard(dim=inter_out, fused=packed)}
    else:
        layout = {"up_proj": TPShard(dim=inter_out)}
    layout["down_proj"] = TPShard(dim=inter_in)
    return layout


def check_experts(name: str, experts: nn.Module, tp: int) -> Optional[str]:
    """Why ``experts`` cannot be split as ``moe_experts`` over ``tp`` ranks, or None."""
    if getattr(experts, "has_bias", False) or getattr(experts, "has_post_expert_norm", False):
        return f"{name}: style 'moe_experts' supports experts without biases and without a norm after each expert"
    arguments = _forward_arguments(experts)
    if not is_pre_routed(experts) and not all(a in arguments for a in EXPERT_INPUTS):
        return (
            f"{name}: style 'moe_experts' needs a forward(hidden_states, top_k_index, top_k_weights), or "
            "forward(hidden_states) taking the routed tokens"
        )
    for param_name, shard in expert_layout(experts).items():
        p = getattr(experts, param_name, None)
        if not isinstance(p, nn.Parameter) or p.dim() != 3:
            return f"{name}: style 'moe_experts' needs a 3-D parameter {param_name!r} holding every expert"
        width = p.shape[shard.dim] // shard.fused
        if width % tp:
            return f"{name}: the experts' intermediate size {width} is not divisible by tensor_parallel={tp}"
    return None


def parallelize_experts(experts: nn.Module, shard, group) -> nn.Module:
    """Split every expert of ``experts`` in place (``shard``: the sharder of ``apply.py``) and add
    ``f`` on its inputs, ``g`` on its output."""
    for param_name, layout in expert_layout(experts).items():
        setattr(experts, param_name, shard(getattr(experts, param_name), layout))
    if is_pre_routed(experts):
        reduce_partial_output(experts, group)
        return experts
    positions = {a: i for i, a in enumerate(_forward_arguments(experts))}

    def enter(mod, args, kwargs):
        args = list(args)
        for a in EXPERT_INPUTS:
            if a in kwargs:
                kwargs[a] = copy_to_region(kwargs[a], group)
            elif positions[a] < len(args):
                args[positions[a]] = copy_to_region(args[positions[a]], group)
        return tuple(args), kwargs

    experts.register_forward_pre_hook(enter, with_kwargs=True)
    experts.register_forward_hook(lambda mod, args, out: reduce_from_region(out, group))
    return experts


def parallelize_identity_expert(module: nn.Module, tp_size: int) -> nn.Module:
    """An identity expert passes its input on unchanged on every rank; the experts' all-reduce then
    sums ``tp_size`` copies, so the input is divided by ``tp_size`` first."""
    module.register_forward_pre_hook(lambda mod, args: (args[0] / tp_size, *args[1:]))
    return module
