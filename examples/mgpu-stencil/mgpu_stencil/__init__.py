"""mgpu-stencil: ``workload: stencil`` for mgpu, a 2-D Jacobi (heat-equation) sweep.

Installed, it registers itself in the ``mgpu.workloads`` entry-point group (see
pyproject.toml); mgpu itself does not know it.
"""

from __future__ import annotations

from .kernels import jacobi_step
from .workload import Stencil, StencilParams, sweep

__all__ = ["Stencil", "StencilParams", "jacobi_step", "sweep"]
