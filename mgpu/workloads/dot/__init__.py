"""``workload: dot``: the dot product of two long vectors, chunked across devices.

:mod:`~mgpu.workloads.dot.workload` plans and runs the chunks; :mod:`~mgpu.workloads.dot.kernels`
makes random pairs with their sums, and sums products in float64 on NumPy and CuPy.
"""

from __future__ import annotations

from .workload import Dot, DotParams

__all__ = ["Dot", "DotParams"]
