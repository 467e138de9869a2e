"""How far a kernel's output is from its reference, for every test and case file."""

from __future__ import annotations

import torch


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (Frobenius, in float64), or ``inf`` when ``got`` holds a NaN or inf.

    Outputs are NaN-poisoned before a kernel writes them, so ``inf`` means an unwritten tile or row.
    The denominator is clamped at 1e-30 so an all-zero reference gives a large error, not a NaN.
    One host sync on GPUs.
    """
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
