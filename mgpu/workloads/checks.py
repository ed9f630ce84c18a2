"""Verification arithmetic shared by the workloads."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels import to_host

__all__ = ["relative_residual", "unit_roundoff"]


def relative_residual(xp: Any, got: Any, want: Any) -> float:
    """``max|got - want| / max|want|`` as a Python float (0 when both are zero)."""
    if not got.size:
        return 0.0
    # Both maxima in one copy, made once the stream is done (see to_host).
    num, den = (float(v) for v in to_host(xp, xp.stack([xp.abs(got - want).max(), xp.abs(want).max()])))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def unit_roundoff(dtype: str, *, tf32: bool = False) -> float:
    """Half the spacing of floats at 1 in the precision the arithmetic keeps."""
    if tf32:
        return 2.0**-11  # TF32 keeps 10 mantissa bits of each input
    return float(np.finfo(dtype).eps) / 2
