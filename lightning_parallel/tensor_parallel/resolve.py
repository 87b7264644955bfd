"""Match a plan's globs to modules and check every size before anything is sharded.

Pure: the checks read only module shapes, configs and the TP size, so every rank raises the
same ``TensorParallelError`` before any collective could hang. Each message names the module and
the TP sizes that would work.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

from torch import nn

from lightning_parallel.compat import packed_in_projection

from .attributes import read_attribute
from .kv_heads import check_kv_split, kv_head_counts, mark_kv_projections
from .lora import route_lora
from .moe import check_experts
from .names import block_glob, did_you_mean, glob_matches
from .plan import Plan, PlanEntry, TensorParallelError
from .replicated import modules_in_split_region
from .shapes import FusedAttention, computes_linear, find_fused_attention


@dataclass
class Assignment:
    """One module and the plan entry (and glob) that applies to it."""

    name: str
    module: nn.Module
    entry: PlanEntry
    glob: str


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a Linear whose weight is stored ``(in, out)``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def linear_features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return module.weight.shape[0], module.nf
    return module.in_features, module.out_features


def embed_scale(module: nn.Embedding):
    """The factor an ``nn.Embedding`` subclass multiplies its lookup by (``embed_scale``, as in
    Gemma's scaled word embedding), 1 for a plain embedding, None for any other own forward."""
    if type(module).forward is nn.Embedding.forward:
        return 1.0
    scale = getattr(module, "scalar_embed_scale", getattr(module, "embed_scale", None))  # a float before a buffer
    try:
        source = inspect.getsource(type(module).forward).replace(" ", "")
    except (OSError, TypeError):
        return None
    if scale is not None and "returnsuper().forward(input_ids)*self.embed_scale" in source:
        return scale
    return None


def mla_rope_dim(root: nn.Module, name: str) -> Optional[int]:
    """The rotary key width after ``kv_a_proj_with_mqa``: ``qk_rope_head_dim`` of the attention
    holding it (or of that attention's config)."""
    parent = root.get_submodule(name.rpartition(".")[0])
    for holder in (parent, getattr(parent, "config", None)):
        value = getattr(holder, "qk_rope_head_dim", None)
        if isinstance(value, int):
            return value
    return None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _require_divisible(what: str, size: int, tp: int, name: str) -> None:
    if size % tp:
        raise TensorParallelError(
            f"{name}: {what} = {size} is not divisible by tensor_parallel={tp}; "
            f"tensor_parallel sizes that divide it: {divisors(size)}"
        )


def _check_attention(name: str, module: nn.Module, tp: int, sequence_parallel: bool) -> None:
    if isinstance(module, nn.MultiheadAttention):
        if not packed_in_projection(module) or module.bias_k is not None or module.add_zero_attn:
            raise TensorParallelError(
                f"{name}: style 'attention' supports nn.MultiheadAttention with kdim = vdim = embed_dim, "
                "no add_bias_kv and no add_zero_attn"
            )
        if sequence_parallel and not module.batch_first:
            raise TensorParallelError(f"{name}: sequence_parallel needs batch_first=True attention (batch, seq, dim)")
        _require_divisible("num_heads", module.num_heads, tp, name)
        return
    parts: FusedAttention | None = find_fused_attention(module)
    if parts is None:
        raise TensorParallelError(
            f"{name} ({type(module).__name__}): style 'attention' needs nn.MultiheadAttention or a causal "
            "attention (is_causal=True or a tril mask in its forward) with a fused Linear(d, 3d), a Linear(d, d) "
            "and a head count (n_head / num_heads / head_dim); shard its Linears with colwise/rowwise instead"
        )
    _require_divisible("number of heads", parts.heads, tp, name)


NO_SEQUENCE_PARALLEL = ("replicated_grad_sum", "moe_experts", "moe_identity_expert", "mla_kv_a_proj", "all_reduce")


def _check_owned_params(a: Assignment, tp: int) -> None:
    """``local_params`` / ``all_reduce``: each listed parameter the module owns splits evenly; an
    ``all_reduce`` module owns no other trainable parameter, since a replicated one would enter
    the summed output once per rank."""
    m, name = a.module, a.name
    for param_name, dim in a.entry.params:
        p = m._parameters.get(param_name)
        if p is not None:
            if not -p.dim() <= dim < p.dim():
                raise TensorParallelError(f"{name}.{param_name} has {p.dim()} dimensions, no dim {dim} to split")
            _require_divisible(f"{param_name}.shape[{dim}]", p.shape[dim], tp, name)
    if a.entry.style != "all_reduce":
        return
    listed = {n for n, _ in a.entry.params if m._parameters.get(n) is not None}
    others = [n for n, p in m.named_parameters() if p.requires_grad and n not in listed]
    if not listed or others:
        raise TensorParallelError(
            f"{name}: style 'all_reduce' sums the outputs of every rank, so every trainable parameter of the "
            f"module must be split in its params (left whole: {others or 'all of them'}); give params "
            "{name: dim} for each, or leave the module replicated (drop its entry)"
        )


def _check(a: Assignment, tp: int, sequence_parallel: bool, vocab_paddable: set[int]) -> None:
    m, e, name = a.module, a.entry, a.name
    for attr in e.divide:
        value = read_attribute(m, attr)
        if not isinstance(value, int):
            raise TensorParallelError(f"{name}: divide names {attr!r}, which is not an integer attribute of the module")
        _require_divisible(attr, value, tp, name)
    if e.style in ("colwise", "rowwise") and not computes_linear(m) and not is_conv1d(m):
        raise TensorParallelError(
            f"{name} is {type(m).__name__}: style {e.style!r} fits nn.Linear (or a subclass computing the same, "
            "or Hugging Face Conv1D) only"
        )
    if e.style == "vocab" and not isinstance(m, nn.Embedding):
        raise TensorParallelError(f"{name} is {type(m).__name__}: style 'vocab' fits nn.Embedding only")
    if e.style == "vocab" and embed_scale(m) is None:
        raise TensorParallelError(
            f"{name} is {type(m).__name__}, an nn.Embedding with its own forward, which style 'vocab' would "
            f"replace; leave it replicated (drop {a.glob!r} from strategy.tp_plan)"
        )
    if e.style == "vocab" and (m.max_norm is not None or m.sparse):
        raise TensorParallelError(f"{name}: style 'vocab' does not support max_norm or sparse embeddings")
    if e.style == "colwise":
        out_features = linear_features(m)[1]
        paddable = e.fused == 1 and (e.gather_output or id(m.weight) in vocab_paddable)
        if out_features % e.fused:
            raise TensorParallelError(f"{name}: out_features={out_features} is not a multiple of fused={e.fused}")
        if e.heads:
            if out_features % e.heads:
                raise TensorParallelError(f"{name}: out_features={out_features} is not {e.heads} whole heads (heads)")
            if e.heads % tp and tp % e.heads:
                raise TensorParallelError(
                    f"{name}: tensor_parallel={tp} neither divides its heads={e.heads} nor is a multiple of them; "
                    f"use a divisor of {e.heads} ({divisors(e.heads)}) or a multiple of it"
                )
        elif not paddable:
            what = "out_features" + (f" / fused={e.fused}" if e.fused > 1 else "")
            _require_divisible(what, out_features // e.fused, tp, name)
    if e.style == "rowwise":
        _require_divisible("in_features", linear_features(m)[0], tp, name)
    if e.style == "rowwise" and (e.fused > 1 or e.split_input):
        _require_divisible("in_features" + (f" / fused={e.fused}" if e.fused > 1 else ""),
                           linear_features(m)[0] // e.fused, tp, name)
    if e.style == "attention":
        _check_attention(name, m, tp, sequence_parallel)
    if e.style in NO_SEQUENCE_PARALLEL and sequence_parallel:
        raise TensorParallelError(
            f"{name}: style {e.style!r} assumes activations replicated over TP, not split along the "
            "sequence; use sequence_parallel=False"
        )
    if e.style == "moe_experts" and (why := check_experts(name, m, tp)):
        raise TensorParallelError(
            f"{why}; leave the experts replicated (drop {a.glob!r} from strategy.tp_plan) or shard "
            "per-expert Linears with colwise/rowwise"
        )
    if e.style in ("local_params", "all_reduce"):
        _check_owned_params(a, tp)
    if e.style == "mla_kv_a_proj" and type(m) is not nn.Linear:
        raise TensorParallelError(f"{name} is {type(m).__name__}: style 'mla_kv_a_proj' fits nn.Linear only")


def _check_hf_heads(root: nn.Module, tp: int) -> None:
    """Head counts of Hugging Face models: q/k/v are colwise-sharded Linears, so whole query heads must
    split; KV heads either split or, fewer than the TP ranks, are copied (``kv_heads.py``)."""
    for name, module in root.named_modules():
        config = getattr(module, "config", None)
        if not hasattr(module, "base_model_prefix") or config is None:
            continue
        grouped = kv_head_counts(module)
        for attr in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, attr, None)
            if attr == "num_key_value_heads" and grouped is not None:
                check_kv_split(name or type(module).__name__, *grouped, tp)
            elif isinstance(value, int):
                _require_divisible(f"config.{attr}", value, tp, name or type(module).__name__)


def resolve_plan(root: nn.Module, plan: Plan, tp: int, sequence_parallel: bool) -> list[Assignment]:
    """Every module the plan names, with its entry; raises on a glob that matches nothing,
    a module matched twice, a style that does not fit, or a size ``tp`` does not divide."""
    modules = dict(root.named_modules())
    assignments: dict[str, Assignment] = {}
    for glob, entry in route_lora(root, plan).items():
        matched = [n for n in modules if n and glob_matches(n, glob)]
        if not matched:
            near = did_you_mean(glob, list(modules))
            leaves = [n for n, m in modules.items() if isinstance(m, (nn.Linear, nn.Embedding))][:8]
            hint = f"did you mean {' or '.join(map(repr, near))}?" if near else f"names look like: {', '.join(leaves)}"
            raise TensorParallelError(f"tp_plan glob {glob!r} matches no module of {type(root).__name__}; {hint}")
        for name in matched:
            if name in assignments:
                raise TensorParallelError(
                    f"{name} is matched by both {assignments[name].glob!r} and {glob!r}; give each module one entry"
                )
            assignments[name] = Assignment(name, modules[name], entry, glob)
    attentions = [a.name for a in assignments.values() if a.entry.style == "attention"]
    for a in assignments.values():
        outer = next((n for n in attentions if a.name.startswith(n + ".")), None)
        if outer is not None and a.entry.style is not None:
            raise TensorParallelError(
                f"{a.name} lies inside {outer}, which style 'attention' already shards whole; drop {a.glob!r}"
            )
    mark_kv_projections(root, assignments, tp)
    vocab_weights = {id(a.module.weight) for a in assignments.values() if a.entry.style == "vocab"}
    for a in assignments.values():
        _check(a, tp, sequence_parallel, vocab_weights)
        if a.entry.style == "mla_kv_a_proj" and mla_rope_dim(root, a.name) is None:
            raise TensorParallelError(
                f"{a.name}: style 'mla_kv_a_proj' reads qk_rope_head_dim from the attention holding it (or its "
                "config), which has none; leave that attention replicated (drop its entries from strategy.tp_plan)"
            )
    _check_hf_heads(root, tp)
    _check_between_split_layers(root, assignments)
    return list(assignments.values())


def _check_between_split_layers(root: nn.Module, assignments: dict[str, Assignment]) -> None:
    """Unplanned modules with parameters between a colwise and a rowwise sibling: those whose
    replicated parameters see split activations (a scalar activation parameter such as Apertus'
    xIELU; a per-head q/k norm a model's own plan forgot, as GLM-4-MoE's with ``use_qk_norm``)
    get ``replicated_grad_sum``; those whose shapes do not tell are refused."""
    styles = {
        n: a.entry.style
        for n, a in assignments.items()
        if a.entry.style is not None and not a.entry.gather_output and not a.entry.split_input
    }
    for name, verdict in modules_in_split_region(root, styles):
        module = root.get_submodule(name)
        if verdict == "sum":
            assignments[name] = Assignment(name, module, PlanEntry("replicated_grad_sum"), "(sees split activations)")
            continue
        raise TensorParallelError(
            f"{name} ({type(module).__name__}) has parameters and sits between a colwise and a rowwise layer, so "
            f"it may act on split activations; add {block_glob(name)!r}: 'replicated_grad_sum' to "
            "strategy.tp_plan if one weight serves every head, else leave the layers around it replicated "
            "(drop their colwise/rowwise entries)"
        )
