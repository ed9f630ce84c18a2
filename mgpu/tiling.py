"""A plan's data (:class:`Plan`, :class:`Tile`, :class:`Panel`) and the helpers a workload's
``plan()`` cuts and places its tiles with.

Each workload tiles itself (matmul's tile sizes: :mod:`mgpu.workloads.matmul.tiling`); the
job-level planning (the job's workload made, its plan under the workers' budget) is the
client's (:mod:`mgpu.client.plan`), which only follows the Plan. Pure Python and
NumPy-free: no GPU, no cluster.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Literal

from .errors import JobInputError
from .sizes import format_bytes

if TYPE_CHECKING:
    from _typeshed import SupportsLenAndGetItem

__all__ = [
    "MAX_TILES",
    "Panel",
    "Plan",
    "Tile",
    "assign_contiguous",
    "check_tile_count",
    "check_tiling_keys",
    "split",
    "split_aligned",
    "split_by_cost",
    "split_by_prefix",
    "split_by_size",
]

# The most tiles one job may have. Each is a Dask task, a future in the client and a record
# in the result: past this, scheduling alone takes minutes and the client's memory grows
# with the job. Workloads count their tiles from the grid before they make any, so a job
# of any size is planned (or refused) in microseconds and a few bytes.
MAX_TILES = 20_000


@dataclass(frozen=True)
class Tile:
    """One unit of work: a box of the output (``bounds`` per axis), placed on ``worker``."""

    index: int
    bounds: dict[str, tuple[int, int]]
    worker: str | None = None  # None: any worker (dynamic placement)
    cost: float = 1.0  # relative cost, for balancing and the progress bar
    needs: tuple[str, ...] = ()  # names of the panels (see Panel) this tile reads
    # What the workload's tile function needs besides the bounds (a block size, say): the
    # plan is data, and the workload object holds only the job's parameters.
    args: dict[str, Any] = field(default_factory=dict)
    # The tiles this one exchanges with at every step of a stepped plan (see Plan.steps).
    neighbours: tuple[int, ...] = ()

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
    # Above 1: every tile keeps its state on its worker and advances it this many steps,
    # exchanging with its neighbours between steps (Workload.start and step), then ends as
    # a tile does (run, check, store). Static placement only.
    steps: int = 1

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


def split_aligned(n: int, size: int, quantum: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into the fewest pieces of at most ``size``, each a whole number of
    ``quantum`` but the last (the rest of ``n``), the whole ones as equal as they can be:
    a product over a piece of rows then ends in no partial tile of its kernel but in the
    last. With ``size`` under a quantum, as :func:`split_by_size`."""
    if n <= 0:
        return []
    if quantum <= 1 or size < quantum:
        return split_by_size(n, size)
    most = size // quantum  # whole quanta a piece holds
    parts = math.ceil(n / size)
    while (parts - 1) * most * quantum + size < n:
        parts += 1
    if parts == 1:
        return [(0, n)]
    # Quanta before the last piece: about its share, few enough that the last fits in
    # ``size``, and not all of n (the last is not empty).
    low, high = math.ceil((n - size) / quantum), min((parts - 1) * most, (n - 1) // quantum)
    units = min(max(round(n * (parts - 1) / parts / quantum), low), high)
    return [(a * quantum, b * quantum) for a, b in split(units, parts - 1)] + [(units * quantum, n)]


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
    if len(costs) and min(costs) < 0:
        raise ValueError("costs: must be non-negative")
    return split_by_prefix(list(accumulate(costs, initial=0.0)), parts, max_size)


def split_by_prefix(prefix: SupportsLenAndGetItem[float], parts: int, max_size: int) -> list[tuple[int, int]]:
    """:func:`split_by_cost` of the costs whose running sums, from 0, are ``prefix``
    (``len(costs) + 1`` of them, non-decreasing): for costs summed already, such as a
    NumPy array's ``cumsum``, which a large plan (65536 rows) sums in microseconds."""
    n = len(prefix) - 1
    parts = max(1, min(parts, n))
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
        pieces = list(zip(cuts, cuts[1:] + [n], strict=True))
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


def check_tile_count(count: int, *, keys: str, what: str) -> None:
    """Refuse a job that needs more than :data:`MAX_TILES` tiles, before any is made.

    Parameters
    ----------
    count
        The tiles the plan would have, counted from its grid.
    keys
        The job keys that set the count (named in the message).
    what
        The tiles' shape and working set, for the message.

    Raises
    ------
    JobInputError
        If ``count`` exceeds :data:`MAX_TILES`.
    """
    if count > MAX_TILES:
        raise JobInputError(
            f"{keys}: this job needs {count:,} tiles ({what}); mgpu runs at most {MAX_TILES:,} tiles a job. "
            "Make the job smaller, its tiles larger (tiling), or the budget larger (cluster.memory_limit)"
        )
