"""Compare what a split model computes with what the whole model computed on the same input.

The pipeline's stage probe uses it (``PipelineEngine._probe``, a stage's output against the traced
whole forward), and the float64 split check collects a unit's outputs with ``floating_tensors``.
"""

from __future__ import annotations

from typing import Any

import torch

_HALF = (torch.float16, torch.bfloat16)


def floating_tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors in ``value`` (nested dicts, tuples and lists), in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in floating_tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in floating_tensors(v)]
    return []


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    """Same shape and equal to ``rtol`` relative (1e-5 absolute) in float32; in half precision, where
    either side is float16 or bfloat16, to 3e-2 relative (1e-3 absolute)."""
    half = got.dtype in _HALF or want.dtype in _HALF
    return got.shape == want.shape and torch.allclose(got.float().cpu(), want.float().cpu(),
                                                      rtol=3e-2 if half else rtol, atol=1e-3 if half else 1e-5)
