"""Tensor-parallel plans: which module gets which style, found and checked before any sharding.

A plan maps module-name globs (``fnmatch``, matched against names relative to the module given to
``parallelize``) to a style:

``colwise``   ``nn.Linear`` (or HF ``Conv1D``) split by output features; options ``fused: n``
              (the output holds n equal blocks, e.g. 3 for a fused QKV, each split separately)
              and ``gather_output: true`` (all-gather the output, for a head whose logits the
              user's loss reads).
``rowwise``   ``nn.Linear`` (or HF ``Conv1D``) split by input features; its input must come from
              a colwise layer.
``vocab``     ``nn.Embedding`` split by vocabulary rows.
``attention`` a whole attention: ``nn.MultiheadAttention``, or nanoGPT-shaped attention (a fused
              ``Linear(d, 3d)``, a ``Linear(d, d)``, a head count ``n_head``/``num_heads`` or a
              ``head_dim``) whose forward is replaced by a TP-aware one.
``sequence_scatter``  with sequence parallelism only: the module's output is replicated and enters
              the sequence-parallel region (split along the sequence), e.g. a position embedding.

Any entry may add ``divide: [attr, ...]``: integer attributes (a stored head count) divided by
the TP size, for attention code that reshapes with them; an entry may consist of ``divide`` alone.

Plans come from the user (Hydra ``strategy.tp_plan``), from a Hugging Face model's own plan
(``_tp_plan`` / ``config.base_model_tp_plan``, relative to the HF model), from a built-in table
for HF models that carry none (GPT-2, whose ``Conv1D`` layers shard like Linears), or from
structure (``detect_plan``). Everything here is pure: no process group is touched, so every rank
reaches the same verdict and raises the same error before any collective.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from torch import nn

STYLES = ("colwise", "rowwise", "vocab", "attention", "sequence_scatter")

# Hugging Face style names (transformers' ALL_PARALLEL_STYLES) that have an equivalent here.
HF_STYLES = {
    "colwise": {"style": "colwise"},
    "rowwise": {"style": "rowwise"},
    "colwise_gather_output": {"style": "colwise", "gather_output": True},
    "colwise_rep": {"style": "colwise", "gather_output": True},
    "packed_colwise": {"style": "colwise", "fused": 2},
    "embedding_rowwise": {"style": "vocab"},
}
HF_IGNORED = ("replicate",)

# Plans for Hugging Face models that carry none, by ``config.model_type``, relative to the base
# model. GPT-2 stores its Linears as ``Conv1D`` (weight ``(in, out)``) and splits its fused QKV with
# a stored ``split_size``, which becomes the local width once divided by the TP size.
BUILTIN_HF_PLANS = {
    "gpt2": {
        "h.*.attn": {"divide": ["split_size", "num_heads"]},
        "h.*.attn.c_attn": {"style": "colwise", "fused": 3},
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
}


class TensorParallelError(ValueError):
    """A model or plan that cannot be tensor-parallelised as asked; says what would work."""


@dataclass(frozen=True)
class PlanEntry:
    """The style for the modules one glob matches."""

    style: Optional[str] = None
    fused: int = 1
    gather_output: bool = False
    divide: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [self.style or "attributes"]
        if self.fused > 1:
            parts.append(f"fused={self.fused}")
        if self.gather_output:
            parts.append("gather_output")
        if self.divide:
            parts.append("divide " + ",".join(self.divide))
        return " ".join(parts)


Plan = dict[str, PlanEntry]


def parse_plan(raw: Mapping) -> Plan:
    """A plan from plain data: ``{glob: style}`` or ``{glob: {style:, fused:, gather_output:, divide:}}``."""
    plan: Plan = {}
    for glob, value in raw.items():
        if isinstance(value, str):
            value = {"style": value}
        if not isinstance(value, Mapping):
            raise TensorParallelError(f"tp_plan[{glob!r}] must be a style name or a mapping, got {value!r}")
        unknown = set(value) - {"style", "fused", "gather_output", "divide"}
        if unknown:
            raise TensorParallelError(
                f"tp_plan[{glob!r}] has unknown keys {sorted(unknown)}; allowed: style, fused, gather_output, divide"
            )
        style = value.get("style")
        if style is not None and style not in STYLES:
            raise TensorParallelError(f"tp_plan[{glob!r}]: unknown style {style!r}; known styles: {', '.join(STYLES)}")
        if style is None and not value.get("divide"):
            raise TensorParallelError(f"tp_plan[{glob!r}] needs a style or a divide list")
        fused = int(value.get("fused", 1))
        if fused < 1 or (fused > 1 and style != "colwise"):
            raise TensorParallelError(f"tp_plan[{glob!r}]: fused={fused} needs style colwise and fused >= 1")
        plan[str(glob)] = PlanEntry(
            style, fused, bool(value.get("gather_output", False)), tuple(value.get("divide", ()))
        )
    return plan


# ---- detection ---------------------------------------------------------------------------------
def _is_hf_model(module: nn.Module) -> bool:
    return hasattr(module, "config") and hasattr(module, "base_model_prefix") and hasattr(module, "base_model")


def _hf_plan(root: nn.Module) -> tuple[Plan, list[tuple[str, nn.Module]]]:
    """The plans Hugging Face models inside ``root`` carry, rewritten relative to ``root``."""
    plan: Plan = {}
    found = []
    for name, module in root.named_modules():
        if not _is_hf_model(module) or any(name.startswith(f"{n}.") or n == "" for n, _ in found):
            continue
        found.append((name, module))
        prefix = f"{name}." if name else ""
        base_name = next(n for n, m in module.named_modules() if m is module.base_model)
        base_prefix = prefix + (f"{base_name}." if base_name else "")
        builtin = BUILTIN_HF_PLANS.get(getattr(module.config, "model_type", None))
        own = getattr(module, "_tp_plan", None)
        if not own and builtin:
            plan.update({base_prefix + glob: entry for glob, entry in parse_plan(builtin).items()})
            continue
        if not own:
            own = {
                (f"{base_name}." if base_name else "") + k: v
                for k, v in (module.config.base_model_tp_plan or {}).items()
            }
        for glob, style in own.items():
            if style in HF_IGNORED:
                continue
            if style not in HF_STYLES:
                raise TensorParallelError(
                    f"{type(module).__name__} asks for Hugging Face style {style!r} at {glob!r}, which has no "
                    f"equivalent here (supported: {', '.join(HF_STYLES)}); give strategy.tp_plan instead"
                )
            plan[prefix + glob] = PlanEntry(**HF_STYLES[style])
    return plan, found


def _heads_of(module: nn.Module, width: int) -> Optional[int]:
    for attr in ("n_head", "num_heads", "n_heads"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and width % head_dim == 0:
        return width // head_dim
    return None


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


def _block_glob(name: str) -> str:
    """``transformer.h.3.mlp.c_fc`` -> ``transformer.h.*.mlp.c_fc``: one row per repeated layer."""
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", name)


def _mlp_linears(module: nn.Module) -> Optional[list[tuple[str, str]]]:
    """(name, style) of an MLP's Linears: d->f then f->d, or a gated d->f, d->f, f->d."""
    linears = [(n, m) for n, m in module.named_children() if type(m) is nn.Linear]
    if len(linears) not in (2, 3):
        return None
    down = [(n, m) for n, m in linears if m.in_features != m.out_features and m.out_features < m.in_features]
    up = [(n, m) for n, m in linears if (n, m) not in down]
    if len(down) != 1 or not up:
        return None
    f, d = down[0][1].in_features, down[0][1].out_features
    if any((m.in_features, m.out_features) != (d, f) for _, m in up):
        return None
    return [(n, "colwise") for n, _ in up] + [(down[0][0], "rowwise")]


