"""Command-line overrides of `lp-train` and `lp-plan`: composing them, and naming a mistyped key.

Hydra answers `trainer.max_step=10` with "Key 'max_step' is not in struct ... To append to your
config use +trainer.max_step=10", which invites the user to add a key no code reads. This module
finds the override that fails, and when it names a key that is one edit away from an existing
one, answers "did you mean trainer.max_steps" instead. Imports only Hydra, so it runs before
anything slow.
"""

from __future__ import annotations

import difflib
from typing import Optional

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import DictConfig


def compose_config(overrides: list[str]) -> DictConfig:
    """The `lp-train` config with ``overrides``; inside a running Hydra app, with that app's search path."""
    if GlobalHydra.instance().is_initialized():
        return compose("train", overrides=overrides)
    with initialize_config_module("lightning_parallel.conf", version_base="1.3"):
        return compose("train", overrides=overrides)


def nearest_key(cfg: DictConfig, key: str) -> Optional[str]:
    """``key`` with its first missing part replaced by a sibling one edit or so away; None if none is."""
    parts, node = key.split("."), cfg
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        if part in node:
            node = node._get_node(part)
            continue
        match = difflib.get_close_matches(part, [str(k) for k in node.keys()], n=1, cutoff=0.8)
        return ".".join(parts[:i] + match + parts[i + 1 :]) if match else None
    return None


def _plain_overrides(argv: list[str]) -> Optional[list[str]]:
    """The overrides of an ordinary run; None for flags that change what is composed or run."""
    if any(a.startswith("-") and a not in ("--cfg", "-c") for a in argv):
        return None
    overrides = list(argv)
    for flag in ("--cfg", "-c"):
        if flag in overrides:
            at = overrides.index(flag)
            del overrides[at : at + 2]
    return overrides


def suggest_for_unknown_keys(argv: list[str]) -> Optional[str]:
    """A "did you mean" message when an override sets a key the config lacks; None otherwise.

    Composes the config (a fraction of a second); only when that fails is the failing override
    looked for, one composition per override.
    """
    overrides = _plain_overrides(argv)
    if not overrides:
        return None
    try:
        compose_config(overrides)
        return None
    except ConfigCompositionException:
        pass
    except HydraException:  # a missing group option and the like: Hydra's own message lists the choices
        return None
    parsed = OverridesParser.create().parse_overrides(overrides)
    for i, override in enumerate(parsed):
        key = override.key_or_group
        if override.is_add() or override.is_delete() or override.is_force_add() or key.startswith("hydra"):
            continue
        try:
            compose_config(overrides[: i + 1])
            continue
        except ConfigCompositionException:
            pass
        match = nearest_key(compose_config(overrides[:i]), key)
        if match is None:  # the key exists and the value is wrong, or nothing is near: Hydra explains
            return None
        fixed = overrides[i].replace(key, match, 1)
        return (f"{key} is not a key of the config; did you mean {match}?\n    {fixed}\n"
                f"(to add a key the config does not have, on purpose: +{overrides[i]})")
    return None
