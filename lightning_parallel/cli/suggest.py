"""Every command line `lp-train` and `lp-plan` print, tried before it is printed.

A refusal's fixes (``errors.Fix``), the "did you mean" of a mistyped key and the "train with
it" of ``lp-plan --search`` become whole command lines: the user's own overrides with the fix
merged in (it replaces an override of the same key, and gets a ``+`` where the config lacks the
key, as Hydra requires), composed again and run through the checks of a launch. Only lines that
pass are printed, so each works as pasted. Imports only Hydra; the checks are passed in.
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

from lightning_parallel.errors import Fix, hydra_value, lead_in_dropped

# overrides -> the error that launch would raise, or None when it passes every check
Check = Callable[[list[str]], Optional[Exception]]


def has_key(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` (dotted) is in ``cfg``, set or not (``???``): Hydra then takes it without ``+``."""
    *parents, last = key.split(".")
    node: Any = cfg
    for part in parents:
        node = node.get(part) if part in node.keys() else None
        if not isinstance(node, DictConfig):
            return False
    return last in node.keys()


def with_settings(overrides: Sequence[str], settings: Mapping[str, Any], cfg: DictConfig) -> list[str]:
    """``overrides`` with ``settings`` applied: an override of the same key takes the new value (and
    keeps its ``+``); a new key is appended, with ``+`` unless ``cfg`` has it."""
    merged = list(overrides)
    parsed = OverridesParser.create().parse_overrides(merged) if merged else []
    for key, value in settings.items():
        text = f"{key}={hydra_value(value)}"
        at = next((i for i, o in enumerate(parsed) if o.key_or_group == key and not o.is_delete()), None)
        if at is None:
            merged.append(text if has_key(cfg, key) else f"+{text}")
        else:
            merged[at] = re.match(r"\+*", merged[at]).group() + text
    return merged


def command_line(prog: str, overrides: Sequence[str]) -> str:
    """``prog`` and ``overrides`` as a shell reads them back."""
    return " ".join([prog, *map(shlex.quote, overrides)])


def _sbatch(settings: Mapping[str, Any]) -> str:
    if "trainer.num_nodes" not in settings:
        return ""
    return f"   (sbatch --nodes={settings['trainer.num_nodes']} --ntasks-per-node={settings['trainer.devices']})"


def verified_lines(prog: str, overrides: Sequence[str], fixes: Sequence[Fix], cfg: DictConfig, check: Check,
                   per_why: int = 3) -> list[str]:
    """The command lines of ``fixes`` (at most ``per_why`` alike) whose launch passes ``check``."""
    lines, seen, alike = [], set(), Counter()
    for fix in fixes:
        fixed = with_settings(overrides, fix.settings, cfg)
        if alike[fix.why] >= per_why or tuple(fixed) in seen or check(fixed) is not None:
            continue
        seen.add(tuple(fixed))
        alike[fix.why] += 1
        lines.append(f"    {command_line(prog, fixed)}{_sbatch(fix.settings)}" + (f"   # {fix.why}" if fix.why else ""))
    return lines


def explained(problem: str, prog: str, overrides: Sequence[str], fixes: Sequence[Fix], cfg: DictConfig,
              check: Check) -> str:
    """``problem`` and the launches among ``fixes`` that pass every check."""
    lines = verified_lines(prog, overrides, fixes, cfg, check)
    if not lines:
        return lead_in_dropped(problem)
    return "\n".join([lead_in_dropped(problem), "Launches that pass every check:", *lines])
