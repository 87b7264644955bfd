"""Replicated modules inside a tensor-parallel region: whose gradients need a sum over TP, and why.

A module left whole on every TP rank gets the full gradient when its input is the same on every
rank (a LayerNorm on the residual stream): nothing to do, and summing would multiply it by the TP
size. It gets a *partial* gradient when its input, or the use of its output, is split across
ranks: then the full gradient is the sum over TP (Megatron-LM does the same for the replicated
parameters of sequence-parallel regions, Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2):

* ``replicated_grad_sum``: a per-head norm (Qwen3's ``q_norm``/``k_norm``) applied after a colwise
  ``q_proj``/``k_proj``: each rank normalises only its own heads with the shared weight. The weight
  is routed through the ``f`` operator (identity forward, all-reduce backward) for the duration
  of the module's forward, so the sum happens inside autograd, once per backward, and also
  when activation checkpointing recomputes the forward.
* ``mla_kv_a_proj``: multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, §2.1) projects
  ``x`` to ``[c_kv, k_rope]``; ``c_kv`` goes through the colwise ``kv_b_proj`` (whose ``f`` sums its
  gradient) but ``k_rope`` is shared by all heads and meets only this rank's heads, so the ``f``
  operator is applied to that slice of the output.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .comm import copy_to_region, reduce_from_region


def sum_grads_over_tp(module: nn.Module, group) -> None:
    """Route the parameters of ``module`` (and of its submodules) through ``f`` while each runs
    forward (see the module docstring)."""
    for sub in module.modules():
        names = [n for n, p in sub.named_parameters(recurse=False) if p.requires_grad]
        if names:
            _route_through_f(sub, names, group)


def _route_through_f(module: nn.Module, names: list[str], group) -> None:
    saved: dict[str, nn.Parameter] = {}

    def enter(mod, args):
        for n in names:
            saved[n] = mod._parameters[n]
            mod._parameters[n] = copy_to_region(saved[n], group)  # a non-leaf view for this forward only

    def leave(mod, args, output):
        for n in names:
            mod._parameters[n] = saved.pop(n)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def split_rope_grad_sum(module: nn.Linear, rope_dim: int, group) -> None:
    """Sum over TP the gradient of the last ``rope_dim`` output features of ``kv_a_proj_with_mqa``."""

    def hook(mod, args, output: torch.Tensor) -> torch.Tensor:
        latent, rope = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([latent, copy_to_region(rope, group)], dim=-1)

    module.register_forward_hook(hook)


def reduce_partial_output(module: nn.Module, group) -> None:
    """Style ``all_reduce``: ``module`` computes its partial output from sliced weights, so its
    tensor inputs pass through ``f`` (their gradients are the sum of every rank's partial ones) and
    its output through ``g`` (all-reduce), as around Megatron's split MLP (Shoeybi et al. 2019,
    arXiv 1909.08053, §3)."""

    def enter(mod, args, kwargs):
        f = lambda x: copy_to_region(x, group) if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
        return tuple(map(f, args)), {k: f(v) for k, v in kwargs.items()}

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(lambda mod, args, output: reduce_from_region(output, group))


ACTIVATION_NAMES = ("act_fn", "act", "activation", "activation_fn")


def _split_region_verdict(parent: nn.Module, child_name: str, child: nn.Module, width: int) -> Optional[str]:
    """For a module beside a colwise and a rowwise Linear: ``"sum"`` when its parameters are
    replicated but see split activations, None when they see the replicated residual stream,
    ``"refuse"`` when its shapes do not tell."""
    params = [p for p in child.parameters() if p.requires_grad]
    if child_name in ACTIVATION_NAMES and all(p.numel() == 1 for p in params):
        return "sum"  # a scalar activation parameter (Apertus' xIELU) applied to the split features
    head_dim = getattr(parent, "head_dim", None)
    if isinstance(head_dim, int) and head_dim != width and all(p.shape == (head_dim,) for p in params):
        return "sum"  # one weight shared by every head (a q/k norm) applied to this rank's heads
    if all(p.shape == (width,) for p in params):
        return None  # a norm of the residual stream (nn.TransformerEncoderLayer's norm1)
    return "refuse"


def modules_in_split_region(root: nn.Module, styles: dict[str, str]) -> list[tuple[str, str]]:
    """(name, ``"sum"`` or ``"refuse"``) for each unplanned module with trainable parameters that
    sits beside a colwise and a rowwise Linear whose activations stay split (``styles``: module
    name -> style, ``colwise``/``rowwise`` only for those). A parent that also holds an unplanned
    Linear (multi-head latent attention's replicated ``q_a_proj``) runs part of its code on
    replicated activations, so its other modules cannot be placed: left to the plan."""
    found = []
    for parent_name, parent in root.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        children = {prefix + n: c for n, c in parent.named_children()}
        rowwise = [c for n, c in children.items() if styles.get(n) == "rowwise"]
        if not rowwise or "colwise" not in {styles.get(n) for n in children}:
            continue
        if any(isinstance(c, nn.Linear) and n not in styles for n, c in children.items()):
            continue
        width = getattr(rowwise[0], "out_features", getattr(rowwise[0], "nf", None))  # Linear, or HF Conv1D
        for name, child in children.items():
            planned = name in styles or any(n.startswith(name + ".") for n in styles)
            if planned or isinstance(child, nn.Embedding) or not any(p.requires_grad for p in child.parameters()):
                continue  # an embedding looks up token ids: it never sees the split activations
            verdict = _split_region_verdict(parent, name.rpartition(".")[2], child, width)
            if verdict is not None:
                found.append((name, verdict))
    return found
