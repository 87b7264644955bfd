"""Command-line overrides of `lp-train` and `lp-plan`: composing them, and finding a mistyped key.

Hydra answers `trainer.max_step=10` with "Key 'max_step' is not in struct ... To append to your
config use +trainer.max_step=10", which invites the user to add a key no code reads. This module
finds the override that fails, and when it names a key that is one edit away from an existing
one, gives the overrides with that key instead (``cli/entry.py`` answers "did you mean"). Imports
only Hydra, so it runs before anything slow.
"""

from __future__ import annotations

import difflib
from typing import Optional

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import DictConfig


def compose_config(overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """The `lp-train` config with ``overrides`` (and the ``hydra`` node, which names the option chosen
    in each group, if ``with_hydra``); inside a running Hydra app, with that app's search path."""
    if GlobalHydra.instance().is_initialized():
        return compose("train", overrides=overrides, return_hydra_config=with_hydra)
    with initialize_config_module("lightning_parallel.conf", version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=with_hydra)


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


def split_flags(argv: list[str]) -> Optional[tuple[list[str], list[str]]]:
    """``(flags, overrides)`` of an ordinary run (``--cfg job`` counts as a flag); None for flags that
    change what is composed or run (``--multirun``, ``--config-dir``, ...)."""
    if any(a.startswith("-") and a not in ("--cfg", "-c") for a in argv):
        return None
    flags, overrides = [], list(argv)
    for flag in ("--cfg", "-c"):
        if flag in overrides:
            at = overrides.index(flag)
            flags += overrides[at : at + 2]
            del overrides[at : at + 2]
    return flags, overrides


def mistyped_key(overrides: list[str]) -> Optional[tuple[str, str, list[str]]]:
    """``(key, nearest key, overrides with it)`` when an override sets a key the config lacks and
    another is one edit or so away; None otherwise.

    Composes the config (a fraction of a second); only when that fails is the failing override
    looked for, one composition per override.
    """
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
        return key, match, [*overrides[:i], overrides[i].replace(key, match, 1), *overrides[i + 1 :]]
    return None
