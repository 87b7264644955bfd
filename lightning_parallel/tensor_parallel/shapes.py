"""Layers recognised by their shape, whatever their class is called.

* nanoGPT-shaped attention: a fused ``Linear(d, 3d)``, a ``Linear(d, d)``, a stored head count;
  replaced whole (``attention.py``).
* attention with separate q, k, v Linears (found by name: ``q_proj``, ``query``, ``q_lin``, ``wq``)
  and an output projection beside them or in a sibling child (BERT's ``attention.output.dense``);
  sharded Linear by Linear, with the head counts the attention stores divided by the TP size.
* LitGPT-shaped attention: a fused q|k|v Linear whose head counts are read from ``self.config``.
* MLPs: ``d -> f`` (optionally gated) then ``f -> d``, in one module or spread over children.

A PEFT LoRA layer counts as the Linear it wraps (``lora.py`` shards its adapters), and so does a
subclass of ``nn.Linear`` whose own forward computes the same ``x @ W.T + b`` (Falcon's
``FalconLinear``), which sharding replaces by the parallel Linear's forward. That forward is
checked on a small made-up weight and input, so it neither reads nor needs the real weights.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from .names import join_name

# Attributes an attention may reshape with that count heads (or heads x head size): divided by TP.
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads")
HEAD_WIDTHS = ("all_head_size",)
HEAD_SIZES = ("head_dim", "attention_head_size", "head_size")
# Widths that may mean the model width (full under TP) or the attention width (split): divided
# when every read outside ``__init__`` is the last size of a reshape (the merged heads), else unsure.
AMBIGUOUS_WIDTHS = ("embed_dim", "hidden_size", "n_embd", "d_model")
# Arguments of an attention's forward that carry one slice per head, made outside the attention.
HEAD_BIASES = ("position_bias", "alibi", "attn_bias")


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer: the original layer as ``base_layer`` plus ``lora_A`` / ``lora_B`` adapters."""
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def computes_linear(module: nn.Module) -> bool:
    """An ``nn.Linear``, or a subclass whose forward gives ``F.linear`` on a probe: a weight,
    bias and input made of fixed non-degenerate values, a few features wide (a forward that reads
    its stored sizes, or anything else, fails the probe and is not taken for a Linear)."""
    if type(module) is nn.Linear:
        return True
    own = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    if not isinstance(module, nn.Linear) or any(True for _ in module.children()) or not own <= {"weight", "bias"}:
        return False  # anything else it holds would be lost when the parallel Linear replaces it
    out_f, in_f = min(module.out_features, 5), min(module.in_features, 7)
    wave = lambda n, a, shape: torch.sin(torch.arange(n, dtype=torch.float32) * a + 0.1).reshape(shape)  # noqa: E731
    probe = {"weight": wave(out_f * in_f, 0.37, (out_f, in_f))}
    if module.bias is not None:
        probe["bias"] = wave(out_f, 0.71, (out_f,))
    x = wave(2 * 3 * in_f, 0.53, (2, 3, in_f))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            y = functional_call(module, probe, (x,))
    except Exception:  # any failure means: not provably a plain Linear
        return False
    expected = F.linear(x, probe["weight"], probe.get("bias"))
    return torch.is_tensor(y) and y.shape == expected.shape and torch.allclose(y, expected, rtol=1e-5, atol=1e-6)


def as_linear(module: nn.Module) -> Optional[nn.Linear]:
    """The ``nn.Linear`` a module computes: itself (``computes_linear``), or the base layer of a
    LoRA layer around one."""
    if computes_linear(module):
        return module
    if is_lora_layer(module) and type(module.base_layer) is nn.Linear:
        return module.base_layer
    return None


def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: lin for n, m in module.named_children() if (lin := as_linear(m)) is not None}


