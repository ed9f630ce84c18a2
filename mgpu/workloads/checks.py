"""Verification arithmetic shared by the workloads: float64 products in bounded pieces."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["matvec_f64", "relative_residual", "unit_roundoff"]

# float64 copies made for a check stay under this size, whatever the tile.
_CHUNK_BYTES = 256 << 20


def matvec_f64(xp: Any, m: Any, v: Any) -> Any:
    """``m @ v`` in float64, casting ``m`` in row pieces so the copy stays small."""
    rows = max(1, _CHUNK_BYTES // (8 * max(1, m.shape[1])))
    if m.shape[0] <= rows:
        return m.astype(xp.float64, copy=False) @ v
    out = xp.empty(m.shape[0], dtype=xp.float64)
    for i in range(0, m.shape[0], rows):
        out[i : i + rows] = m[i : i + rows].astype(xp.float64) @ v
    return out


def relative_residual(xp: Any, got: Any, want: Any) -> float:
    """``max|got - want| / max|want|`` as a Python float (0 when both are zero)."""
    num = float(xp.abs(got - want).max()) if got.size else 0.0
    den = float(xp.abs(want).max()) if want.size else 0.0
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def unit_roundoff(dtype: str, *, tf32: bool = False) -> float:
    """Half the spacing of floats at 1 in the precision the arithmetic keeps."""
    if tf32:
        return 2.0**-11  # TF32 keeps 10 mantissa bits of each input
    return float(np.finfo(dtype).eps) / 2
