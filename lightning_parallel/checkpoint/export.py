"""``lp-export``: the Hugging Face model a checkpoint's LightningModule holds, in ``save_pretrained`` layout.

From a checkpoint of any layout (``tensors.py``) and the record of the module's Hugging Face models
(``hf_models.py``), the model is rebuilt on the meta device and written as transformers'
``save_pretrained`` writes it, one tensor at a time:

1. the names and files are planned on the meta device with transformers' own save steps: tied
   weights dropped as ``save_pretrained`` drops them, its weight conversions reverted (transformers
   5 keeps, for example, the experts of a mixture-of-experts layer fused in memory and splits them
   back per expert on saving), shards cut by ``huggingface_hub.split_torch_state_dict_into_shards``
   at ``save_pretrained``'s default size;
2. which checkpoint tensors each saved tensor comes from is traced on the meta device too
   (``trace_sources``): a saved tensor is produced by reading only those, converting them, and
   writing it at once (``safetensors_file.py``), so the peak memory is about the largest group of
   tensors converted together (one tensor for most models; a fused expert tensor and its per-expert
   parts for a mixture of experts).

Under PEFT the adapter is written as PEFT's adapter folder by PEFT's own ``save_pretrained`` (the
adapter tensors only, read from the checkpoint), or with ``merge`` folded into the base weights by
each LoRA layer's own ``merge``, layer by layer, and written as a plain model folder.
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch.overrides import TorchFunctionMode

from lightning_parallel.checkpoint.hf_models import RECORD_KEY, HFModel
from lightning_parallel.checkpoint.safetensors_file import Spec, write_safetensors
from lightning_parallel.checkpoint.tensors import CheckpointTensors
from lightning_parallel.compat import hf_save_steps, tree_flatten
from lightning_parallel.errors import CheckpointError


class ExportError(CheckpointError, ValueError):
    """The checkpoint cannot be exported as asked; the message says what would work."""


# ---- which inputs each output comes from (meta device) --------------------------------------------
class _Provenance(TorchFunctionMode):
    """Tags every tensor a torch function returns with the union of its tensor inputs' tags."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        sources = set().union(*(getattr(t, "_lp_sources", ()) for t in tree_flatten((args, kwargs))[0]
                                if isinstance(t, torch.Tensor)))
        if sources:
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor):
                    t._lp_sources = sources | getattr(t, "_lp_sources", set())
        return result


def trace_sources(fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                  specs: dict[str, Spec]) -> dict[str, tuple[Spec, frozenset[str]]]:
    """Run ``fn`` on meta tensors of ``specs``; for each tensor it returns, its shape, dtype and the
    names of the inputs it was computed from."""
    inputs = {}
    for name, (shape, dtype) in specs.items():
        inputs[name] = torch.empty(shape, dtype=dtype, device="meta")
        inputs[name]._lp_sources = {name}
    with _Provenance():
        outputs = fn(inputs)
    return {name: ((tuple(t.shape), t.dtype), frozenset(getattr(t, "_lp_sources", ()))) for name, t in outputs.items()}


