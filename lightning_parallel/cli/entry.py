"""What every `lp-*` command does first: one entry (``enter_command``), shared by `lp-train`, `lp-plan`,
`lp-consolidate` and `lp-export`.

- The folder the command runs in is importable, as ``python -m`` makes it: ``_target_:
  my_pkg.MyModule`` finds ``./my_pkg`` under every command, and so does a checkpoint that refers
  to the class.
- The overrides are read as `lp-train` reads them (``cli/overrides.py``: the package's
  ``train.yaml``), and two mistakes are answered before anything is built, with the command line
  that works, tried first (``cli/suggest.py``): a mistyped key ("did you mean
  trainer.max_steps?"), and a class of one's own put into a group's default config
  (``model._target_=my_pkg.MyModule`` without ``model=custom``, which would hand the default
  model's keys to that class's constructor).
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from lightning_parallel.cli.overrides import compose_config, mistyped_key
from lightning_parallel.cli.suggest import command_line
from lightning_parallel.errors import hydra_value

# the config groups that take a class of one's own, each with an empty option for it
OWN_CLASS_GROUPS = ("model", "data")


def enter_command(prog: str, overrides: Optional[list[str]] = None) -> None:
    """Make the current folder importable; with ``overrides`` (a command that takes `lp-train`'s),
    answer a mistake in them with the command that works and exit with status 2. ``prog`` is the
    command as typed before its overrides (``lp-plan --search --nodes 2``)."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    answer = None if not overrides else _answer(prog, overrides)
    if answer is not None:
        print(f"{prog.split()[0]}: {answer}", file=sys.stderr)
        sys.exit(2)


def _answer(prog: str, overrides: list[str]) -> Optional[str]:
    own = _own_class_in_default_config(overrides)  # first: its other arguments are no keys of the default
    if own is not None:
        message, fixed = own
        return _with_command(message, prog, fixed)
    mistyped = mistyped_key(overrides)
    if mistyped is not None:
        key, match, fixed = mistyped
        return _with_command(f"{key} is not a key of the config; did you mean {match}?", prog, fixed)
    return None


def _own_class_in_default_config(overrides: list[str]) -> Optional[tuple[str, list[str]]]:
    """(message, overrides that start from ``<group>=custom``) when ``<group>._target_`` names a class
    that does not take the other keys of the group's config; None otherwise."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    chosen = {o.key_or_group for o in parsed}
    for group in OWN_CLASS_GROUPS:
        at = next((i for i, o in enumerate(parsed) if o.key_or_group == f"{group}._target_" and not o.is_delete()),
                  None)
        if at is None or group in chosen:
            continue
        arguments = [i for i, o in enumerate(parsed) if o.key_or_group.startswith(f"{group}.") and i != at]
        try:  # without the class's own arguments, which the default config need not have
            cfg = compose_config([o for i, o in enumerate(overrides) if i not in arguments], with_hydra=True)
            built = get_object(cfg[group]._target_)
        except Exception:  # noqa: BLE001 - another mistake, or a class that does not import: explained later
            continue
        refused = _arguments_refused(built, [str(k) for k in cfg[group] if k != "_target_"])
        if not refused:
            continue
        fixed = list(overrides)
        for i in arguments:  # the empty config has no keys: every argument is added
            if not parsed[i].is_delete():
                fixed[i] = "+" + fixed[i].lstrip("+")
        fixed.insert(at, f"{group}=custom")
        # values of other groups that were read from this group's default (data.block_size: ${model.block_size})
        fixed += [f"{key}={hydra_value(value)}" for key, value in _borrowed(cfg, group).items()]
        option, target = cfg.hydra.runtime.choices.get(group), cfg[group]._target_
        more = f" and {len(refused) - 4} more" if len(refused) > 4 else ""
        return (f"{group}._target_={target} puts a class of your own into the {group} config {option!r}, whose "
                f"other keys reach its constructor too, and {getattr(built, '__name__', target)} takes no "
                f"{', '.join(refused[:4])}{more}. A class of your own starts from the empty config {group}=custom, "
                f"its arguments given with +:", fixed)
    return None


def _borrowed(cfg: DictConfig, group: str) -> dict[str, Any]:
    """``other.key -> value`` for the keys of other groups that interpolate ``${<group>.*}``."""
    found = {}
    for other in OWN_CLASS_GROUPS:
        if other == group:
            continue
        raw = OmegaConf.to_container(cfg[other], resolve=False)
        for key, value in raw.items():
            if isinstance(value, str) and "${" + group + "." in value:
                found[f"{other}.{key}"] = cfg[other][key]
    return found


def _arguments_refused(built, keys: list[str]) -> list[str]:
    """Those of ``keys`` that ``built``'s signature does not accept as keyword arguments."""
    try:
        parameters = inspect.signature(built).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    return [k for k in keys if k not in parameters]


def _with_command(message: str, prog: str, fixed: list[str]) -> str:
    """``message`` and the command line of ``fixed``; if that launch would be refused too, the refusal
    with its own fixes instead (only commands that pass every check are printed)."""
    from lightning_parallel.cli.launch_plan import explain_failure, launch_error

    err = launch_error(fixed)
    if err is None:
        return f"{message}\n    {command_line(prog, fixed)}"
    try:
        cfg = compose_config(fixed)
    except HydraException:
        return f"{message}\nwith {' '.join(fixed)} this launch would fail too:\n{err}"
    return f"{message}\nwith {' '.join(fixed)} this launch would fail too:\n{explain_failure(err, prog, fixed, cfg)}"
