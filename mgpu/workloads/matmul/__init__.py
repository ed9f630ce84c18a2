"""C[m, n] = A[m, k] @ B[k, n], tiled over C, each tile checked by Freivalds' method.

Three schedules, a class each (``Matmul(params)`` makes the one ``params.operands`` names):
per-tile (each tile makes or reads the blocks of A and B it multiplies, k block by k
block), distributed (A's row panels and B's column panels made once, one of each per
device, B read from a peer GPU directly) and streamed (each device keeps its rows of C
and streams A and B through them: out of core on one GPU, see stream.py).
"""

from __future__ import annotations

from .stream import StreamedMatmul
from .tiling import choose_matmul_tiles, cpu_working_set, matmul_working_set
from .workload import DistributedMatmul, Matmul, MatmulParams, PerTileMatmul

__all__ = [
    "DistributedMatmul",
    "Matmul",
    "MatmulParams",
    "PerTileMatmul",
    "StreamedMatmul",
    "choose_matmul_tiles",
    "cpu_working_set",
    "matmul_working_set",
]
