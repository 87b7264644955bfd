"""The Hugging Face models a LightningModule holds, recorded in its checkpoint so that ``lp-export``
can write them back in ``save_pretrained`` layout from the checkpoint alone.

``describe(module)`` runs when ``ParallelStrategy`` saves a checkpoint (every layout: the record is
small and the same on every rank). For each outermost ``transformers.PreTrainedModel`` inside the
module it keeps what rebuilding the model without its weights needs: where its tensors sit in the
module's state dict (``model.``; under PEFT ``model.base_model.model.``), its class, its config and
generation config as the JSON ``save_pretrained`` writes, and, when a ``peft.PeftModel`` wraps it,
each adapter's config and the active adapters. ``HFModel`` turns a record back into those objects
and builds the model on the meta device (no memory for weights). A checkpoint saved by another
strategy has no record: ``HFModel.from_folder`` reads the same from a folder with ``config.json``.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

#: the checkpoint key under which ``describe``'s record is saved
RECORD_KEY = "hugging_face_models"


def describe(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``name -> record`` of every outermost Hugging Face model in ``module``; ``name`` is its
    attribute path (the PEFT wrapper's, when one wraps it). Nothing is imported: without
    ``transformers`` loaded, the module holds no such model."""
    if "transformers" not in sys.modules:
        return {}
    from transformers import PreTrainedModel

    peft_model = getattr(sys.modules.get("peft"), "PeftModel", None)
    found: dict[str, dict[str, Any]] = {}

    def walk(prefix: str, node: nn.Module, wrapper: Optional[tuple[str, Any]]) -> None:
        for child_name, child in node.named_children():
            path = prefix + child_name
            if peft_model is not None and isinstance(child, peft_model):
                walk(path + ".", child, (path, child))
            elif isinstance(child, PreTrainedModel):
                found[wrapper[0] if wrapper else path] = _record(path + ".", child, wrapper)
            else:
                walk(path + ".", child, wrapper)

    walk("", module, None)
    return found


def _record(prefix: str, model: Any, wrapper: Optional[tuple[str, Any]]) -> dict[str, Any]:
    generation = getattr(model, "generation_config", None) if model.can_generate() else None
    record = {
        "prefix": prefix,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": _as_json(model.config),
        "generation_config": None if generation is None else _as_json(generation),
        "peft": None,
    }
    if wrapper is not None:
        path, peft = wrapper
        record["peft"] = {
            "prefix": path + ".",
            "adapters": {name: _json_safe(config.to_dict()) for name, config in peft.peft_config.items()},
            "active": list(peft.active_adapters),
        }
    return record


def _as_json(config: Any) -> dict[str, Any]:
    """A transformers config (model or generation) as the JSON its ``save_pretrained`` writes, every value."""
    return json.loads(config.to_json_string(use_diff=False))


def _json_safe(config: dict[str, Any]) -> dict[str, Any]:
    """A PEFT config dict as its ``save_pretrained`` writes it (sets as lists), through JSON."""
    return json.loads(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}))


@dataclass
class HFModel:
    """One recorded Hugging Face model: enough to rebuild it on the meta device and name its tensors.

    prefix: where its tensors sit in the LightningModule's state dict.
    adapters, active, peft_prefix: the PEFT adapters' configs by name, the active ones, and where the
        ``PeftModel``'s own state dict keys start; empty when no PEFT model wraps it.
    """

    name: str
    prefix: str
    model_class: str
    config: dict[str, Any]
    generation_config: Optional[dict[str, Any]] = None
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)
    active: list[str] = field(default_factory=list)
    peft_prefix: str = ""

    @classmethod
    def from_record(cls, name: str, record: dict[str, Any]) -> "HFModel":
        peft = record.get("peft") or {}
        return cls(name, record["prefix"], record["class"], record["config"], record.get("generation_config"),
                   peft.get("adapters", {}), peft.get("active", []), peft.get("prefix", ""))

    @classmethod
    def from_folder(cls, folder: Path, name: str = "", prefix: str = "") -> "HFModel":
        """The model described by ``folder/config.json`` (and ``generation_config.json`` when present),
        whose tensors sit under ``prefix``; its class is the config's first ``architectures`` entry."""
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(folder)
        if not config.architectures:
            raise ValueError(f"{folder / 'config.json'} names no model class (\"architectures\"): "
                             "give the folder save_pretrained wrote for the model")
        model_class = f"transformers.{config.architectures[0]}"
        generation = None
        if (folder / "generation_config.json").is_file():
            generation = _as_json(GenerationConfig.from_pretrained(folder))
        return cls(name, prefix, model_class, _as_json(config), generation)

    @property
    def has_adapters(self) -> bool:
        return bool(self.adapters)

    def model_type(self) -> type:
        module, _, name = self.model_class.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"the model class {self.model_class} of {self.name!r} cannot be imported ({err}): "
                             "install the transformers version (or the package) it was trained with") from err

    def meta_model(self) -> Any:
        """The model, built from its config on the meta device, with its generation config."""
        from transformers import GenerationConfig

        model_type = self.model_type()
        config = model_type.config_class.from_dict(self.config)
        with torch.device("meta"):
            model = model_type(config)
        if self.generation_config is not None and model.can_generate():
            model.generation_config = GenerationConfig.from_dict(self.generation_config)
        return model

    def meta_peft_model(self) -> Any:
        """The PEFT model the module held: ``meta_model`` wrapped with every adapter, the active ones set."""
        from peft import PeftConfig, get_peft_model

        configs = {name: PeftConfig.from_peft_type(**config) for name, config in self.adapters.items()}
        first, *others = configs
        model = get_peft_model(self.meta_model(), configs[first], adapter_name=first)
        for name in others:
            model.add_adapter(name, configs[name])
        model.base_model.set_adapter(self.active[0] if len(self.active) == 1 else self.active)
        return model
