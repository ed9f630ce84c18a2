"""C[m, n] = A[m, k] @ B[k, n], tiled over C, each tile checked by Freivalds' method.

Two schedules: per-tile (each tile makes or reads the blocks of A and B it multiplies,
k block by k block) and distributed (A's row panels and B's column panels made once, one
of each per device, B read from a peer GPU directly).
"""

from __future__ import annotations

from .planning import choose_matmul_tiles, matmul_working_set
from .workload import Matmul, MatmulParams

__all__ = ["Matmul", "MatmulParams", "choose_matmul_tiles", "matmul_working_set"]
