"""Key/value projections over fewer heads than TP ranks: each rank keeps a copy of its KV head.

Grouped- and multi-query attention (Ainslie et al. 2023, arXiv 2305.13245; Shazeer 2019, arXiv
1911.02150) shares each key/value head among a group of query heads. Splitting by heads needs
the TP size to divide the KV heads (Megatron-LM's rule). When the TP size is a multiple of them
instead, each rank keeps its ``heads / tp`` query heads, which all attend to one KV head, and a
copy of that head: rank r holds KV head ``r // (tp / kv_heads)``, the layout of vLLM's
``QKVParallelLinear`` (its ``num_kv_head_replicas``), here made trainable:

* the key and value projections (weight and bias) are sliced to that head (``TPShard.replicas``);
* each rank's gradient of a copy covers only its own query heads, so the full gradient is the
  sum over the ``tp / kv_heads`` ranks sharing it (``comm.sum_over_copies``), and the copies,
  updated with the same gradient, stay identical;
* the attention's stored group size (``num_key_value_groups``, query heads per KV head, with
  which Hugging Face's attention repeats the keys) becomes ``heads / tp``: one local KV head;
* a checkpoint stores each head once, under the unsplit name (the copies write the same chunks).

Pure except ``localise_groups``, which rewrites a module attribute; no collectives here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch import nn

from .plan import TensorParallelError
from .shapes import projection_role

GROUP_SIZES = ("num_key_value_groups", "num_kv_groups")  # query heads per KV head, as attention code stores it
KV_COUNTS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")  # KV heads, as attention code stores them


def kv_head_counts(module: nn.Module) -> Optional[tuple[int, int]]:
    """(query heads, KV heads) of a Hugging Face model (a module with ``base_model_prefix`` and a config
    stating both, fewer KV heads than query heads), else None."""
    config = getattr(module, "config", None)
    if not hasattr(module, "base_model_prefix") or config is None:
        return None
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not isinstance(heads, int) or not isinstance(kv, int) or not 0 < kv < heads:
        return None
    return heads, kv


def allowed_tp(heads: int, kv: int, tp: int) -> bool:
    """Whether ``tp`` ranks split ``heads`` query heads over ``kv`` KV heads: the query heads split
    evenly, and the KV heads either split evenly or are a divisor of the TP size (each then copied)."""
    return heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def tp_sizes(heads: int, kv: int) -> list[int]:
    """Every TP size ``allowed_tp`` accepts."""
    return [t for t in range(1, heads + 1) if allowed_tp(heads, kv, t)]


def check_kv_split(name: str, heads: int, kv: int, tp: int) -> None:
    """Refuse a TP size that neither divides the KV heads nor is a multiple of them."""
    if heads % tp == 0 and kv % tp and tp % kv:
        raise TensorParallelError(
            f"{name}: tensor_parallel={tp} neither divides its {kv} KV heads nor is a multiple of them "
            f"(a multiple gives each rank a copy of the KV head its query heads use); "
            f"tensor_parallel sizes that fit its {heads} query heads over {kv} KV heads: {tp_sizes(heads, kv)}"
        )


def _out_features(module: nn.Module) -> Optional[int]:
    out = getattr(module, "out_features", getattr(module, "nf", None))
    return out if isinstance(out, int) else None


def _layer_of(name: str) -> str:
    """The projection ``name`` is part of: itself, or the PEFT LoRA layer whose base or ``B`` it is
    (``k_proj.base_layer``, ``k_proj.lora_B.default``)."""
    parts = name.split(".")
    if parts[-1] == "base_layer":
        parts = parts[:-1]
    elif len(parts) > 2 and parts[-2] == "lora_B":
        parts = parts[:-2]
    return ".".join(parts)


def attention_of(name: str) -> str:
    """The module holding the projection ``name`` (LoRA parts count as their layer)."""
    return _layer_of(name).rpartition(".")[0]


def mark_kv_projections(root: nn.Module, assignments: dict, tp: int) -> None:
    """Give ``heads = kv`` to the colwise key and value projections of every Hugging Face model in
    ``root`` whose KV heads are fewer than ``tp``: colwise Linears whose output is ``kv`` heads wide
    next to a colwise sibling (the query projection) ``heads`` heads of that size wide. Works on any
    plan's assignments (the model's own, detected, or written by the user); an entry that already
    states ``heads`` is kept. A colwise layer ``kv`` heads of the config's head size wide that is not
    found so is refused: split by rows, it would cut a head in parts."""
    for prefix, model in root.named_modules():
        counts = kv_head_counts(model)
        if counts is None:
            continue
        heads, kv = counts
        check_kv_split(prefix or type(model).__name__, heads, kv, tp)
        if tp <= kv:
            continue
        inside = [a for n, a in assignments.items() if not prefix or n.startswith(prefix + ".")]
        colwise = [a for a in inside if a.entry.style == "colwise" and a.entry.fused == 1 and not a.entry.gather_output]
        widths: dict[str, set[int]] = {}
        for a in colwise:
            widths.setdefault(attention_of(a.name), set()).add(_out_features(a.module) or 0)
        copied: set[str] = set()
        for a in colwise:
            out = _out_features(a.module)
            if a.entry.heads or not out or out % kv:
                continue
            if heads * (out // kv) in widths[attention_of(a.name)]:
                a.entry = replace(a.entry, heads=kv)
                copied.add(attention_of(a.name))
        for name in copied & set(assignments):  # a detected plan divides the stored KV count: one copy instead
            holder = assignments[name]
            keep = tuple(d for d in holder.entry.divide if d not in KV_COUNTS)
            holder.entry = replace(holder.entry, divide=keep)
        config = model.config
        head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
        for a in colwise:
            key_or_value = projection_role(_layer_of(a.name).rpartition(".")[2]) in ("k", "v")
            if not a.entry.heads and key_or_value and _out_features(a.module) == kv * head_dim:
                raise TensorParallelError(
                    f"{a.name}: its {kv} KV heads are fewer than tensor_parallel={tp}, so each rank needs a copy of "
                    "one, but no colwise query projection beside it tells which; give it "
                    f"{{style: colwise, heads: {kv}}} in strategy.tp_plan, or a tensor_parallel size that divides {kv}"
                )


def localise_groups(holder: nn.Module, copies: int, tp: int) -> None:
    """The attention holding a copied KV projection sees one local KV head: its stored group size
    (query heads per KV head) is divided by the number of copies, ``heads / kv`` becoming ``heads / tp``,
    and a stored KV-head count (``tp / copies`` of them) becomes 1."""
    for attr in GROUP_SIZES:
        value = getattr(holder, attr, None)
        if isinstance(value, int) and value % copies == 0:
            setattr(holder, attr, value // copies)
    for attr in KV_COUNTS:
        if getattr(holder, attr, None) == tp // copies:
            setattr(holder, attr, 1)
