"""Module-name globs: how plan entries name modules, and what to suggest when one names none.

A glob is matched against the whole dotted name (``named_modules()``, relative to the module
given to ``parallelize``). ``*`` matches within one segment (``layers.*.mlp`` matches
``layers.3.mlp``, not ``layers.3.block.mlp``), as in Hugging Face's own plans; ``**`` matches
across segments; ``?`` matches one character of a segment.
"""

from __future__ import annotations

import difflib
import functools
import re

_TOKENS = re.compile(r"(\*\*|\*|\?)")
_REGEX = {"**": ".*", "*": r"[^.]*", "?": r"[^.]"}


@functools.lru_cache(maxsize=1024)
def _pattern(glob: str) -> re.Pattern:
    return re.compile("".join(_REGEX.get(t, re.escape(t)) for t in _TOKENS.split(glob)) + r"\Z")


def glob_matches(name: str, glob: str) -> bool:
    return _pattern(glob).match(name) is not None


def join_name(*parts: str) -> str:
    """``join_name("a", "", "b")`` -> ``"a.b"``: dotted names with empty parts (the root) left out."""
    return ".".join(p for p in parts if p)


def inside(name: str, outer: str) -> bool:
    """Whether module ``name`` lies in (or is) the subtree of ``outer`` (``""`` is the root)."""
    return outer == "" or name == outer or name.startswith(outer + ".")


def block_glob(name: str) -> str:
    """``transformer.h.3.mlp.c_fc`` -> ``transformer.h.*.mlp.c_fc``: one row per repeated layer."""
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", name)


def did_you_mean(glob: str, names: list[str]) -> list[str]:
    """Globs of existing modules close to ``glob``: first those it matches the end of (a missing
    wrapper prefix such as PEFT's ``base_model.model.`` or ``_orig_mod.``), else similar spellings."""
    candidates = list(dict.fromkeys(block_glob(n) for n in names if n))
    tails = [c for c in candidates if glob_matches(c, "**." + glob)]
    return tails[:3] or difflib.get_close_matches(glob, candidates, n=3, cutoff=0.6)
