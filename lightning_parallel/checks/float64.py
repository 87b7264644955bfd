"""Run unchanged model code in float64 throughout, even where it casts to a lower precision.

Comparing a split module with the whole one in float64 leaves rounding at ~1e-16, so a split that
computes something slightly else (an attention whose heads are regrouped moves a loss at
initialisation by 7e-5 only) stands out by many orders of magnitude. But model code often casts on
purpose: Hugging Face's RMSNorm computes in ``torch.float32`` and casts back, softmaxes take
``dtype=torch.float32``, and some kernels take no float64 at all (the grouped matrix product of
Hugging Face's mixture-of-experts layers). A cast to float32 of two float64 values that differ by rounding usually
gives the same float32 value, but not always, and then the two sides differ by a float32 rounding
(~1e-7), which would look like a wrong split. ``KeepFloat64`` makes such casts of float64 tensors
keep float64, and computes ``torch._grouped_mm`` of float64 tensors as one matrix product per
group, so both sides compute the same operations in float64 from end to end.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

LOWER = (torch.float32, torch.float16, torch.bfloat16)
_NARROWING = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


def _is_float64(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.float64


def _wider(value: Any) -> Any:
    """float64 in place of a lower floating dtype; other values as they are."""
    return torch.float64 if value in LOWER else value


class KeepFloat64(TorchFunctionMode):
    """Inside, casting a float64 tensor to float32, float16 or bfloat16 keeps it float64 (``.to``,
    ``.type``, ``.type_as``, ``.float()``, ...), and an operation on a float64 tensor asked for a lower
    ``dtype=`` (``softmax(x, dtype=torch.float32)``) computes in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if args and _is_float64(args[0]):
            if func is _GROUPED_MM:
                return grouped_mm(*args, **kwargs)
            if func in _NARROWING:
                return args[0]
            if func is torch.Tensor.type_as and len(args) > 1 and isinstance(args[1], torch.Tensor):
                if args[1].dtype in LOWER:
                    return args[0]
            if func is torch.Tensor.type and len(args) > 1 and args[1] in LOWER:
                return args[0]
            if func is torch.Tensor.to:
                args = (args[0], *(_target(a) for a in args[1:]))
        if "dtype" in kwargs and any(_is_float64(a) for a in args):
            kwargs["dtype"] = _wider(kwargs["dtype"])
        return func(*args, **kwargs)


_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    """``torch._grouped_mm`` as plain matrix products (any dtype): ``(M, K) x (G, K, N)`` with ``offs``
    the end row of each group (rows ``offs[g-1]:offs[g]`` of ``mat_a`` times ``mat_b[g]``), or batched
    ``(G, M, K) x (G, K, N)``."""
    if mat_a.dim() == 3 and mat_b.dim() == 3:
        out = mat_a @ mat_b
    elif mat_a.dim() == 2 and mat_b.dim() == 3 and offs is not None:
        ends = offs.tolist()
        starts = [0] + ends[:-1]
        out = torch.cat([mat_a[s:e] @ mat_b[g] for g, (s, e) in enumerate(zip(starts, ends))]
                        + [mat_a.new_zeros(mat_a.shape[0] - (ends[-1] if ends else 0), mat_b.shape[-1])])
    else:
        raise NotImplementedError(f"grouped_mm of shapes {tuple(mat_a.shape)} x {tuple(mat_b.shape)} in float64")
    return out if bias is None else out + bias


def _target(value: Any) -> Any:
    """An argument of ``Tensor.to`` with a lower floating target made float64: a dtype, or a tensor
    whose dtype would be taken (replaced by its device)."""
    if isinstance(value, torch.Tensor):
        return value.device if value.dtype in LOWER else value
    return _wider(value)
