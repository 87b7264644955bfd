"""One family for every error this package raises on purpose.

Each message states the constraint that was violated and what would work. Catch
``LightningParallelError`` for all of them, or one area:

- ``ConfigurationError``: options that cannot work together (a schedule name, a micro-batch count,
  a config file path, a plan's syntax);
- ``LaunchError``: the processes and the layout do not fit (the SLURM allocation, the product of the
  sizes, a TP group across nodes, a model that does not divide into them), found before any
  collective, the same on every rank;
- ``IncompatibleModelError``: the model cannot be split or trained as asked (no block list, blocks
  that run twice, nothing a tensor-parallel plan splits);
- ``MetaConstructionError`` (a model error): construction under ``empty_init`` reads a value that is
  not known before the model is materialised;
- ``CheckpointError``: a checkpoint that cannot be written, or does not match the model it is
  loaded into.

Configuration and model errors are also ``ValueError``s, as they were before the family existed.

An error may carry its fixes as data (``Fix``): settings named by their place in `lp-train`'s
config (``strategy.tensor_parallel``, ``trainer.devices``, ``data.batch_size``). ``str()`` writes
them as Hydra overrides; ``in_language`` writes them otherwise, e.g. as the Python arguments of the
strategy a script built (``python_arguments``); `lp-train` and `lp-plan` print each as a whole
command line, tried first (``cli/suggest.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

# a string that Hydra's override grammar reads back as the same string without quotes
_PLAIN = re.compile(r"[A-Za-z0-9_./:-]*[A-Za-z_./:-][A-Za-z0-9_./:-]*")


@dataclass(frozen=True)
class Fix:
    """Settings that make a refused launch pass, by their place in the config, and what they keep."""

    settings: Mapping[str, Any]
    why: str = ""


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (``null``, ``true``, ``[3,5]``, ``'a b'``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in ("null", "true", "false"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def as_overrides(fix: Fix) -> str:
    """``strategy.tensor_parallel=1 trainer.devices=4``."""
    return " ".join(f"{key}={hydra_value(value)}" for key, value in fix.settings.items())


def python_arguments(strategy_class: str, runner: str = "Trainer") -> Callable[[Fix], Optional[str]]:
    """The writer for a script: ``ParallelStrategy(tensor_parallel=1)``, ``Trainer(devices=4)`` (``runner``:
    ``Fabric`` takes the same ``devices`` and ``num_nodes``); None for a fix that names a setting a script
    does not pass as an argument (``data.batch_size``)."""

    def write(fix: Fix) -> Optional[str]:
        calls: dict[str, list[str]] = {}
        for key, value in fix.settings.items():
            owner, _, name = key.partition(".")
            if owner not in ("strategy", "trainer") or not name:
                return None
            calls.setdefault(strategy_class if owner == "strategy" else runner, []).append(f"{name}={value!r}")
        return ", ".join(f"{call}({', '.join(args)})" for call, args in calls.items())

    return write


def lead_in_dropped(problem: str) -> str:
    """``problem`` without the words that introduced its own fixes (", e.g." or a final colon)."""
    return re.sub(r"(,? e\.g\.|[:;,])\s*$", "", problem.rstrip())


def with_fixes(problem: str, fixes: Sequence[Fix], write: Callable[[Fix], Optional[str]] = as_overrides) -> str:
    """``problem``, then one indented line per fix ``write`` can write, its ``why`` as a comment."""
    lines = [problem]
    for fix in fixes:
        text = write(fix)
        if text is not None:
            lines.append(f"    {text}" + (f"   # {fix.why}" if fix.why else ""))
    return "\n".join(lines)


class LightningParallelError(Exception):
    """Base class of the package's errors; the message says what to change, ``fixes`` (if any) how."""

    def __init__(self, problem: str = "", fixes: Sequence[Fix] = ()) -> None:
        self.problem = problem
        self.fixes = list(fixes)
        super().__init__(with_fixes(problem, self.fixes))

    def in_language(self, write: Callable[[Fix], Optional[str]]) -> "LightningParallelError":
        """The same error (same class) with its fixes written by ``write``."""
        other = type(self)(self.problem, self.fixes)
        other.args = (with_fixes(self.problem, self.fixes, write),)
        return other


class ConfigurationError(LightningParallelError, ValueError):
    """Options, or a composed config, that cannot work together."""


class LaunchError(LightningParallelError, ValueError):
    """A launch whose allocation, layout and model do not fit together."""


class IncompatibleModelError(LightningParallelError, ValueError):
    """A model that cannot be split or trained the way the strategy was asked to."""


class MetaConstructionError(IncompatibleModelError):
    """Construction under ``empty_init`` reads a parameter value that the meta device cannot give yet."""


class CheckpointError(LightningParallelError):
    """A checkpoint that cannot be written, or that does not fit the model it is loaded into."""
