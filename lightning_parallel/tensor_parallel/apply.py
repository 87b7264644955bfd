"""Shard a model in place according to resolved plan assignments (no collectives).

The full weights are already identical on every TP rank (the strategy broadcasts them from rank
0), so each shard is a slice of the existing parameter: TP initialisation equals the
single-device one. Parameters shared by two modules (a tied embedding and output head, both split
by vocabulary rows) are sliced once and stay shared. Modules left whole that see split
activations get their gradients summed over TP (``replicated.py``); Mixture-of-Experts modules
are split by ``moe.py``. A ``local_params``/``all_reduce`` module keeps its forward: its own listed
parameters are replaced by their slices.
"""

from __future__ import annotations

from types import MethodType
from typing import Optional

from torch import nn

from .attention import (
    FusedAttentionParts,
    ParallelMultiheadAttention,
    tp_causal_attention_forward,
)
from .attributes import divide_attribute
from .comm import SEQ_DIM, scatter_to_region
from .kv_heads import attention_of, localise_groups
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .moe import parallelize_experts, parallelize_identity_expert
from .random import ShardedDropout, TPRandom, split_region_random
from .replicated import reduce_partial_output, split_rope_grad_sum, sum_grads_over_tp
from .resolve import Assignment, embed_scale, is_conv1d, linear_features, mla_rope_dim
from .shapes import find_fused_attention
from .shard import TPShard, slice_shard


class _Sharder:
    """Slices parameters for one TP rank, once per parameter (ties survive)."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.done: dict[int, nn.Parameter] = {}

    def __call__(self, param: Optional[nn.Parameter], shard: TPShard) -> Optional[nn.Parameter]:
        if param is None:
            return None
        if id(param) in self.done:
            return self.done[id(param)]
        dim = shard.dim % param.dim()
        if shard.fused == 1 and param.shape[dim] % shard.parts(self.mesh.tp_size):
            shard = TPShard(dim=shard.dim, full_size=param.shape[dim])  # pad, remember the true size
        new = nn.Parameter(
            slice_shard(param.detach(), shard, self.mesh.tp_rank, self.mesh.tp_size), requires_grad=param.requires_grad
        )
        new.tp_shard = shard
        self.done[id(param)] = new
        return new


def _colwise(m: nn.Module, shard: _Sharder, fused: int, gather_output: bool, sp: bool,
             copies: int = 1) -> ColumnParallelLinear:
    t = is_conv1d(m)  # weight (in, out): the output features are dim 1
    in_features, out_features = linear_features(m)
    weight = shard(m.weight, TPShard(dim=1 if t else 0, fused=fused, replicas=copies))
    bias = shard(m.bias, TPShard(dim=0, fused=fused, replicas=copies))
    return ColumnParallelLinear(weight, bias, shard.mesh.tp_group, out_features, gather_output, sp, t, copies)


def _rowwise(m: nn.Module, shard: _Sharder, sp: bool, fused: int = 1, split_input: bool = False) -> RowParallelLinear:
    t = is_conv1d(m)
    weight = shard(m.weight, TPShard(dim=0 if t else 1, fused=fused))
    return RowParallelLinear(weight, m.bias, shard.mesh.tp_group, linear_features(m)[0], sp, t, split_input, fused)


def _vocab(m: nn.Embedding, shard: _Sharder, sp: bool) -> VocabParallelEmbedding:
    scale = None if type(m).forward is nn.Embedding.forward else embed_scale(m)
    buffer = m._buffers.get("embed_scale")  # Gemma: a tensor cast to the weight's dtype; BioGPT: a Python float
    return VocabParallelEmbedding(
        shard(m.weight, TPShard(dim=0)),
        shard.mesh.tp_group,
        shard.mesh.tp_rank,
        m.num_embeddings,
        m.padding_idx,
        sp,
        buffer.detach().clone() if scale is not None and buffer is not None else scale,
    )


def _multihead(m: nn.MultiheadAttention, shard: _Sharder, rng: TPRandom, sp: bool) -> ParallelMultiheadAttention:
    qkv = TPShard(dim=0, fused=3)
    out = RowParallelLinear(
        shard(m.out_proj.weight, TPShard(dim=1)), m.out_proj.bias, shard.mesh.tp_group, m.embed_dim, sp
    )
    return ParallelMultiheadAttention(
        shard(m.in_proj_weight, qkv),
        shard(m.in_proj_bias, qkv),
        out,
        m.num_heads,
        m.dropout,
        m.batch_first,
        shard.mesh.tp_group,
        shard.mesh.tp_rank,
        rng,
        sp,
    )


def _fused_attention(m: nn.Module, shard: _Sharder, rng: TPRandom, sp: bool) -> nn.Module:
    """Shard a nanoGPT-shaped attention's projections and bind the TP-aware forward to it."""
    parts = find_fused_attention(m)
    setattr(m, parts.qkv, _colwise(getattr(m, parts.qkv), shard, 3, False, sp))
    setattr(m, parts.out, _rowwise(getattr(m, parts.out), shard, sp))
    local_heads = parts.heads // shard.mesh.tp_size
    m.tp_attention = FusedAttentionParts(parts.qkv, parts.out, local_heads, parts.dropout, parts.resid_dropout, rng)
    m.forward = MethodType(tp_causal_attention_forward, m)
    return m


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def apply_plan(
    root: nn.Module, assignments: list[Assignment], mesh, sequence_parallel: bool, rng: TPRandom
) -> list[Assignment]:
    """Shard every assigned module; returns the assignments with ``module`` set to the new module."""
    shard = _Sharder(mesh)
    sp = sequence_parallel
    entry_modules: list[nn.Module] = []
    grads_summed: list[nn.Module] = []  # replicated modules whose gradients autograd already sums over TP
    localised: set[int] = set()  # attentions whose KV group size was set for copied KV heads
    for a in assignments:
        m, style = a.module, a.entry.style
        for attr in a.entry.divide:
            divide_attribute(m, attr, mesh.tp_size)
        if style == "colwise":
            copies = a.entry.copies(mesh.tp_size)
            new = _colwise(m, shard, a.entry.fused, a.entry.gather_output, sp, copies)
            holder = root.get_submodule(attention_of(a.name))  # a LoRA layer's parts: the attention around it
            if copies > 1 and id(holder) not in localised:  # the attention sees one local KV head
                localise_groups(holder, copies, mesh.tp_size)
                localised.add(id(holder))
        elif style == "rowwise":
            new = _rowwise(m, shard, sp, a.entry.fused, a.entry.split_input)
        elif style == "replicated_grad_sum":
            new = m
            sum_grads_over_tp(m, mesh.tp_group)
            grads_summed.append(m)
        elif style == "mla_kv_a_proj":
            new = m
            split_rope_grad_sum(m, mla_rope_dim(root, a.name), mesh.tp_group)
            grads_summed.append(m)
        elif style in ("local_params", "all_reduce"):
            new = m
            for param_name, dim in a.entry.params:
                if m._parameters.get(param_name) is not None:
                    m._parameters[param_name] = shard(m._parameters[param_name], TPShard(dim=dim))
            if style == "all_reduce":
                reduce_partial_output(m, mesh.tp_group)
        elif style == "moe_experts":
            new = parallelize_experts(m, shard, mesh.tp_group)
        elif style == "moe_identity_expert":
            new = parallelize_identity_expert(m, mesh.tp_size)
        elif style == "vocab":
            new = _vocab(m, shard, sp)
        elif style == "attention" and isinstance(m, nn.MultiheadAttention):
            new = _multihead(m, shard, rng, sp)
        elif style == "attention":
            new = _fused_attention(m, shard, rng, sp)
        else:
            new = m
            if style == "sequence_scatter" and sp:
                group = mesh.tp_group
                m.register_forward_hook(lambda _m, _i, out: scatter_to_region(out, group, dim=SEQ_DIM))
                entry_modules.append(m)
        if new is not m:
            _replace(root, a.name, new)
        a.module = new
    _random_in_split_regions(root, assignments, rng)
    if sp:
        _mark_sequence_parallel(root, entry_modules + grads_summed, rng)
    return assignments