def _heads_of(module: nn.Module, width: int) -> Optional[int]:
    for attr in ("n_head", "num_heads", "n_heads"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and width % head_dim == 0:
        return width // head_dim
    return None


# ---- nanoGPT-shaped attention (fused QKV): replaced whole -------------------------------------
@dataclass(frozen=True)
class FusedAttention:
    """The parts of a nanoGPT-shaped attention module, as found by structure."""

    qkv: str
    out: str
    heads: int
    dropout: float
    resid_dropout: Optional[str]


def _is_causal(module: nn.Module) -> bool:
    """Whether the module's own forward masks future positions (``is_causal=True`` or a ``tril`` mask)."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "is_causal=True" in source.replace(" ", "") or "tril" in source


def find_fused_attention(module: nn.Module) -> Optional[FusedAttention]:
    """A causal attention with a fused ``Linear(d, 3d)``, a ``Linear(d, d)`` and a head count
    directly in ``module`` (nanoGPT's shape under any class name), else None."""
    linears = {n: m for n, m in module.named_children() if type(m) is nn.Linear}
    qkv = [n for n, m in linears.items() if m.out_features == 3 * m.in_features]
    if len(linears) != 2 or len(qkv) != 1:
        return None
    width = linears[qkv[0]].in_features
    out = next(n for n in linears if n != qkv[0])
    if (linears[out].in_features, linears[out].out_features) != (width, width):
        return None
    heads = _heads_of(module, width)
    if heads is None or not _is_causal(module):
        return None
    dropouts = {n: m for n, m in module.named_children() if isinstance(m, nn.Dropout)}
    p = getattr(module, "dropout", None)
    if not isinstance(p, float):
        p = next((m.p for n, m in dropouts.items() if "attn" in n), 0.0)
    resid = next((n for n in dropouts if "resid" in n), None)
    return FusedAttention(qkv[0], out, heads, p, resid)


# ---- attention with separate q, k, v Linears: sharded Linear by Linear ------------------------
_ROLE_WORDS = {"q": {"q", "query", "wq"}, "k": {"k", "key", "wk"}, "v": {"v", "value", "wv"}}
_OUT_WORDS = {"o", "out", "output", "dense", "wo", "proj"}


def projection_role(name: str) -> Optional[str]:
    words = set(re.split(r"[^a-z]+", name.lower())) - {""}
    for role, keys in _ROLE_WORDS.items():
        if words & keys:
            return role
    return "out" if words & _OUT_WORDS else None


@dataclass(frozen=True)
class SplitAttention:
    """q, k, v and output projections (names relative to the module searched), the module that
    holds q/k/v and reshapes with its head counts, the attributes to divide, a doubt about them
    (for the user to settle) and a blocker (no such plan can split this attention)."""

    qkv: tuple[str, str, str]
    out: str
    holder: str
    divide: tuple[str, ...]
    doubt: Optional[str]
    blocker: Optional[str]


def _own_source(module: nn.Module) -> str:
    """Source of the methods the module's class resolves to, other than ``__init__`` (what runs in forward)."""
    methods: dict[str, object] = {}
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch."):
            break
        for name, fn in vars(cls).items():
            if name != "__init__" and inspect.isfunction(fn):
                methods.setdefault(name, fn)  # the first class in the MRO wins, as in attribute lookup
    chunks = []
    for fn in methods.values():
        try:
            chunks.append(inspect.getsource(fn))
        except (OSError, TypeError):
            pass
    return "\n".join(chunks)


def _head_attributes(holder: nn.Module, q_width: int, kv_width: int) -> tuple[tuple[str, ...], Optional[str]]:
    """Integer attributes of ``holder`` that count local heads once q/k/v are split, and a doubt."""
    size = next((getattr(holder, a) for a in HEAD_SIZES if isinstance(getattr(holder, a, None), int)), None)
    counts = {a: getattr(holder, a) for a in HEAD_COUNTS if isinstance(getattr(holder, a, None), int)}
    if size is None and counts:
        size = q_width // max(counts.values())
    if not size or q_width % size or kv_width % size:
        return tuple(counts), "no head size (head_dim / attention_head_size) or head count consistent with q/k/v widths"
    divide = []
    for attr, value in counts.items():
        if value * size not in (q_width, kv_width):
            return tuple(counts), f"{attr} = {value} does not match q/k/v widths {q_width}/{kv_width} at head size {size}"
        divide.append(attr)
    divide += [a for a in HEAD_WIDTHS if getattr(holder, a, None) == q_width]
    source = _own_source(holder)
    for attr in AMBIGUOUS_WIDTHS:
        reads = len(re.findall(rf"self\.{attr}\b", source))
        # the last size of a reshape in an attention forward is the merged heads' width: local under TP
        merged = len(re.findall(rf"\b(?:reshape|view)\([^()]*self\.{attr}\s*\)", source))
        if reads and (reads != merged or getattr(holder, attr) != q_width):
            return tuple(divide), f"its forward reads self.{attr}, which may be the model width or the attention width"
        if reads:
            divide.append(attr)
    return tuple(divide), None


def _unsplittable(holder: nn.Module, parts: set[str]) -> Optional[str]:
    """Why no plan of sharded Linears and divided attributes can split this attention, if so."""
    source = _own_source(holder)
    # ``bsz, tgt_len, embed_dim = hidden_states.size()`` then ``reshape(bsz, tgt_len, embed_dim)``:
    # a width read from the input, full under TP, where the merged local heads are narrower
    for width in re.findall(r"\w+\s*,\s*\w+\s*,\s*(\w+)\s*=\s*\w+\.(?:size\(\)|shape)", source):
        if re.search(rf"\b(?:reshape|view)\([^()]*\b{width}\s*\)", source):
            return f"its forward merges heads to {width}, a width read from its input (full under TP)"
    # a bias with one slice per head, made outside the attention (CPM-Ant's position_bias, BLOOM's alibi)
    try:
        arguments = inspect.signature(type(holder).forward).parameters
    except (TypeError, ValueError):
        arguments = {}
    biases = [a for a in arguments if a in HEAD_BIASES]
    if biases:
        return f"its forward takes {biases[0]}, a per-head bias made outside it that would need splitting by head"
    # parameters besides the projections (BitNet's attn_sub_norm) may act across the split heads
    extras = [n for n, c in holder.named_children() if n not in parts and any(True for _ in c.parameters())]
    if extras:
        return f"it holds {extras[0]} ({type(getattr(holder, extras[0])).__name__}) with parameters besides q/k/v/out"
    return None


def _in_out(linear: nn.Linear) -> tuple[int, int]:
    return linear.in_features, linear.out_features


def find_split_attention(module: nn.Module) -> Optional[SplitAttention]:
    """Separate q, k, v Linears in ``module`` or one of its children, with the output projection
    (``Linear(q width, d)``) beside them or in a sibling child (BERT's ``attention.output.dense``)."""
    holders = [("", module)] + [(n, c) for n, c in module.named_children() if as_linear(c) is None]
    for holder_name, holder in holders:
        linears = _linears(holder)
        by_role: dict[str, list[str]] = {}
        for n in linears:
            by_role.setdefault(projection_role(n), []).append(n)
        if any(len(by_role.get(r, [])) != 1 for r in "qkv"):
            continue
        q, k, v = (by_role[r][0] for r in "qkv")
        d = linears[q].in_features
        if {linears[k].in_features, linears[v].in_features} != {d} or linears[k].out_features != linears[v].out_features:
            continue
        shape = (linears[q].out_features, d)  # the output projection maps the heads back to d
        outs = [join_name(holder_name, n) for n in by_role.get("out", []) if _in_out(linears[n]) == shape]
        if not outs and holder_name:
            for sibling, child in module.named_children():
                if sibling != holder_name and as_linear(child) is None:
                    outs += [join_name(sibling, n) for n, lin in _linears(child).items()
                             if _in_out(lin) == shape and projection_role(n) == "out"]
        if len(outs) != 1:
            continue
        divide, doubt = _head_attributes(holder, linears[q].out_features, linears[k].out_features)
        blocker = _unsplittable(holder, {q, k, v, *by_role.get("out", [])})
        names = tuple(join_name(holder_name, n) for n in (q, k, v))
        return SplitAttention(names, outs[0], holder_name, divide, doubt, blocker)
    return None


# ---- attention whose head counts live in a config object (LitGPT) ------------------------------
@dataclass(frozen=True)
class ConfigAttention:
    """A fused q|k|v Linear and an output Linear whose forward reads head counts from ``config``."""

    qkv: str
    out: str
    divide: tuple[str, ...]
    doubt: Optional[str]


def _int_attr(obj: object, names: tuple[str, ...]) -> Optional[tuple[str, int]]:
    return next(((a, getattr(obj, a)) for a in names if isinstance(getattr(obj, a, None), int)), None)


def find_config_attention(module: nn.Module) -> Optional[ConfigAttention]:
    """LitGPT's shape: ``qkv: Linear(d, (heads + 2 * kv_heads) * head_size)`` laid out as q|k|v,
    ``proj: Linear(heads * head_size, d)``, counts read from ``module.config`` at each forward."""
    config = getattr(module, "config", None)
    heads = _int_attr(config, ("n_head", "num_attention_heads", "num_heads"))
    size = _int_attr(config, ("head_size", "head_dim"))
    if config is None or heads is None or size is None:
        return None
    groups = _int_attr(config, ("n_query_groups", "num_key_value_heads")) or (heads[0], heads[1])
    h, g, hs = heads[1], groups[1], size[1]
    linears = {n: m for n, m in _linears(module).items() if type(m) is nn.Linear}  # LitGPT's own layers only
    qkv = [n for n, m in linears.items() if m.out_features == (h + 2 * g) * hs]
    out = [n for n, m in linears.items() if m.in_features == h * hs and n not in qkv]
    if len(qkv) != 1 or len(out) != 1:
        return None
    divide = tuple(dict.fromkeys(f"config.{a}" for a in (heads[0], groups[0])))
    doubt = None
    if g != h:
        doubt = (
            f"its fused {qkv[0]} holds q, k and v blocks of unequal size ({h} query heads, {g} KV heads), "
            "which no style splits"
        )
    return ConfigAttention(qkv[0], out[0], divide, doubt)


# ---- MLPs --------------------------------------------------------------------------------------
def _mlp_pattern(linears: dict[str, nn.Linear]) -> Optional[list[tuple[str, str]]]:
    """(name, style) of an MLP's Linears: d->f then f->d, or a gated d->f, d->f, f->d."""
    if len(linears) not in (2, 3):
        return None
    down = [n for n, m in linears.items() if m.out_features < m.in_features]
    up = [n for n in linears if n not in down]
    if len(down) != 1 or not up:
        return None
    f, d = linears[down[0]].in_features, linears[down[0]].out_features
    if any((linears[n].in_features, linears[n].out_features) != (d, f) for n in up):
        return None
    return [(n, "colwise") for n in up] + [(down[0], "rowwise")]


def _weights_on_hidden(module: nn.Module, linears: dict[str, nn.Linear], mlp: list[tuple[str, str]]) -> bool:
    """Whether another child holds weights as wide as the MLP's hidden layer (BitNet's
    ``ffn_sub_norm`` between up and down): they would act on split features, so the MLP stays whole."""
    hidden, width = linears[mlp[-1][0]].in_features, linears[mlp[-1][0]].out_features
    others = [c for n, c in module.named_children() if n not in linears]
    return hidden != width and any(hidden in p.shape for c in others for p in c.parameters())


def find_mlp(module: nn.Module, claimed: set[str], name: str) -> Optional[list[tuple[str, str]]]:
    """An MLP whose Linears are children of ``module``, or else each the one Linear of a child
    (BERT's ``intermediate.dense`` and ``output.dense``); names relative to ``module``. A module
    that holds embeddings or a list of blocks is a model, whose Linears need not feed each other
    (OPT's ``project_out`` and ``project_in`` sit at either end of the decoder): never an MLP."""
    if any(isinstance(c, (nn.Embedding, nn.ModuleList)) for c in module.children()):
        return None
    direct = {n: m for n, m in _linears(module).items() if join_name(name, n) not in claimed}
    found = _mlp_pattern(direct)
    if found and _weights_on_hidden(module, direct, found):
        return None
    if found or direct:
        return found
    spread: dict[str, nn.Linear] = {}
    for child_name, child in module.named_children():
        inner = [n for n, m in child.named_modules() if n and as_linear(m) is not None]
        if len(inner) == 1 and inner[0] in _linears(child) and join_name(name, child_name, inner[0]) not in claimed:
            spread[join_name(child_name, inner[0])] = as_linear(child.get_submodule(inner[0]))
    return _mlp_pattern(spread)
