"""The lines of a model's own code an error was raised in, for a refusal to name.

A split that breaks in the first step breaks in some forward that reads a width the split changed (a
norm built over every head's features, a reshape to a stored full width). The innermost frames of the
traceback that lie outside torch, Lightning, this package and Python's standard library are that
model code (a Hugging Face ``modeling_*.py`` or the user's own): naming them tells the user, and a
maintainer, which line assumes the whole width.
"""

from __future__ import annotations

import os
import sysconfig
import traceback

import lightning
import torch

import lightning_parallel

_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, lightning, lightning_parallel))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _is_library(filename: str) -> bool:
    if filename.startswith(_LIBRARIES):
        return True
    return filename.startswith(_STDLIB) and "site-packages" not in filename


def model_lines(err: BaseException, count: int = 2) -> list[str]:
    """``file.py:line `code``` for the innermost ``count`` frames of ``err``'s traceback in model code."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not _is_library(f.filename)]
    return [f"{os.path.basename(f.filename)}:{f.lineno} `{(f.line or '').strip()}`" for f in frames[-count:]]
