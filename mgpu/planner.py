"""Job + the workers' device facts -> a Plan: which tiles, and which worker computes each.

Pure Python and NumPy-free: no GPU, no cluster. The workloads call these helpers from
their ``plan()``; the client side only follows the Plan.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Literal

from .errors import JobInputError
from .sizes import format_bytes

__all__ = [
    "Panel",
    "Plan",
    "Tile",
    "assign_contiguous",
    "check_tiling_keys",
    "choose_matmul_tiles",
    "split",
    "split_by_cost",
]


@dataclass(frozen=True)
class Tile:
    """One unit of work: a box of the output (``bounds`` per axis), placed on ``worker``."""

    index: int
    bounds: dict[str, tuple[int, int]]
    worker: str | None = None  # None: any worker (dynamic placement)
    cost: float = 1.0  # relative cost, for balancing and the progress bar
    needs: tuple[str, ...] = ()  # names of the panels (see Panel) this tile reads

    def size(self, axis: str) -> int:
        lo, hi = self.bounds[axis]
        return hi - lo


@dataclass(frozen=True)
class Panel:
    """A block of an operand made once on ``worker`` and kept there for the tiles.

    ``bounds`` maps the operand's axes to ranges, as a tile's do.
    """

    name: str
    operand: str
    bounds: dict[str, tuple[int, int]]
    worker: str


@dataclass
class Plan:
    """The tiles of a job and how they are placed.

    ``placement`` is ``"static"`` when every tile names its worker (data locality), or
    ``"dynamic"`` when the client side hands tiles to whichever worker frees up first (for
    tiles of uneven cost).
    """

    tiles: list[Tile]
    placement: Literal["static", "dynamic"]
    tile_shape: dict[str, int]
    working_set: int  # bytes one task holds on its device at most
    budget: int  # the per-device budget the plan was made for
    notes: dict[str, Any] = field(default_factory=dict)
    panels: list[Panel] = field(default_factory=list)  # made before the tiles, on their workers

    def describe(self) -> str:
        shape = " x ".join(f"{k}={v}" for k, v in self.tile_shape.items())
        return (
            f"{len(self.tiles)} tiles of {shape}, {self.placement} placement, "
            f"{format_bytes(self.working_set)} per task of a {format_bytes(self.budget)} budget"
        )


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``min(parts, n)`` contiguous, non-empty, near-equal pieces."""
    if n <= 0:
        return []
    parts = max(1, min(parts, n))
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def split_by_size(n: int, size: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into pieces of at most ``size``, as equal as they can be."""
    return split(n, math.ceil(n / max(1, size)))


def split_by_cost(costs: Sequence[float], parts: int, max_size: int) -> list[tuple[int, int]]:
    """Split ``range(len(costs))`` into contiguous pieces of about equal summed cost.

    ``min(parts, len(costs))`` pieces, cut at the element nearest to where the running cost
    crosses each ``k / parts`` of the total, so a piece's cost is within the largest
    element's of the mean (unless a few elements hold most of the cost: every piece keeps
    one element at least). Then any piece longer than ``max_size`` is split into near-equal
    pieces of at most ``max_size``, so there are more pieces only where ``max_size`` demands
    them. With no cost at all the pieces are equal in length (:func:`split`).

    Parameters
    ----------
    costs
        The cost of each element (a row, say), non-negative.
    parts
        How many pieces to aim for.
    max_size
        The most elements one piece may hold.

    Returns
    -------
    list of (start, stop)
        In order, non-empty, covering every element exactly once.

    Raises
    ------
    ValueError
        If a cost is negative.
    """
    n = len(costs)
    if any(c < 0 for c in costs):
        raise ValueError("costs: must be non-negative")
    parts = max(1, min(parts, n))
    prefix = list(accumulate(costs, initial=0.0))
    total = prefix[-1]
    if n == 0 or total <= 0:
        pieces = split(n, parts)
    else:
        cuts = [0]
        for k in range(1, parts):
            target = total * k / parts
            at = bisect_left(prefix, target)  # prefix[at] >= target > prefix[at - 1]
            if at > 0 and target - prefix[at - 1] < prefix[at] - target:
                at -= 1
            # Every piece keeps at least one element, before and after this cut.
            cuts.append(min(max(at, cuts[-1] + 1), n - (parts - k)))
        pieces = list(zip(cuts, cuts[1:] + [n]))
    return [(lo + a, lo + b) for lo, hi in pieces for a, b in split_by_size(hi - lo, max_size)]


def assign_contiguous(n_tiles: int, workers: Sequence[str]) -> list[str]:
    """Give each worker a contiguous run of tiles, the runs differing in length by one at most.

    Neighbouring tiles share inputs (a row panel of A, say), so runs keep them together.
    """
    return [workers[i * len(workers) // n_tiles] for i in range(n_tiles)]


def check_tiling_keys(tiling: Any, allowed: Sequence[str], workload: str) -> dict[str, int]:
    """Validate an explicit ``tiling:`` mapping against the axes a workload tiles."""
    if tiling == "auto":
        return {}
    unknown = sorted(set(tiling) - set(allowed))
    if unknown:
        raise JobInputError(f"tiling: unknown axis {unknown[0]!r} for {workload}; allowed: {', '.join(allowed)}")
    return dict(tiling)


def matmul_working_set(tm: int, tn: int, tk: int, k: int, itemsize: int) -> int:
    """Bytes one matmul task holds: an A block, a B block, the C tile (+ an accumulator
    when k is split), and the float64 check vectors."""
    acc = tm * tn if tk < k else 0
    return itemsize * (tm * tk + tk * tn + tm * tn + acc) + 8 * 4 * (tm + tn + tk)


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
) -> tuple[int, int, int]:
    """Tile sizes (tm, tn, tk) for C[m, n] = A[m, k] @ B[k, n] under a per-device budget.

    Starts from one tile per worker with the full k (inputs generated or read once per
    tile), halves the larger of tm and tn while the working set exceeds the budget, and
    splits k only once both are at ``min_tile``. Explicit sizes are kept as given.

    With ``spill`` (managed memory takes what the budget cannot), the smallest tile is
    returned even when it does not fit.

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
    while matmul_working_set(tm, tn, tk, k, itemsize) > budget:
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
            need = matmul_working_set(tm, tn, tk, k, itemsize)
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
