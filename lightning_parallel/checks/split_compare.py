"""How close a split module's float64 values must be to the whole module's, and what to say when not.

Both sides run the same operations in float64 (``float64.py``) on the same inputs; a split only
reorders sums (a row-parallel layer adds its ranks' partial products in another order than one
matrix product does), so the two differ by rounding, about 1e-16 of the values' scale, times the
length of the sums. ``RTOL = 1e-10`` of the scale leaves that a margin of more than 1000 (measured on
the zoo: at most 3e-14 of the scale), while the smallest wrong split the check exists for, an
attention whose heads are regrouped, moves its output by 1e-6 and its weights' gradients by far more
(measured: ``tests/test_verify_split.py``). The scale of a tensor is its largest magnitude, but at
least ``FLOOR`` of the largest among the tensors it is compared with (all gradients of one module):
a gradient that is zero by construction (a key bias under softmax) is rounding noise on both sides,
and is compared at the scale of its module's other gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

RTOL = 1e-10
FLOOR = 1e-3


def magnitude(tensor: Optional[torch.Tensor]) -> float:
    return 0.0 if tensor is None or tensor.numel() == 0 else float(tensor.detach().abs().max())


@dataclass(frozen=True)
class Difference:
    """``what`` of a module differs from the whole module's by ``error`` at scale ``scale``."""

    what: str
    error: float
    scale: float

    @property
    def relative(self) -> float:
        if self.error == 0:
            return 0.0
        return self.error / self.scale if self.scale > 0 else float("inf")

    @property
    def rounding(self) -> bool:
        """Whether float64 rounding explains it."""
        return self.error <= RTOL * self.scale

    def describe(self) -> str:
        return (f"{self.what} differs from the whole module's by {self.error:.1e} ({self.relative:.1e} of its "
                f"scale {self.scale:.1e}; float64 rounding stays below {RTOL:.0e} of it)")


def compare(what: str, got: Optional[torch.Tensor], want: Optional[torch.Tensor], group_scale: float) -> Difference:
    """How far ``got`` is from ``want`` (a missing gradient counts as zeros); ``group_scale``: the
    largest magnitude among the tensors compared alongside."""
    if got is not None and want is not None and got.shape != want.shape:
        return Difference(f"{what} has shape {tuple(got.shape)} instead of {tuple(want.shape)}", float("inf"), 1.0)
    if got is None and want is None:
        return Difference(what, 0.0, 0.0)
    got = torch.zeros_like(want) if got is None else got.detach().cpu()
    want = torch.zeros_like(got) if want is None else want.detach()
    scale = max(magnitude(want), FLOOR * group_scale)
    got, want = got.double(), want.double()
    # equal infinities and NaN on both sides count as equal; NaN on one side only as infinitely far
    diff = torch.where((got == want) | (got.isnan() & want.isnan()), 0.0, (got - want).abs())
    error = float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0
    return Difference(what, error, scale)
