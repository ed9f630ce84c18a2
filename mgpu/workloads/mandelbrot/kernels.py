"""Mandelbrot's kernels: the sample points of a window and their escape counts.

The NumPy branch is the definition; the CuPy kernel computes bit-for-bit the same counts
(the GPU tests check this). CuPy is imported lazily: the client never needs it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ...worker.kernels import is_cupy

__all__ = [
    "estimate_counts",
    "mandelbrot_axes",
    "mandelbrot_counts",
    "mandelbrot_differ",
    "mandelbrot_points",
    "mandelbrot_scratch",
]


def mandelbrot_axes(
    *, width: int, height: int, bounds: tuple[float, float, float, float], rows: tuple[int, int], dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """The sample points of rows ``rows``: x of every column and y of each row, in ``dtype``.

    Computed in float64 on the host and rounded once, so both backends iterate from the
    same c.
    """
    return mandelbrot_points(
        width=width, height=height, bounds=bounds, rows=range(rows[0], rows[1]), cols=range(width), dtype=dtype
    )


def mandelbrot_points(
    *, width: int, height: int, bounds: tuple[float, float, float, float], rows: range, cols: range, dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """x of the columns ``cols`` and y of the rows ``rows``, as :func:`mandelbrot_axes`
    gives them: the points of a sample, in memory of its size."""
    xmin, xmax, ymin, ymax = bounds
    j = np.arange(cols.start, cols.stop, cols.step, dtype=np.float64)
    i = np.arange(rows.start, rows.stop, rows.step, dtype=np.float64)
    x = xmin + (j + 0.5) * ((xmax - xmin) / width)
    y = ymax - (i + 0.5) * ((ymax - ymin) / height)
    return x.astype(dtype), y.astype(dtype)


def mandelbrot_counts(xp: Any, x: Any, y: Any, max_iter: int) -> Any:
    """Escape counts for the grid ``y`` (rows) x ``x`` (columns), as int32.

    The count is the number of steps z <- z*z + c from z = 0 taken before |z|^2 > 4, at
    most ``max_iter``. Both branches do the same IEEE operations in the same order (the
    GPU kernel is compiled without FMA contraction), so counts agree exactly.
    """
    if is_cupy(xp):
        x = xp.asarray(x)[None, :]
        y = xp.asarray(y)[:, None]
        out = xp.empty((y.shape[0], x.shape[1]), dtype=np.int32)
        _cupy_mandelbrot_kernel()(x, y, np.int32(max_iter), out)
        return out
    return _numpy_mandelbrot(np.asarray(x), np.asarray(y), max_iter)


# Steps z <- z*z + c from z = 0 until |z|^2 > 4 or max_iter, counted in n: the same
# operations in the same order as the NumPy branch (compiled without FMA contraction).
_ITERATE = """
        T zr = 0, zi = 0;
        int n = 0;
        while (n < max_iter) {
            T zr2 = zr * zr;
            T zi2 = zi * zi;
            if (zr2 + zi2 > (T)4) break;
            T t = zr * zi;
            zi = t + t + ci;
            zr = zr2 - zi2 + cr;
            ++n;
        }
"""


@functools.cache
def _cupy_mandelbrot_kernel() -> Any:
    import cupy

    return cupy.ElementwiseKernel(
        "T cr, T ci, int32 max_iter",
        "int32 count",
        _ITERATE + "count = n;",
        "mgpu_mandelbrot",
        options=("--fmad=false",),
    )


def mandelbrot_differ(
    counts: Any,
    *,
    first_row: int,
    width: int,
    height: int,
    bounds: tuple[float, float, float, float],
    rows: range,
    cols: range,
    dtype: Any,
    max_iter: int,
) -> Any:
    """On a GPU, in one launch: how many pixels of ``rows`` x ``cols`` have a count in
    ``counts`` (a band of the image starting at row ``first_row``) that differs from the
    count of their point made again from its indices as :func:`mandelbrot_points` makes
    it (a one-element device array).

    One kernel that also counts (atomically), so the check is neither a train of small
    launches each waiting its turn behind other bands nor a reduction kernel compiled
    for each shape of sample.
    """
    import cupy

    xmin, xmax, ymin, ymax = bounds
    differ = cupy.zeros(1, dtype=np.int32)
    _cupy_differ_kernel(np.dtype(dtype).name)(
        counts.reshape(-1),  # C-ordered: the kernel finds a pixel by its flat index
        np.int64(first_row),
        np.int64(width),
        np.int64(rows.start),
        np.int64(rows.step),
        np.int64(len(cols)),
        np.int64(cols.start),
        np.int64(cols.step),
        np.float64(xmin),
        np.float64((xmax - xmin) / width),
        np.float64(ymax),
        np.float64((ymax - ymin) / height),
        np.int32(max_iter),
        differ,
        size=len(rows) * len(cols),
    )
    return differ


@functools.cache
def _cupy_differ_kernel(dtype: str) -> Any:
    import cupy

    # The points' type named in the preamble: CuPy infers a type placeholder only from arrays.
    return cupy.ElementwiseKernel(
        "raw int32 counts, int64 first_row, int64 width, int64 row0, int64 row_step, int64 n_cols, "
        "int64 col0, int64 col_step, float64 xmin, float64 xscale, float64 ymax, float64 yscale, "
        "int32 max_iter",
        "raw int32 differ",
        """
        long long row = row0 + (i / n_cols) * row_step;
        long long col = col0 + (i % n_cols) * col_step;
        T cr = (T)(xmin + ((double)col + 0.5) * xscale);
        T ci = (T)(ymax - ((double)row + 0.5) * yscale);
        """
        + _ITERATE
        + "if (n != counts[(row - first_row) * width + col]) atomicAdd(&differ[0], 1);",
        f"mgpu_mandelbrot_differ_{dtype}",
        options=("--fmad=false",),
        preamble=f"typedef {'float' if dtype == 'float32' else 'double'} T;",
    )


# Pixels a CPU iterates at once.
MANDELBROT_PIECE = 1 << 16


def mandelbrot_scratch(pixels: int, itemsize: int) -> int:
    """Bytes a CPU's :func:`mandelbrot_counts` of ``pixels`` holds beyond the counts: c,
    z and three more values of each point of a piece (``itemsize`` each) and its index,
    twice while escaped points are dropped, and the piece's positions, counts and masks."""
    return (2 * (7 * itemsize + 8) + 8 + 8 + 4 + 2) * min(pixels, MANDELBROT_PIECE)


