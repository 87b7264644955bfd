"""Fabric's checkpoint state, in the form of the checkpoints the Trainer strategy writes and reads.

``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})`` hands a dict of objects;
the sharded checkpoint code (``checkpoint/io.py``: Distributed Checkpoint directories that resume on
any layout) takes Lightning's dict: ``state_dict``, ``optimizer_states`` (one per optimizer of the
strategy, in order) and the rest. ``to_lightning`` turns the first into the second, recording under
``FABRIC_KEY`` which key held the model and each optimizer; ``restore`` does the opposite on a
checkpoint read back. The module's and optimizers' tensors themselves are read and written by the
Trainer strategy's code, so both front ends write the same directories.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

FABRIC_KEY = "fabric"


def _roles(state: dict[str, Any], module: nn.Module, optimizers: list[Optimizer]) -> tuple[str, dict[str, int]]:
    """The key of the set-up module and, by key, the index of each set-up optimizer in ``state``."""
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    if modules != [k for k, v in state.items() if v is module] or len(modules) != 1:
        raise ValueError("the checkpoint state must hold the model set up by this Fabric strategy, once, and no other "
                         f"module (got modules under {modules}): save and load one model per checkpoint")
    given = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
    index = {id(opt): i for i, opt in enumerate(optimizers)}
    unknown = [k for k, opt in given.items() if id(opt) not in index]
    if unknown:
        raise ValueError(f"the optimizers under {unknown} were not set up by this Fabric strategy; set them up with "
                         "fabric.setup(model, optimizer) or fabric.setup_optimizers(optimizer) first")
    if given and len(given) != len(optimizers):
        raise ValueError(f"the checkpoint state holds {len(given)} of the {len(optimizers)} optimizers set up; "
                         "save and load all of them, or none")
    return modules[0], {k: index[id(opt)] for k, opt in given.items()}


def to_lightning(state: dict[str, Any], module: nn.Module, optimizers: list[Optimizer],
                 optimizer_state: Callable[[Optimizer], dict]) -> dict[str, Any]:
    """Lightning's checkpoint dict for Fabric's ``state``; ``optimizer_state``: the strategy's, which
    knows ZeRO-1's slices."""
    module_key, optimizer_keys = _roles(state, module, optimizers)
    others = {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in state.items()
              if k != module_key and k not in optimizer_keys}
    checkpoint: dict[str, Any] = {"state_dict": module.state_dict(),
                                  FABRIC_KEY: {"module": module_key, "optimizers": optimizer_keys, "state": others}}
    if optimizer_keys:
        checkpoint["optimizer_states"] = [optimizer_state(opt) for opt in optimizers]
    return checkpoint


def restore(checkpoint: dict[str, Any], state: dict[str, Any], module: nn.Module, optimizers: list[Optimizer],
            load_optimizers: Callable[[dict[str, Any]], None], strict: bool) -> dict[str, Any]:
    """Load ``checkpoint`` (Lightning's dict, this rank's part) into ``state``'s objects, as Fabric's own
    ``Strategy.load_checkpoint`` does: the module, the optimizers (``load_optimizers``: the strategy's),
    ``_Stateful`` objects; other values are replaced in ``state``. Returns what ``state`` did not ask for.
    A checkpoint the Trainer wrote has its other values at the top level."""
    module_key, optimizer_keys = _roles(state, module, optimizers)
    saved = checkpoint.get(FABRIC_KEY, {})
    rest = dict(saved.get("state", {k: v for k, v in checkpoint.items()
                                     if k not in ("state_dict", "optimizer_states", FABRIC_KEY)}))
    others = [k for k in state if k != module_key and k not in optimizer_keys]
    missing = [k for k in others if k not in rest]
    if optimizer_keys and "optimizer_states" not in checkpoint:
        missing += list(optimizer_keys)
    if strict and missing:
        raise KeyError(f"the checkpoint holds no {missing}; load with strict=False to skip them")
    module.load_state_dict(checkpoint["state_dict"], strict=strict)
    if optimizer_keys and "optimizer_states" in checkpoint:
        load_optimizers(checkpoint)
    for key in others:
        if key not in rest:
            continue
        if isinstance(state[key], _Stateful):
            state[key].load_state_dict(rest.pop(key))
        else:
            state[key] = rest.pop(key)
    return rest