def _random_in_split_regions(root: nn.Module, assignments: list[Assignment], rng: TPRandom) -> None:
    """Per-rank random stream between sibling colwise and rowwise layers whose activations stay split."""
    regions: dict[str, tuple[list, list]] = {}
    for a in assignments:
        if a.entry.style in ("colwise", "rowwise") and not a.entry.gather_output and not a.entry.split_input:
            colwise, rowwise = regions.setdefault(a.name.rpartition(".")[0], ([], []))
            (colwise if a.entry.style == "colwise" else rowwise).append(a.module)
    for parent, (colwise, rowwise) in regions.items():
        if colwise and rowwise:
            split_region_random(root.get_submodule(parent) if parent else root, colwise, rowwise, rng)


def _mark_sequence_parallel(root: nn.Module, entry_modules: list[nn.Module], rng: TPRandom) -> None:
    """Under sequence parallelism every replicated parameter sees only this rank's tokens, so its
    gradient is partial (summed over TP by ``sync_sequence_parallel_grads``); the modules whose
    replicated output enters the region get full gradients through the scatter's all-gather.
    Dropout there acts on sequence shards, so it draws from the per-rank stream. ``entry_modules``
    are those whose gradients need no sum (or are summed already)."""
    skip = {id(p) for m in entry_modules for p in m.parameters()}
    for p in root.parameters():
        if not hasattr(p, "tp_shard") and id(p) not in skip:
            p.sequence_parallel = True
    for name, m in list(root.named_modules()):
        if type(m) is nn.Dropout:
            _replace(root, name, ShardedDropout(m.p, m.inplace, rng))