def _groups(traced: dict[str, tuple[Spec, frozenset[str]]]) -> dict[str, frozenset[str]]:
    """For each output, the inputs of its group: outputs that share an input are produced together."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for name, (_, sources) in traced.items():
        if not sources:
            raise ExportError(f"{name}: transformers' save steps made it from no tensor of the checkpoint")
        first, *rest = sorted(sources)
        for other in rest:
            parent[root(other)] = root(first)
        root(first)
    members: dict[str, set[str]] = {}
    for name in parent:
        members.setdefault(root(name), set()).add(name)
    return {name: frozenset(members[root(min(sources))]) for name, (_, sources) in traced.items()}


# ---- where the model's tensors come from -----------------------------------------------------------
@dataclass
class Source:
    """The model's state dict, by its own names: each tensor's spec and how to read it."""

    specs: dict[str, Spec]
    read: Callable[[str], torch.Tensor]


def _names_by_object(model: torch.nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, t in chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    return names


def checkpoint_source(model: torch.nn.Module, tensors: CheckpointTensors, prefix: str) -> Source:
    """``model``'s tensors read from the checkpoint under ``prefix``; a tied weight from whichever of
    its names the checkpoint holds. Raises ``ExportError`` when a tensor is missing or of another shape."""
    aliases = {n: names for names in _names_by_object(model).values() for n in names}
    where, missing, wrong = {}, [], []
    for key, value in model.state_dict().items():
        held = [prefix + n for n in aliases.get(key, [key]) if prefix + n in tensors.specs]
        if not held:
            missing.append(key)
        elif tensors.specs[held[0]][0] != tuple(value.shape):
            wrong.append(f"{key}: shape {list(tensors.specs[held[0]][0])} in the checkpoint, {list(value.shape)} "
                         "in the model its config describes")
        else:
            where[key] = held[0]
    if missing or wrong:
        problems = [f"{k}: not in the checkpoint (looked for {prefix}{k})" for k in missing[:5]] + wrong[:5]
        raise ExportError(f"the checkpoint does not hold the {type(model).__name__} its config describes:\n  "
                          + "\n  ".join(problems))
    return Source({k: tensors.specs[w] for k, w in where.items()}, lambda k: tensors.read(where[k]))


def merged_source(hf: HFModel, tensors: CheckpointTensors) -> tuple[Any, Source]:
    """The base model with the active LoRA adapters merged (on the meta device), and its tensors:
    each LoRA layer's base weights merged by that layer's own ``merge`` on the checkpoint's values
    (as ``merge_and_unload`` does), trained copies of ``modules_to_save`` in place of the originals."""
    from peft.tuners.lora import LoraLayer

    not_lora = {name: config["peft_type"] for name, config in hf.adapters.items()
                if name in hf.active and config["peft_type"] != "LORA"}
    if not_lora:
        raise ExportError(f"--merge folds LoRA adapters only; {hf.name!r} has active adapters of other types "
                          f"({not_lora}): export without --merge (PEFT's adapter folder) and merge with PEFT")
    peft = hf.meta_peft_model()
    unmerged = copy.deepcopy(peft)
    source = checkpoint_source(unmerged, tensors, hf.peft_prefix)
    layers = {name + ".base_layer.": module for name, module in unmerged.named_modules()
              if isinstance(module, LoraLayer)}
    first_name = {t_id: names[0] for t_id, names in _names_by_object(peft).items()}
    merged = peft.merge_and_unload()
    origin = {n: first_name[t_id] for t_id, names in _names_by_object(merged).items() for n in names}
    done: dict[str, torch.Tensor] = {}

    def read(key: str) -> torch.Tensor:
        name = origin[key]
        if name in done:
            return done.pop(name)
        layer_prefix = next((p for p in layers if name.startswith(p)), None)
        if layer_prefix is None:
            return source.read(name)
        layer = copy.deepcopy(layers[layer_prefix])
        stem = layer_prefix[: -len("base_layer.")]
        layer.load_state_dict({k: source.read(stem + k).clone() for k in layer.state_dict()}, assign=True)
        layer.merge()
        done.update({layer_prefix + k: v for k, v in layer.base_layer.state_dict().items()})
        return done.pop(name)

    state = merged.state_dict()
    return merged, Source({k: source.specs[origin[k]] for k in state}, read)


# ---- writing ----------------------------------------------------------------------------------------
def default_max_shard_size() -> Union[int, str]:
    """``save_pretrained``'s own default, read from its signature."""
    from transformers import PreTrainedModel

    return inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default


