"""Hugging Face models inside a module, and the tensor-parallel plans they carry.

A model is found anywhere inside the module given to ``parallelize``, under any attribute path and
behind wrappers that keep it as a submodule (PEFT's ``base_model.model.``, ``torch.compile``'s
``_orig_mod.``); its plan (``_tp_plan`` / ``config.base_model_tp_plan``, or the built-in one for
its ``model_type``) is relative to the model. Globs of that plan that match none of its modules (a
small config without that part, e.g. no MoE layers) are dropped rather than refused: the plan was
written for every size of the architecture, not for this one.

A glob may also name a bare parameter (``layers.*.self_attn.sinks``: ``colwise``) of a module whose
own entry is ``local_params`` or ``all_reduce``; it becomes that entry's ``params``, split like
transformers splits a parameter: ``colwise`` along its second-to-last dimension (the only one of a
1-D parameter), ``rowwise`` along its last.

An ``embedding_rowwise`` entry on an ``nn.Embedding`` subclass whose own forward does more than
scale the lookup (Inkling's normed embedding) is dropped: style ``vocab`` would replace that
forward, and a replicated embedding is exact.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch import nn

from .moe import check_experts
from .names import glob_matches, inside
from .plan import (
    BUILTIN_HF_PLANS,
    HF_IGNORED,
    HF_PAIRED_LAYERS,
    HF_STYLES,
    PARAM_OWNER_STYLES,
    STYLES,
    Plan,
    PlanEntry,
    TensorParallelError,
    parse_plan,
)
from .resolve import embed_scale


def is_hf_model(module: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (by class name, so transformers need not be imported).
    PEFT's wrappers forward ``config`` and ``base_model`` by ``__getattr__`` but are not one."""
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


def hf_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face models inside ``root`` (name relative to ``root``, module)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if is_hf_model(module) and not any(inside(name, n) for n, _ in found):
            found.append((name, module))
    return found


def _entry(model: nn.Module, glob: str, style: str) -> Optional[PlanEntry]:
    if style in HF_IGNORED:
        return None
    if style not in HF_STYLES:
        raise TensorParallelError(
            f"{type(model).__name__} asks for Hugging Face style {style!r} at {glob!r}, which has no "
            f"equivalent here (supported: {', '.join(HF_STYLES)}); give strategy.tp_plan: the model's plan "
            f"with {glob!r} mapped to one of {', '.join(STYLES)}, or left out to stay replicated"
        )
    return PlanEntry(**HF_STYLES[style])


def hf_plan(model: nn.Module) -> Plan:
    """The plan a Hugging Face model carries (or the built-in one), relative to ``model``, with
    the globs that match none of its modules dropped."""
    base_name = next(n for n, m in model.named_modules() if m is model.base_model)
    base_prefix = f"{base_name}." if base_name else ""
    own = getattr(model, "_tp_plan", None)
    builtin = BUILTIN_HF_PLANS.get(getattr(model.config, "model_type", None))
    names = [n for n, _ in model.named_modules() if n]
    present = lambda glob: any(glob_matches(n, glob) for n in names)  # noqa: E731
    if not own and builtin:
        return {base_prefix + glob: e for glob, e in parse_plan(builtin).items() if present(base_prefix + glob)}
    raw = own or {base_prefix + k: v for k, v in (model.config.base_model_tp_plan or {}).items()}
    plan = {glob: e for glob, style in raw.items() if present(glob) and (e := _entry(model, glob, style)) is not None}
    plan = {glob: e for glob, e in plan.items() if e.style != "vocab" or _vocab_keeps_forward(model, glob)}
    for glob, entry in plan.items():
        if entry.style in PARAM_OWNER_STYLES:
            plan[glob] = replace(entry, params=_owned_params(model, glob, raw))
    paired = parse_plan(HF_PAIRED_LAYERS.get(getattr(model.config, "model_type", None), {}))
    plan.update({base_prefix + glob: e for glob, e in paired.items() if base_prefix + glob in plan})
    plan.update(_experts_of_the_ep_plan(model, base_prefix, raw, present))
    return plan


def _experts_of_the_ep_plan(model: nn.Module, base_prefix: str, raw: dict, present) -> Plan:
    """``moe_experts`` entries for the experts modules that the model's expert-parallel plan names and
    its tensor-parallel plan leaves out. transformers (5.25 on) keeps MoE experts in
    ``base_model_ep_plan`` only (``ep_dispatch_experts``), so a TP plan read alone would leave every
    expert whole on every rank: exact, but each rank would hold them all."""
    ep_plan = getattr(model.config, "base_model_ep_plan", None) or {}
    found: Plan = {}
    for glob, style in ep_plan.items():
        glob = base_prefix + glob
        if style != "ep_dispatch_experts" or not present(glob) or any(g == glob or inside(g, glob) for g in raw):
            continue
        matched = [(n, m) for n, m in model.named_modules() if n and glob_matches(n, glob)]
        if any(check_experts(n, m, 1) is not None for n, m in matched):  # not of the form the style splits
            continue
        found[glob] = PlanEntry(**HF_STYLES["moe_tp_experts"])
    return found


def _vocab_keeps_forward(model: nn.Module, glob: str) -> bool:
    """Whether style ``vocab`` reproduces the forward of every embedding ``glob`` matches."""
    matched = [m for n, m in model.named_modules() if n and glob_matches(n, glob)]
    return all(not isinstance(m, nn.Embedding) or embed_scale(m) is not None for m in matched)


def _owned_params(model: nn.Module, owner_glob: str, raw: dict) -> tuple[tuple[str, int], ...]:
    """(parameter, dim) for each ``owner_glob.<parameter>`` entry of ``raw`` that names a direct
    parameter of a module ``owner_glob`` matches."""
    owners = [m for n, m in model.named_modules() if n and glob_matches(n, owner_glob)]
    found = []
    for glob, style in raw.items():
        owner, _, name = glob.rpartition(".")
        if owner != owner_glob:
            continue
        param = next((p for m in owners if isinstance(p := m._parameters.get(name), nn.Parameter)), None)
        if param is None:
            continue
        if style not in ("colwise", "rowwise"):
            raise TensorParallelError(
                f"{type(model).__name__} asks for Hugging Face style {style!r} on the parameter {glob!r}; "
                f"a parameter of a {raw[owner_glob]!r} module can be split colwise or rowwise only"
            )
        found.append((name, -2 if style == "colwise" and param.dim() >= 2 else -1))
    return tuple(found)
