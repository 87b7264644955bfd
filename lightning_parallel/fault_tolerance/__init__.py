"""Fault tolerance across replica groups, on torchft (github.com/pytorch/torchft).

A run is made of ``replica_groups`` launches, each one replica group with any layout inside (DP, TP,
PP), meeting at a quorum server (``lp-lighthouse``). Every step the groups alive form a quorum, average
their gradients over it, and commit the step only if every one of them computed it; a group that dies
drops out of the next quorum and the others train on at the smaller global batch, and a group started
again copies the model, optimizer and step of a live group before its first step, reading no
checkpoint. The quorum, the commit and the live copy are torchft's (its per-step quorum, as in
torchft's README and ``Manager``); this package connects them to Lightning's training step.

- ``groups.py``: ``ReplicaGroups``, this launch's membership (a ``torchft.Manager`` per rank) and the
  step it wraps (quorum, cross-group average, commit);
- ``state.py``: what a restarted group copies from a live one (pure Lightning, no torchft);
- ``lighthouse.py``: the quorum server ``lp-lighthouse`` starts.
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.errors import ConfigurationError

INSTALL = "pip install 'lightning-parallel[ft]' (torchft)"


def require_torchft() -> Any:
    """The ``torchft`` module, or an error that says how to install it."""
    try:
        import torchft
    except ImportError as err:
        raise ConfigurationError(f"replica_groups > 1 runs on torchft, which is not installed: {INSTALL}") from err
    return torchft
