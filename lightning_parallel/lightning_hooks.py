"""What the package adds to Lightning as soon as ``lightning.pytorch`` is imported (``extend_lightning``).

- The strategy names ``lp_dp``, ``lp_tp``, ``lp_pp`` and ``lp_3d`` in Lightning's ``StrategyRegistry``,
  so ``Trainer(strategy="lp_tp")`` works, and in Fabric's ``STRATEGY_REGISTRY`` (``Fabric(strategy="lp_tp")``,
  the front ends of ``lightning_parallel.fabric``); each builds its class on first use.
- Lightning's checkpoint reader (``cloud_io._load``, bound as ``pl_load`` where Lightning reads a
  ``load_from_checkpoint`` path and a Trainer's ``ckpt_path``) loads a sharded checkpoint directory
  written by ``ParallelStrategy`` as its consolidated checkpoint, so one device reads it unchanged.

Nothing here imports Lightning or the rest of the package at module level: the hook runs while
Lightning itself is still being imported.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any, Callable, Optional

# registered name -> (class in lightning_parallel.strategy, description)
STRATEGY_NAMES = {
    "lp_dp": ("DataParallelStrategy", "data parallelism with bucketed, overlapped all-reduce"),
    "lp_tp": ("TensorParallelStrategy", "Megatron-style tensor parallelism over all devices"),
    "lp_pp": ("PipelineParallelStrategy", "pipeline parallelism (1F1B) over all devices"),
    "lp_3d": ("ParallelStrategy", "data x tensor x pipeline parallelism"),
}

#: Where Lightning binds its checkpoint reader ``cloud_io._load`` (``pl_load``): ``load_from_checkpoint``
#: reads through ``core/saving.py``, a Trainer's ``ckpt_path`` through ``TorchCheckpointIO``.
CHECKPOINT_READERS = (
    ("lightning.fabric.utilities.cloud_io", "_load"),
    ("lightning.pytorch.core.saving", "pl_load"),
    ("lightning.fabric.plugins.io.torch_io", "pl_load"),
)


def extend_lightning() -> None:
    """Register the strategy names; let Lightning's checkpoint reader load sharded directories."""
    register_strategy_names()
    read_checkpoint_directories(_load_directory)


def _strategy_factory(class_name: str, module: str = "lightning_parallel.strategy") -> Callable[..., Any]:
    """Builds the strategy on first use, so registering imports nothing of ours."""

    def build(**kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), class_name)(**kwargs)

    return build


def register_strategy_names() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (class_name, description) in STRATEGY_NAMES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, _strategy_factory(class_name), description=description)
        if name not in STRATEGY_REGISTRY:  # the Fabric front end of the same class (lightning_parallel.fabric)
            STRATEGY_REGISTRY.register(name, _strategy_factory("Fabric" + class_name, "lightning_parallel.fabric"),
                                       description=description)


def _load_directory(path: Path, map_location: Any, weights_only: Optional[bool]) -> Optional[dict]:
    """``checkpoint.consolidate.load_directory``, imported when Lightning first reads a directory."""
    from lightning_parallel.checkpoint.consolidate import load_directory

    return load_directory(path, map_location, weights_only)


def read_checkpoint_directories(load_directory: Callable[[Path, Any, Optional[bool]], Optional[dict]]) -> None:
    """Make Lightning's checkpoint reader try ``load_directory(path, map_location, weights_only)`` first
    on a local directory, and read as before where it returns None (anything else). Idempotent."""
    for module_name, attribute in CHECKPOINT_READERS:
        module = importlib.import_module(module_name)
        original = getattr(module, attribute)
        if getattr(original, "_lp_reads_directories", False):
            continue

        @functools.wraps(original)
        def load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None,
                 _original: Callable = original) -> Any:
            if isinstance(path_or_url, (str, Path)) and "://" not in str(path_or_url) and Path(path_or_url).is_dir():
                loaded = load_directory(Path(path_or_url), map_location, weights_only)
                if loaded is not None:
                    return loaded
            return _original(path_or_url, map_location=map_location, weights_only=weights_only)

        load._lp_reads_directories = True  # type: ignore[attr-defined]
        setattr(module, attribute, load)
