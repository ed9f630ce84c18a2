"""Which rows of a band each sweep computes when a band keeps deep halos.

A band of ``rows`` rows is held with ``depth`` halo rows above and below it: local row
``i`` is the grid's row ``first - depth + i``, the band's own rows are
``depth .. depth + rows - 1``. A step runs up to ``depth`` sweeps between two exchanges.
After an exchange the halo rows are right; a sweep can then only renew the rows whose
neighbours it holds, so on a side with a neighbour the rows worth computing shrink by one
a sweep, and after ``sweeps`` sweeps the band's own rows are those of ``sweeps``
single-row-halo steps. On a side at the grid's edge there is nothing to shrink: the grid's
first or last row is fixed, and rows beyond it are never computed.

The rows a neighbour gets, the band's first and last ``depth`` rows after ``depth``
sweeps, depend on a cone of rows around each edge (:func:`edges`), swept first so they can
leave while the rest (:func:`interior`) is swept. Both are swept into the same two buffers,
all the cones' sweeps first: a cone's sweep ``j + 2`` stops just short of the rows that
the interior's sweep ``j + 1`` reads from that buffer, so nothing is computed twice.
"""

from __future__ import annotations

__all__ = ["Span", "edges", "interior", "needed"]

Span = tuple[int, int]  # local rows lo .. hi - 1


def needed(rows: int, depth: int, sweeps: int, j: int, above: bool, below: bool) -> Span:
    """The rows sweep ``j`` (1 .. ``sweeps``) of a step of ``sweeps`` sweeps computes so
    that the band's own rows are right after the last; ``above`` / ``below``: whether the
    band has a neighbour there (else that side is the grid's edge)."""
    lo = depth - sweeps + j if above else depth
    hi = rows + depth + sweeps - j if below else rows + depth
    return lo, hi


def edges(rows: int, depth: int, j: int, above: bool, below: bool) -> list[Span]:
    """The rows sweep ``j`` of a step of ``depth`` sweeps computes first, on which the
    rows sent to the neighbours depend: the band's first ``3 depth - 2 j`` rows from the
    top (where it has a neighbour above) and as many from the bottom (below); they may
    overlap in a band shorter than ``4 depth``."""
    lo, hi = needed(rows, depth, depth, j, above, below)
    out = []
    if above:
        out.append((lo, min(3 * depth - j, hi)))
    if below:
        out.append((max(rows - depth + j, lo), hi))
    return [s for s in out if s[0] < s[1]]


def interior(rows: int, depth: int, sweeps: int, j: int, above: bool, below: bool, *, sent: bool) -> Span | None:
    """The rows sweep ``j`` computes after the cones of :func:`edges` (all of them where
    the step sends nothing, ``sent`` False); None where the cones cover them all."""
    lo, hi = needed(rows, depth, sweeps, j, above, below)
    if sent:
        if above:
            lo = 3 * depth - j
        if below:
            hi = rows - depth + j
    return (lo, hi) if lo < hi else None
