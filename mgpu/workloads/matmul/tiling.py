"""How a matmul job is cut into tiles (its tiling): the working set of a tile and the tile sizes."""

from __future__ import annotations

import math
from collections.abc import Callable

from ...errors import JobInputError
from ...sizes import format_bytes
from ...worker import kernels

__all__ = ["choose_matmul_tiles", "cpu_working_set", "matmul_working_set"]


def matmul_working_set(tm: int, tn: int, tk: int, k: int, itemsize: int) -> int:
    """Bytes one matmul task holds on a GPU: an A block, a B block, the C tile (cuBLAS adds
    each k block's product into it) and the float64 check vectors; the kernels make no
    temporaries. ``k`` is unused here; a CPU's estimate (:func:`cpu_working_set`) needs it."""
    return itemsize * (tm * tk + tk * tn + tm * tn) + 8 * 4 * (tm + tn + tk)


def cpu_working_set(tm: int, tn: int, tk: int, k: int, itemsize: int) -> int:
    """Bytes one matmul task holds at most on a CPU: while it runs over k, its A and B
    blocks and C tile, and the largest temporary beside them (the random blocks' hash,
    the check's float64 piece of A or B, or, with k split, NumPy's product before
    ``c += a @ b`` adds it); then C and the float64 piece of its check; and the float64
    check vectors throughout."""
    blocks = itemsize * (tm * tk + tk * tn + tm * tn)
    beside = max(
        itemsize * tm * tn if tk < k else 0,
        kernels.random_scratch(max(tm * tk, tk * tn)),
        kernels.matvec_scratch(tk, tn),
        kernels.matvec_scratch(tm, tk),
    )
    check = itemsize * tm * tn + kernels.matvec_scratch(tm, tn)
    return max(blocks + beside, check) + 8 * 4 * (tm + tn + tk)


def choose_matmul_tiles(
    m: int,
    n: int,
    k: int,
    itemsize: int,
    *,
    budget: int,
    n_workers: int,
    explicit: dict[str, int] | None = None,
    min_tile: int = 256,
    spill: bool = False,
    working_set: Callable[[int, int, int], int] | None = None,
) -> tuple[int, int, int]:
    """Tile sizes (tm, tn, tk) for C[m, n] = A[m, k] @ B[k, n] under a per-device budget.

    Starts from one tile per worker with the full k (inputs generated or read once per
    tile), halves the larger of tm and tn while the working set exceeds the budget, and
    splits k only once both are at ``min_tile``. Explicit sizes are kept as given.

    With ``spill`` (managed memory takes what the budget cannot), the smallest tile is
    returned even when it does not fit. ``working_set(tm, tn, tk)`` is the bytes a tile
    holds (by default :func:`matmul_working_set`, a GPU's).

    Raises
    ------
    JobInputError
        If even the smallest tile does not fit the budget and ``spill`` is off.
    """
    explicit = explicit or {}
    tm = min(explicit.get("m", m), m)
    tn = min(explicit.get("n", n), n)
    tk = min(explicit.get("k", k), k)
    if not explicit:
        # One tile per worker, cut along the longer output side (fewer input re-reads).
        if m >= n:
            tm = math.ceil(m / n_workers)
        else:
            tn = math.ceil(n / n_workers)
    if working_set is None:

        def working_set(tm: int, tn: int, tk: int) -> int:
            return matmul_working_set(tm, tn, tk, k, itemsize)

    while working_set(tm, tn, tk) > budget:
        if "m" not in explicit and tm >= tn and tm > min_tile:
            tm = math.ceil(tm / 2)
        elif "n" not in explicit and tn > min_tile:
            tn = math.ceil(tn / 2)
        elif "m" not in explicit and tm > min_tile:
            tm = math.ceil(tm / 2)
        elif "k" not in explicit and tk > min_tile:
            tk = math.ceil(tk / 2)
        elif spill:
            break
        else:
            need = working_set(tm, tn, tk)
            raise JobInputError(
                f"cluster.memory_limit: a matmul tile of {tm} x {tn} x {tk} needs "
                f"{format_bytes(need)} per device but the budget is {format_bytes(budget)}; "
                "raise cluster.memory_limit or use smaller tiling sizes (or, on GPUs, spill: managed "
                "to let managed memory take the excess)"
            )
    if not explicit:
        tm, tn = _balance(m, n, tm, tn, n_workers)
    return tm, tn, tk


def _balance(m: int, n: int, tm: int, tn: int, n_workers: int) -> tuple[int, int]:
    """Shrink tm so that the tile count is a multiple of the workers when tiles are few."""
    gm, gn = math.ceil(m / tm), math.ceil(n / tn)
    if gm * gn % n_workers == 0 or gm * gn >= 8 * n_workers:
        return tm, tn
    for extra in range(1, n_workers + 1):
        if (gm + extra) * gn % n_workers == 0 and gm + extra <= m:
            return math.ceil(m / (gm + extra)), tn
    return tm, tn
