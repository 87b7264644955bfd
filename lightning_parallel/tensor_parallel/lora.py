"""PEFT LoRA adapters (Hu et al. 2021, arXiv 2106.09685) sharded to match their base layer.

A PEFT LoRA layer computes ``base(x) + B(A(dropout(x))) * scaling`` with ``A: d_in -> r`` and
``B: r -> d_out``. A plan entry that names such a layer is routed to its parts so that the
adapter path produces exactly the shard the base layer produces:

* **colwise base** (output features split): ``A`` stays whole, ``B`` is split by output features
  (column-parallel). ``x`` is replicated, so ``A(x)`` is too; ``B``'s local rows give this rank's
  slice of the update, added to this rank's slice of the base output. ``B``'s input enters the
  parallel region through Megatron's ``f`` (identity forward, all-reduce of the ``r``-wide input
  gradient backward), which makes ``A``'s gradient whole on every rank.
* **rowwise base** (input features split, input already sharded): ``A`` is split by input
  features (row-parallel: its ``r``-wide partial products are all-reduced), ``B`` stays whole and
  adds its full update to the base output, which is already reduced.

Each adapter adds one collective of width ``r`` per token, ``r / d`` of the base layer's. Joining
the adapter's partial product to the base's before the base's all-reduce would save it, but
would leave ``B``'s gradient partial on every rank (it multiplies the partial ``A x``).

DoRA and other LoRA variants rescale the base weight by norms of the whole weight: refused.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .names import glob_matches
from .plan import Plan, PlanEntry, TensorParallelError
from .random import ShardedDropout, TPRandom
from .shapes import is_lora_layer


def _check_plain_lora(name: str, layer: nn.Module) -> None:
    if getattr(layer, "lora_variant", None):
        variants = sorted({type(v).__name__ for v in layer.lora_variant.values()})
        raise TensorParallelError(
            f"{name}: LoRA variant {', '.join(variants)} (e.g. use_dora=True) rescales the base weight by "
            "norms of the whole weight and cannot be tensor-parallelised here; use plain LoRA (use_dora=False)"
        )
    if any(type(m) is not nn.Linear for d in (layer.lora_A, layer.lora_B) for m in d.values()):
        raise TensorParallelError(f"{name}: LoRA adapters other than nn.Linear pairs cannot be split; leave it out of the plan")


def _route(glob: str, entry: PlanEntry) -> Plan:
    """Entries for one LoRA layer (or a glob of them) whose base layer gets ``entry``."""
    # the adapter half that meets the split side takes the base's layout (fused blocks, gathered
    # output, split input): B's outputs line up with the base's, A's inputs with the base's
    routed = {f"{glob}.base_layer": replace(entry, divide=())}
    routed[f"{glob}.{'lora_B' if entry.style == 'colwise' else 'lora_A'}.*"] = replace(entry, divide=())
    if entry.divide:
        routed[glob] = PlanEntry(None, divide=entry.divide)
    return routed


def _is_saved_copy(module: nn.Module) -> bool:
    """PEFT's ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``): the original module and a
    trainable copy per adapter, of which the active one runs."""
    return type(module).__name__ == "ModulesToSaveWrapper" and hasattr(module, "original_module") \
        and isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict)


def route_lora(root: nn.Module, plan: Plan) -> Plan:
    """``plan`` with every entry that names a PEFT LoRA layer replaced by entries for its base
    layer and adapters (see the module docstring), and every entry that names a PEFT
    ``modules_to_save`` wrapper by the same entry for the original module and each saved copy
    (whichever the adapter selects runs, split alike); other entries unchanged."""
    modules = dict(root.named_modules())
    routed: Plan = {}
    for glob, entry in plan.items():
        matched = [n for n in modules if n and glob_matches(n, glob)]
        saved = [n for n in matched if _is_saved_copy(modules[n])]
        if saved:
            for name in matched:
                if name in saved:
                    routed[f"{name}.original_module"] = entry
                    routed[f"{name}.modules_to_save.*"] = entry
                else:
                    routed[name] = entry
            continue
        lora = [n for n in matched if is_lora_layer(modules[n])]
        if not lora:
            routed[glob] = entry
            continue
        if entry.style not in ("colwise", "rowwise"):
            raise TensorParallelError(
                f"{lora[0]} is a PEFT LoRA layer: style {entry.style!r} does not fit it; LoRA layers around "
                "nn.Linear take colwise or rowwise"
            )
        for name in lora:
            _check_plain_lora(name, modules[name])
        if len(lora) == len(matched):
            routed.update(_route(glob, entry))
            continue
        for name in matched:  # some matches carry adapters, some not (layers_to_transform)
            routed.update(_route(name, entry) if name in lora else {name: entry})
    return routed


def rowwise_lora_layers(root: nn.Module, assignments: list) -> list[str]:
    """Names of the LoRA layers whose base layer an assignment makes row-parallel."""
    parents = [a.name.rpartition(".")[0] for a in assignments if a.entry.style == "rowwise" and a.name.endswith(".base_layer")]
    return [p for p in parents if is_lora_layer(root.get_submodule(p))]


def shard_lora_dropout(root: nn.Module, rowwise_layers: list[str], rng: TPRandom) -> None:
    """Dropout of an adapter whose base is row-parallel acts on this rank's input features: draw
    its mask from the per-rank stream, as each rank holds different features."""
    for name in rowwise_layers:
        dropouts = root.get_submodule(name).lora_dropout
        for key, dropout in dropouts.items():
            if type(dropout) is nn.Dropout:
                dropouts[key] = ShardedDropout(dropout.p, dropout.inplace, rng)
