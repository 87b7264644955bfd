"""Finding a tensor-parallel plan for a model nobody wrote one for.

Two sources, in this order:

1. **Hugging Face models anywhere inside the module**, under any attribute name and behind any
   wrapper that keeps them as submodules (PEFT's ``base_model.model.``, ``torch.compile``'s
   ``_orig_mod.``): their own plan (``_tp_plan`` / ``config.base_model_tp_plan``) or the built-in
   one for their ``model_type``, rewritten relative to the module. Globs of such a plan that match
   nothing (a small config without that part, e.g. no MoE layers) are dropped.
2. **Structure**, for everything else (``shapes.py``): whole attentions (``nn.MultiheadAttention``,
   nanoGPT-shaped fused QKV), attentions with separate q/k/v Linears (BERT, OPT, GPT-Neo, BioGPT)
   or a LitGPT-shaped fused q|k|v, MLPs, and embeddings tied to the output head. Stored head
   counts of a split attention are divided by the TP size (``divide``); where a count or the
   attention width cannot be read with confidence, detection refuses and prints the plan it would
   use, to be checked and given as ``strategy.tp_plan``.

Pure: reads module structure and source only, so every rank reaches the same verdict.
"""

from __future__ import annotations

from torch import nn

from .hf_plans import hf_models, hf_plan
from .names import block_glob, glob_matches, inside, join_name
from .plan import Plan, PlanEntry, TensorParallelError
from .report import plan_as_yaml
from .shapes import (
    as_linear,
    find_config_attention,
    find_fused_attention,
    find_mlp,
    find_split_attention,
    is_lora_layer,
)


def _structural_plan(root: nn.Module, skip: list[str], doubts: list[str]) -> Plan:
    """Attentions first (they claim their Linears), then MLPs among what is left."""
    plan: Plan = {}
    claimed: set[str] = set()  # modules already in the plan, whole subtrees for 'attention'
    whole: list[str] = []
    modules = [(n, m) for n, m in root.named_modules() if not any(inside(n, s) for s in skip)]
    lora = [n for n, m in modules if is_lora_layer(m)]  # a LoRA layer counts as the Linear it wraps
    modules = [(n, m) for n, m in modules if not any(n.startswith(x + ".") for x in lora)]
    for name, module in modules:
        if any(name.startswith(w + ".") for w in whole) or name in claimed:
            continue
        if isinstance(module, nn.MultiheadAttention) or find_fused_attention(module):
            plan[block_glob(name)] = PlanEntry("attention")
            whole.append(name)
            continue
        split = find_split_attention(module)
        if split is None:
            _add_config_attention(plan, claimed, doubts, name, module)
            continue
        claimed.update(join_name(name, p) for p in (*split.qkv, split.out))
        holder = join_name(name, split.holder) or name
        entries = {block_glob(join_name(name, part)): PlanEntry("colwise") for part in split.qkv}
        entries[block_glob(join_name(name, split.out))] = PlanEntry("rowwise")
        if split.divide:
            entries[block_glob(holder)] = PlanEntry(None, divide=split.divide)
        kind = type(root.get_submodule(holder)).__name__
        if split.blocker:  # the plan offered leaves this attention whole
            doubts.append(f"{block_glob(holder)} ({kind}): {split.blocker}")
        elif split.doubt:  # ... and spells out the split to check
            doubts.append(f"{block_glob(holder)} ({kind}): {split.doubt}; once checked, split it with\n{plan_as_yaml(entries)}")
        else:
            plan.update(entries)
    for name, module in modules:
        if any(name.startswith(w + ".") for w in whole) or name in claimed or as_linear(module) is not None:
            continue
        mlp = find_mlp(module, claimed, name)
        for child, style in mlp or ():
            plan[block_glob(join_name(name, child))] = PlanEntry(style)
            claimed.add(join_name(name, child))
    return plan


def _add_config_attention(plan: Plan, claimed: set[str], doubts: list[str], name: str, module: nn.Module) -> None:
    found = find_config_attention(module)
    if found is None:
        return
    claimed.update(join_name(name, p) for p in (found.qkv, found.out))
    if found.doubt:
        doubts.append(f"{block_glob(name)} ({type(module).__name__}): {found.doubt}")
        return
    plan[block_glob(join_name(name, found.qkv))] = PlanEntry("colwise", fused=3)
    plan[block_glob(join_name(name, found.out))] = PlanEntry("rowwise")
    plan[block_glob(name)] = PlanEntry(None, divide=found.divide)


def _add_tied_vocab(root: nn.Module, plan: Plan) -> bool:
    """Shard an embedding tied to an output head by vocabulary rows, both sides of the tie (the
    head gathers its logits for the user's loss); returns whether such a pair exists."""
    planned = {n for n, _ in root.named_modules() if any(glob_matches(n, g) for g in plan)}
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
            plan[block_glob(name)] = PlanEntry("vocab")
            for head in heads[id(module.weight)]:
                plan[block_glob(head)] = PlanEntry("colwise", gather_output=True)
    return tied


def detect_plan(root: nn.Module, sequence_parallel: bool = False) -> Plan:
    """A plan for ``root``: the plans of the Hugging Face models inside it, structure for the rest."""
    plan: Plan = {}
    models = hf_models(root)
    if models and sequence_parallel:
        raise TensorParallelError(
            "sequence_parallel=True is not supported for Hugging Face models: their attention reshapes "
            "with the local sequence length and their rotary/mask inputs span the full sequence; "
            "use sequence_parallel=False"
        )
    with_plan = []
    for name, model in models:
        own = hf_plan(model)
        if own:
            plan.update({join_name(name, glob): entry for glob, entry in own.items()})
            with_plan.append(name)
    doubts: list[str] = []
    plan.update(_structural_plan(root, with_plan, doubts))
    tied = _add_tied_vocab(root, plan)
    if doubts:
        unsure = "tensor parallel plan detection cannot split these attentions with confidence: " + "; ".join(
            dict.fromkeys(doubts)
        )
        if not plan:
            raise TensorParallelError(
                f"{unsure}\nand finds nothing else to split: train with data parallelism instead "
                "(tensor_parallel=1), or give a tp_plan"
            )
        raise TensorParallelError(
            f"{unsure}\nThis plan leaves those attentions whole; give it as strategy.tp_plan (in a strategy YAML "
            "file), with any entries offered above added once their divide list names every stored head count "
            "the attention reshapes with:\n" + plan_as_yaml(plan)
        )
    if sequence_parallel:
        if not tied:
            raise TensorParallelError(
                "sequence_parallel=True with a detected plan needs an embedding tied to the output head "
                "(GPT-style), where the sequence-parallel region starts and ends; give strategy.tp_plan "
                "with 'sequence_scatter' at the region entry and a colwise gather_output head"
            )
        for name, module in root.named_modules():
            glob = block_glob(name)
            if isinstance(module, nn.Embedding) and glob not in plan:
                plan[glob] = PlanEntry("sequence_scatter")
    if not plan:
        raise TensorParallelError(
            f"tensor parallelism has nothing to split in {type(root).__name__}: it splits attention heads "
            "(nn.MultiheadAttention, fused or separate q/k/v Linears with a head count) and MLP hidden layers "
            "(Linear d->f then Linear f->d), and found none. Train it with data parallelism instead "
            "(tensor_parallel=1), or name the Linears to split in a tp_plan, e.g. {'net.fc1': 'colwise', "
            "'net.fc2': 'rowwise'}"
        )
    return plan
