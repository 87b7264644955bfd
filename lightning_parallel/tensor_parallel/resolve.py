"""Match a plan's globs to modules and check every size before anything is sharded.

Pure: the checks read only module shapes, configs and the TP size, so every rank raises the
same ``TensorParallelError`` before any collective could hang. Each message names the module and
the TP sizes that would work.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from .plan import FusedAttention, Plan, PlanEntry, TensorParallelError, find_fused_attention


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
        if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
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


def _check(a: Assignment, tp: int, sequence_parallel: bool, vocab_paddable: set[int]) -> None:
    m, e, name = a.module, a.entry, a.name
    for attr in e.divide:
        value = getattr(m, attr, None)
        if not isinstance(value, int):
            raise TensorParallelError(f"{name}: divide names {attr!r}, which is not an integer attribute of the module")
        _require_divisible(attr, value, tp, name)
    if e.style in ("colwise", "rowwise") and type(m) is not nn.Linear and not is_conv1d(m):
        raise TensorParallelError(
            f"{name} is {type(m).__name__}: style {e.style!r} fits nn.Linear (or Hugging Face Conv1D) only"
        )
    if e.style == "vocab" and not isinstance(m, nn.Embedding):
        raise TensorParallelError(f"{name} is {type(m).__name__}: style 'vocab' fits nn.Embedding only")
    if e.style == "vocab" and (m.max_norm is not None or m.sparse):
        raise TensorParallelError(f"{name}: style 'vocab' does not support max_norm or sparse embeddings")
    if e.style == "colwise":
        out_features = linear_features(m)[1]
        paddable = e.fused == 1 and (e.gather_output or id(m.weight) in vocab_paddable)
        if out_features % e.fused:
            raise TensorParallelError(f"{name}: out_features={out_features} is not a multiple of fused={e.fused}")
        if not paddable:
            what = "out_features" + (f" / fused={e.fused}" if e.fused > 1 else "")
            _require_divisible(what, out_features // e.fused, tp, name)
    if e.style == "rowwise":
        _require_divisible("in_features", linear_features(m)[0], tp, name)
    if e.style == "attention":
        _check_attention(name, m, tp, sequence_parallel)


def _check_hf_heads(root: nn.Module, tp: int) -> None:
    """Head counts of Hugging Face models: q/k/v are colwise-sharded Linears, so whole heads must split."""
    for name, module in root.named_modules():
        config = getattr(module, "config", None)
        if not hasattr(module, "base_model_prefix") or config is None:
            continue
        for attr in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, attr, None)
            if isinstance(value, int):
                _require_divisible(f"config.{attr}", value, tp, name or type(module).__name__)


def resolve_plan(root: nn.Module, plan: Plan, tp: int, sequence_parallel: bool) -> list[Assignment]:
    """Every module the plan names, with its entry; raises on a glob that matches nothing,
    a module matched twice, a style that does not fit, or a size ``tp`` does not divide."""
    modules = dict(root.named_modules())
    assignments: dict[str, Assignment] = {}
    for glob, entry in plan.items():
        matched = [n for n in modules if n and fnmatch.fnmatchcase(n, glob)]
        if not matched:
            leaves = [n for n, m in modules.items() if isinstance(m, (nn.Linear, nn.Embedding))][:8]
            raise TensorParallelError(
                f"tp_plan glob {glob!r} matches no module of {type(root).__name__}; module names look like: "
                f"{', '.join(leaves)}"
            )
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
    vocab_weights = {id(a.module.weight) for a in assignments.values() if a.entry.style == "vocab"}
    for a in assignments.values():
        _check(a, tp, sequence_parallel, vocab_weights)
    _check_hf_heads(root, tp)
    return list(assignments.values())