def _add_tied_vocab(root: nn.Module, plan: Plan) -> bool:
    """Shard an embedding tied to an output head by vocabulary rows, both sides of the tie (the
    head gathers its logits for the user's loss); returns whether such a pair exists."""
    planned = {n for n, _ in root.named_modules() if any(fnmatch.fnmatchcase(n, g) for g in plan)}
    heads: dict[int, list[str]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if isinstance(module, nn.Linear):
            heads.setdefault(id(module.weight), []).append(name)
    tied = False
    for name, module in root.named_modules():
        if isinstance(module, nn.Embedding) and id(module.weight) in heads:
            tied = True
            if name in planned or any(h in planned for h in heads[id(module.weight)]):
                continue
            plan[_block_glob(name)] = PlanEntry("vocab")
            for head in heads[id(module.weight)]:
                plan[_block_glob(head)] = PlanEntry("colwise", gather_output=True)
    return tied


def detect_plan(root: nn.Module, sequence_parallel: bool = False) -> Plan:
    """A plan for ``root`` from a Hugging Face model's own plan, or else from structure."""
    plan, hf_models = _hf_plan(root)
    if hf_models:
        if sequence_parallel:
            raise TensorParallelError(
                "sequence_parallel=True is not supported for Hugging Face models: their attention reshapes "
                "with the local sequence length and their rotary/mask inputs span the full sequence; "
                "use sequence_parallel=False"
            )
        if not plan:
            names = ", ".join(type(m).__name__ for _, m in hf_models)
            raise TensorParallelError(
                f"{names} carries no tensor parallel plan (config.base_model_tp_plan is empty); give "
                "strategy.tp_plan, e.g. {'model.h.*.mlp.c_fc': 'colwise', 'model.h.*.mlp.c_proj': 'rowwise'}"
            )
        _add_tied_vocab(root, plan)
        return plan
    inside_attention: set[str] = set()
    for name, module in root.named_modules():
        if any(name.startswith(a + ".") for a in inside_attention):
            continue
        if isinstance(module, nn.MultiheadAttention) or find_fused_attention(module):
            plan[_block_glob(name)] = PlanEntry("attention")
            inside_attention.add(name)
            continue
        mlp = _mlp_linears(module)
        if mlp:
            for child, style in mlp:
                plan[_block_glob(f"{name}.{child}" if name else child)] = PlanEntry(style)
    tied = _add_tied_vocab(root, plan)
    if sequence_parallel:
        if not tied:
            raise TensorParallelError(
                "sequence_parallel=True with a detected plan needs an embedding tied to the output head "
                "(GPT-style), where the sequence-parallel region starts and ends; give strategy.tp_plan "
                "with 'sequence_scatter' at the region entry and a colwise gather_output head"
            )
        for name, module in root.named_modules():
            glob = _block_glob(name)
            if isinstance(module, nn.Embedding) and glob not in plan:
                plan[glob] = PlanEntry("sequence_scatter")
    if not plan:
        raise TensorParallelError(
            f"found nothing to shard in {type(root).__name__}: no Hugging Face tp plan, no attention "
            "(nn.MultiheadAttention or fused Linear(d, 3d) + Linear(d, d) with a head count) and no MLP "
            "(Linear d->f, Linear f->d); give strategy.tp_plan, e.g. {'model.layers.*.fc1': 'colwise', "
            "'model.layers.*.fc2': 'rowwise'}"
        )
    return plan