# Steps the estimate counts one at a time; past them (where only points near the set are
# left) it looks every _ESTIMATE_EVERY steps, counting each escape at most that late.
_ESTIMATE_EXACT, _ESTIMATE_EVERY = 32, 4


def estimate_counts(x: np.ndarray, y: np.ndarray, max_iter: int) -> np.ndarray:
    """Escape counts of the points ``x + i y`` (1-D axes) for a plan's cost estimate, in
    NumPy: a few times faster than :func:`mandelbrot_counts` and close to it (not bit
    for bit). The main cardioid and the period-2 bulb, most of the set's area, are known
    to stay (``max_iter``) without a step; the others step in complex128, the arrays'
    whole in a few calls a step, and are looked at one step at a time for the first
    ``_ESTIMATE_EXACT`` steps, then every ``_ESTIMATE_EVERY`` (a point that stayed
    within 2 cannot overflow in as many)."""
    h, w = y.shape[0], x.shape[0]
    cr = np.broadcast_to(np.asarray(x, np.float64)[None, :], (h, w)).ravel()
    ci = np.broadcast_to(np.asarray(y, np.float64)[:, None], (h, w)).ravel()
    counts = np.full(h * w, max_iter, dtype=np.int32)
    q = (cr - 0.25) ** 2 + ci * ci
    known = (q * (q + (cr - 0.25)) < 0.25 * ci * ci) | ((cr + 1) ** 2 + ci * ci < 0.0625)
    idx = np.flatnonzero(~known)
    c = cr[idx] + 1j * ci[idx]
    z = np.zeros_like(c)
    n = 0
    while n < max_iter and idx.size:
        k = 1 if n < _ESTIMATE_EXACT else min(_ESTIMATE_EVERY, max_iter - n)
        for _ in range(k):
            np.multiply(z, z, out=z)
            np.add(z, c, out=z)
        n += k
        escaped = ~(np.abs(z) <= 2)
        if escaped.any():
            counts[idx[escaped]] = n
            stay = ~escaped
            idx, z, c = idx[stay], z[stay], c[stay]
    return counts.reshape(h, w)


def _numpy_mandelbrot(x: np.ndarray, y: np.ndarray, max_iter: int) -> np.ndarray:
    h, w = y.shape[0], x.shape[0]
    counts = np.empty(h * w, dtype=np.int32)
    # In pieces of pixels: the per-point temporaries stay a few MB whatever the band.
    for start in range(0, h * w, MANDELBROT_PIECE):
        stop = min(h * w, start + MANDELBROT_PIECE)
        flat = np.arange(start, stop)
        counts[start:stop] = _numpy_mandelbrot_points(x[flat % w], y[flat // w], max_iter)
    return counts.reshape(h, w)


def _numpy_mandelbrot_points(cr: np.ndarray, ci: np.ndarray, max_iter: int) -> np.ndarray:
    """Escape counts of the points ``cr + i ci`` (1-D, one dtype)."""
    # Points still iterating; a point's count is the step at which it escaped, so the
    # loop never touches the counts of live points (one fewer array op per step).
    counts = np.full(cr.shape[0], max_iter, dtype=np.int32)
    idx = np.arange(cr.shape[0])
    zr = np.zeros_like(cr)
    zi = np.zeros_like(ci)
    zr2, zi2, t = np.empty_like(cr), np.empty_like(cr), np.empty_like(cr)
    four = cr.dtype.type(4)
    for n in range(max_iter):
        np.multiply(zr, zr, out=zr2)
        np.multiply(zi, zi, out=zi2)
        np.add(zr2, zi2, out=t)
        escaped = t > four
        if escaped.any():  # drop escaped points so the work shrinks with the set
            counts[idx[escaped]] = n
            alive = ~escaped
            idx, zr, zi, zr2, zi2, cr, ci = (a[alive] for a in (idx, zr, zi, zr2, zi2, cr, ci))
            if idx.size == 0:
                break
            t = np.empty_like(zr)
        # zi = 2 zr zi + ci as (zr*zi + zr*zi) + ci, zr = (zr2 - zi2) + cr: the kernel's order.
        np.multiply(zr, zi, out=t)
        np.add(t, t, out=zi)
        zi += ci
        np.subtract(zr2, zi2, out=zr)
        zr += cr
    return counts
