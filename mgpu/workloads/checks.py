"""Verification arithmetic shared by the workloads."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..worker.kernels import to_host

__all__ = ["freivalds_vector", "relative_residual", "unit_roundoff"]


def freivalds_vector(dev: Any, seed: int, n: int, cols: tuple[int, int]) -> Any:
    """Elements ``cols`` of a product's check vector ``r`` (length ``n``, float64 on ``dev``):
    the job's random operand 2, moved into [0.5, 1.5). The same under any tiling.

    No element is near 0, so a wrong element of C moves C·r by at least half its error;
    and all are positive, so A·(B·r) does not cancel where C's entries share a sign
    (operands in [0, 1) left max|A·(B·r)| at the scale of sum(r), which can be near 0,
    and a correct product failed its check at random).
    """
    from ..worker.sources import RandomSource

    r = RandomSource(seed, 2, (n,), "float64").read(dev, cols)
    r *= 0.5  # in place: the check's working set holds one vector
    r += 1.0
    return r


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
