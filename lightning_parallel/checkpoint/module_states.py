"""Where a checkpoint holds module-shaped state dicts besides ``state_dict``, and how to take them out.

Lightning's ``WeightAveraging`` moves the module's weights to ``current_model_state`` and puts their
average in ``state_dict``; ``StochasticWeightAveraging`` keeps its averaged copy's state dict in its own
callback entry (``callbacks[<key>]["average_model_state"]``). On a split model each rank holds its part
of each, under the module's names, so a sharded checkpoint writes them like ``state_dict``, split like
the model (``io.py``, ``dcp.py``), and records their places here. Pure logic, no process group.
"""

from __future__ import annotations

from typing import Any

Place = tuple[str, ...]


def places(checkpoint: dict[str, Any]) -> list[Place]:
    """The places of the module-shaped state dicts in Lightning's ``checkpoint``, in a fixed order."""
    found: list[Place] = []
    if isinstance(checkpoint.get("current_model_state"), dict):
        found.append(("current_model_state",))
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if isinstance(state, dict) and isinstance(state.get("average_model_state"), dict):
            found.append(("callbacks", key, "average_model_state"))
    return found


def at(tree: dict[str, Any], place: Place) -> Any:
    for key in place:
        tree = tree[key]
    return tree


def replaced(tree: dict[str, Any], place: Place, value: Any) -> dict[str, Any]:
    """A copy of ``tree`` with ``value`` at ``place``; only the dicts along ``place`` are copied."""
    head, *tail = place
    return {**tree, head: replaced(tree[head], tuple(tail), value) if tail else value}