def write_model(folder: Path, model: Any, source: Source, max_shard_size: Union[int, str]) -> list[str]:
    """Write ``model`` (on the meta device) with the values of ``source`` into ``folder`` as
    ``save_pretrained`` lays it out; return the files written."""
    from huggingface_hub import split_torch_state_dict_into_shards

    remove_tied_weights, revert_weight_conversion = hf_save_steps()
    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        state.pop(key, None)
    kept = remove_tied_weights(state, model)
    traced = trace_sources(lambda inputs: revert_weight_conversion(model, inputs), {k: source.specs[k] for k in kept})
    groups = _groups(traced)
    specs = {name: spec for name, (spec, _) in traced.items()}
    split = split_torch_state_dict_into_shards(
        {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in specs.items()},
        filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    pending: dict[str, torch.Tensor] = {}

    def produce(name: str) -> torch.Tensor:
        if name not in pending:
            inputs = {k: source.read(k) for k in sorted(groups[name])}
            pending.update(revert_weight_conversion(model, inputs))
        return pending.pop(name)

    folder.mkdir(parents=True, exist_ok=True)
    for file, names in split.filename_to_tensors.items():
        write_safetensors(folder / file, {n: specs[n] for n in names}, produce, {"format": "pt"})
    written = list(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append("model.safetensors.index.json")
    floating = next(source.specs[n][1] for n, p in model.named_parameters() if p.is_floating_point())
    model.config.dtype = str(floating).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    written.insert(0, "config.json")
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
        written.insert(1, "generation_config.json")
    return written


def write_adapters(folder: Path, hf: HFModel, tensors: CheckpointTensors) -> list[str]:
    """Write the PEFT adapters of ``hf`` as PEFT's ``save_pretrained`` does (the first adapter in
    ``folder``, any other in a sub-folder of its name), reading only the adapter tensors."""
    from peft import get_peft_model_state_dict

    peft = hf.meta_peft_model()
    source = checkpoint_source(peft, tensors, hf.peft_prefix)
    needed: set[str] = set()
    for adapter in hf.adapters:
        traced = trace_sources(lambda state, adapter=adapter: get_peft_model_state_dict(
            peft, state_dict=state, adapter_name=adapter), source.specs)
        needed |= {name for _, sources in traced.values() for name in sources}
    peft.save_pretrained(folder, state_dict={name: source.read(name) for name in sorted(needed)})
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


# ---- choosing the model -------------------------------------------------------------------------------
def choose_model(tensors: CheckpointTensors, module: Optional[str], config: Optional[Path]) -> tuple[HFModel, str]:
    """The Hugging Face model to export and where its description came from."""
    record = tensors.extra.get(RECORD_KEY)
    if record is None:
        if config is None:
            raise ExportError(f"{tensors.path} was not saved by ParallelStrategy, so it does not record the Hugging "
                              "Face models its module holds: give --config FOLDER, a folder with the model's "
                              "config.json (e.g. the pretrained folder the run started from)")
        return _from_config_folder(tensors, module, config), f"described by {config / 'config.json'} (--config)"
    if not record:
        raise ExportError(f"the module saved in {tensors.path} holds no Hugging Face model (transformers "
                          "PreTrainedModel), so there is nothing to write in Hugging Face format; for a plain "
                          "Lightning checkpoint of the whole module use: lp-consolidate CKPT OUT.ckpt")
    if module is None and len(record) > 1:
        raise ExportError(f"the module holds {len(record)} Hugging Face models: {', '.join(record)}; "
                          "pick one with --module NAME")
    name = module if module is not None else next(iter(record))
    if name not in record:
        raise ExportError(f"--module {name}: the module holds no Hugging Face model there; "
                          f"it holds: {', '.join(record)}")
    note = " (--config is not needed: the checkpoint records the model)" if config is not None else ""
    return HFModel.from_record(name, record[name]), f"recorded in the checkpoint{note}"


def _from_config_folder(tensors: CheckpointTensors, module: Optional[str], folder: Path) -> HFModel:
    """The model of ``folder/config.json``, found in a checkpoint without record by its tensor names."""
    if not (folder / "config.json").is_file():
        raise ExportError(f"--config {folder}: no config.json there; give the folder save_pretrained wrote")
    hf = HFModel.from_folder(folder)
    model = hf.meta_model()
    key = next(iter(model.state_dict()))
    prefixes = sorted({n[: -len(key)] for n in tensors.specs
                       if n.endswith(key) and (n == key or n[-len(key) - 1] == ".")})
    if module is not None:
        prefixes = [p for p in prefixes if p == module + "."]
    if not prefixes:
        where = f"under {module}." if module is not None else "anywhere"
        raise ExportError(f"the checkpoint holds no tensors of the {hf.model_class} of {folder} {where} "
                          f"(looked for ...{key}); a module holding PEFT adapters needs the record ParallelStrategy "
                          "saves with its checkpoints")
    if len(prefixes) > 1:
        raise ExportError(f"the checkpoint holds {len(prefixes)} models of this config: "
                          f"{', '.join(p[:-1] for p in prefixes)}; pick one with --module NAME")
    hf.prefix, hf.name = prefixes[0], prefixes[0][:-1]
    return hf


def export(checkpoint: Path, folder: Path, module: Optional[str] = None, config: Optional[Path] = None,
           merge: bool = False, max_shard_size: Optional[Union[int, str]] = None) -> str:
    """Write the chosen Hugging Face model of ``checkpoint`` into ``folder``; return what was written."""
    if folder.exists() and any(folder.iterdir()):
        raise ExportError(f"{folder} is not empty: give a new or empty folder")
    tensors = CheckpointTensors(checkpoint)
    hf, described = choose_model(tensors, module, config)
    if merge and not hf.has_adapters:
        raise ExportError(f"--merge: {hf.name!r} has no PEFT adapters to merge; export it without --merge")
    size = max_shard_size if max_shard_size is not None else default_max_shard_size()
    if hf.has_adapters and not merge:
        files = write_adapters(folder, hf, tensors)
        load = f"PeftModel.from_pretrained(base_model, {str(folder)!r})"
        what = f"the PEFT adapters {', '.join(hf.adapters)} of {hf.name!r}"
    else:
        if hf.has_adapters:
            model, source = merged_source(hf, tensors)
            what = f"{hf.name!r} with its adapters {', '.join(hf.active)} merged"
        else:
            model = hf.meta_model()
            source = checkpoint_source(model, tensors, hf.prefix)
            what = f"{hf.name!r}"
        files = write_model(folder, model, source, size)
        what = f"{type(model).__name__} {what}"
        load = f"{type(model).__name__}.from_pretrained({str(folder)!r})"
    return f"wrote {what} ({described}) to {folder}: {', '.join(files)}\nload it with {load}"
