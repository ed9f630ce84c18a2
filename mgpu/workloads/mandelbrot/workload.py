"""Escape-time Mandelbrot counts in row bands, balanced dynamically, each band's sampled
pixels counted again on its own device."""

from __future__ import annotations

import functools
import hashlib
import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ... import config
from ...errors import JobInputError
from ...roofline import median_seconds
from ...sizes import format_bytes
from ...tiling import Plan, Tile, check_tile_count, split_by_prefix, split_by_size
from ...worker.device import Device, DeviceFacts
from ...worker.sources import NpySink, check_output_path
from ...worker.stores import output_sink
from ...worker.tile import TileContext, run_tile
from ..base import Estimates, Outputs, Workload
from .kernels import (
    estimate_counts,
    mandelbrot_axes,
    mandelbrot_counts,
    mandelbrot_differ,
    mandelbrot_points,
    mandelbrot_scratch,
)

__all__ = ["Mandelbrot", "MandelbrotParams", "render_png", "row_costs"]

# Columns of each sampled row that the check counts again: enough to catch a wrong tile,
# few enough that on a CPU (where each of max_iter steps costs NumPy's per-call time) a
# band's check costs a few per cent of the band.
_CHECK_COLUMNS = 512
_PNG_MAX_SIDE = 4096
# The coarse grid over the job's window whose counts estimate each row's cost at plan
# time (~4 ms of NumPy on one core at 1000 steps). A coarse point still running after
# _ESTIMATE_MAX_ITER steps counts as max_iter, so a deep zoom plans in the same time.
_ESTIMATE_ROWS, _ESTIMATE_COLS, _ESTIMATE_MAX_ITER = 256, 128, 1000
# What a pixel costs besides its steps, in steps: its thread and count in the kernel, and
# the task's pass over the counts (their sum, its allocation). On two H200s the tallest
# bands (17029 x 65536, 12 steps a pixel) took 23 ms a band against 13.5 for bands of 24
# Giter near the set: fitted, a pixel costs as much as 26 steps.
_PIXEL_STEPS = 26
# Bands may be this many times taller than the equal-row bands (see plan()).
_TALLEST_BAND = 2
# The widest band the warm-up counts: its sum takes a large reduction's kernels.
_WARMUP_WIDTH = 8192
# Row costs are estimated for at most this many groups of rows (see plan()).
_COST_GROUPS = 1 << 16
# The folder of mgpu's cache that keeps the coarse grids' counts, and how many it keeps.
_ROW_COSTS, _ROW_COSTS_KEPT = "row-costs", 512
# The square image and steps that measure the ceilings (side, max_iter), per backend. On a
# CPU at least one whole piece of the kernel (MANDELBROT_PIECE pixels): a piece's
# temporaries then take the allocator's path a band's do (with Dask's
# MALLOC_TRIM_THRESHOLD_ a fresh mapping each, which halves the rate of 128 x 128).
_CEILING_SIZE = {"cuda": (8192, 1000), "cpu": (256, 200)}


@dataclass
class _Band:
    """A band's counts on its device and their sum."""

    counts: Any
    total: Any


class MandelbrotOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    png: str | None = None
    npy: str | None = None
    zarr: str | None = None  # the counts as a Zarr store (instead of npy)


class MandelbrotParams(BaseModel):
    """``params:`` of a Mandelbrot job."""

    model_config = ConfigDict(extra="forbid")

    width: int = Field(gt=0)
    height: int = Field(gt=0)
    xmin: float = -2.5
    xmax: float = 1.0
    ymin: float = -1.25
    ymax: float = 1.25
    max_iter: int = Field(1000, gt=0)
    dtype: Literal["float32", "float64"] = "float32"
    output: MandelbrotOutput | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _output(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, dict):
            raise ValueError("expected null or {png: path.png, npy: path.npy or zarr: path.zarr} (any of them)")
        return v

    @model_validator(mode="after")
    def _window(self) -> MandelbrotParams:
        if not self.xmin < self.xmax:
            raise ValueError(f"xmin: must be below xmax ({self.xmin} >= {self.xmax})")
        if not self.ymin < self.ymax:
            raise ValueError(f"ymin: must be below ymax ({self.ymin} >= {self.ymax})")
        return self


class Mandelbrot(Workload[MandelbrotParams], Estimates, Outputs):
    """Row bands of the image, cut to equal estimated cost and handed out dynamically."""

    name = "mandelbrot"
    Params = MandelbrotParams
    unit = "Giter/s"
    unit_scale = 1e9
    axes = ("rows",)
    size_params = ("width", "height")
    grow = ("height",)  # more rows over the same window: the cost per row is kept
    verify_method = "sampled pixels counted again on the device"
    example = {"width": 33, "height": 29, "max_iter": 40}
    # Bands on a device at once; their kernels run one after another (Device.in_order),
    # so ~100 ms of kernels are queued while a finished band is checked and the next one
    # comes from the scheduler (2-27 ms apart on an H200). With each band's kernel on
    # its own stream, bands started together shared the GPU, ended together, and the GPU
    # then idled.
    concurrency = 8
    ceiling_units = {"mandelbrot_float32": "Giter/s", "mandelbrot_float64": "Giter/s"}
    uses_device_ceilings = False  # bound by its kernel's rate alone; nothing of it crosses PCIe

    def prepare(self, *, force: bool) -> None:
        p = self.params
        out = p.output or MandelbrotOutput()
        shape = (p.height, p.width)
        if out.npy and out.zarr:
            raise JobInputError("params.output: give the counts as npy or as zarr, not both")
        if out.npy:
            path = check_output_path(out.npy, key="params.output.npy", suffix=".npy", force=force)
            self.sinks["counts"] = NpySink.for_path(path, shape, "int32", key="params.output.npy")
        if out.zarr:
            if not out.zarr.rstrip("/").endswith(".zarr"):
                raise JobInputError(f"params.output.zarr: {out.zarr!r} must end in .zarr")
            self.sinks["counts"] = output_sink(out.zarr, shape, "int32", key="params.output.zarr", force=force)
        if out.png:
            png = check_output_path(out.png, key="params.output.png", suffix=".png", force=force)
            self.png_path = png
            if "counts" not in self.sinks:  # the image is drawn from counts kept only meanwhile
                self.sinks["counts"] = NpySink.for_path(
                    png[:-4] + ".npy", shape, "int32", keep=False, key="params.output.png"
                )

    def plan(
        self, devices: dict[str, DeviceFacts], budget: int, tiling: dict[str, int], *, spill: bool = False
    ) -> Plan:
        p = self.params
        # Bands of about 128 Mpixel, so the GPU works at least as long as the CPU check
        # beside it (~10 ms), and about 8 or more per worker so the fast ones can take more.
        rows = tiling.get("rows") or max(1, min((1 << 27) // p.width, math.ceil(p.height / (8 * len(devices)))))
        rows = min(rows, p.height)
        bytes_per_row, fixed = self.band_bytes(devices)
        if bytes_per_row + fixed > budget and not spill:
            raise JobInputError(
                f"params.width: one row of {p.width:,} pixels needs {format_bytes(bytes_per_row + fixed)} but the "
                f"budget is {format_bytes(budget)} per band; make the image narrower or raise cluster.memory_limit"
            )
        room = max(bytes_per_row, budget - fixed)
        rows = max(1, min(rows, room // bytes_per_row))
        check_tile_count(
            math.ceil(p.height / rows),
            keys="params.height" + (", tiling.rows" if tiling.get("rows") else ""),
            what=f"bands of {rows:,} rows x {p.width:,} columns",
        )
        # Rows are costed in groups, at most _COST_GROUPS of them: a tall image plans as fast
        # and in as little memory as one of 65536 rows.
        group = math.ceil(p.height / _COST_GROUPS)
        cost = row_costs(p, group)
        edges = np.minimum(np.arange(len(cost) + 1) * group, p.height)
        before = np.concatenate([[0.0], np.cumsum(cost)])
        if tiling.get("rows") or "counts" in self.sinks:
            # Rows as asked. Or every count also goes to the host and into a file, which on
            # a GPU takes longer a pixel than ~1000 steps of counting: rows cost about the same.
            bands = split_by_size(p.height, rows)
        else:
            # As many bands, of equal estimated cost: rows far from the set, ~300x cheaper
            # than those through it, go in fewer bands, not many that are mostly overhead.
            # None taller than twice the equal-row bands, though: two bands of 14000-17000
            # rows at once on one H200 stalled each other for 100-500 ms (their 4 GB
            # allocations, it seems); bands of 2048 never did.
            tallest = max(1, min(_TALLEST_BAND * rows, room // bytes_per_row))
            pieces = split_by_prefix(before, math.ceil(p.height / rows), max(1, tallest // group))
            bands = [(int(edges[lo]), int(edges[hi])) for lo, hi in pieces]
        lo_hi = np.array(bands, dtype=np.float64).reshape(-1, 2)
        costs = np.interp(lo_hi[:, 1], edges, before) - np.interp(lo_hi[:, 0], edges, before)
        tiles = [
            Tile(i, {"rows": (r0, r1)}, cost=float(c)) for i, ((r0, r1), c) in enumerate(zip(bands, costs, strict=True))
        ]
        # Dynamic placement hands tiles out from the front: dearest first, so the tail
        # that decides when the last worker ends is made of the cheapest bands.
        tiles.sort(key=lambda t: t.cost, reverse=True)
        tallest = max(t.size("rows") for t in tiles)
        return Plan(tiles, "dynamic", {"rows": tallest, "cols": p.width}, tallest * bytes_per_row + fixed, budget)

    def expected_work(self, plan: Plan) -> float:
        # The bands' estimated costs: steps, and each pixel's overhead in steps (what
        # sets the time; the records count the steps alone).
        return float(sum(t.cost for t in plan.tiles))

    def band_bytes(self, devices: dict[str, DeviceFacts]) -> tuple[int, int]:
        """(bytes a band holds per row, bytes it holds whatever its height): the counts
        (int32) per row; on a CPU the kernel's temporaries, on a GPU the job's axes
        (kept on the device) and the check's points and counts."""
        p = self.params
        if any(f.backend == "cpu" for f in devices.values()):
            fixed = mandelbrot_scratch(p.width * p.height, np.dtype(p.dtype).itemsize)
        else:
            fixed = (p.width + p.height) * np.dtype(p.dtype).itemsize + 16 * 2 * _CHECK_COLUMNS
        return 4 * p.width, fixed

    def run(self, ctx: TileContext, tile: Tile) -> _Band:
        p = self.params
        dev = ctx.dev
        r0, r1 = tile.bounds["rows"]
        xd, yd = self._axes_on(dev)
        with dev.in_order() as queue, ctx.timer(queue):
            counts = mandelbrot_counts(dev.xp, xd, yd[r0:r1], p.max_iter)
        ctx.mark("queued")
        # The sum (and the check's counts) are enqueued behind the kernel and fetched
        # after one wait for the stream (a fetch that waits itself holds up the other
        # bands' threads).
        return _Band(counts, counts.sum(dtype=np.int64))

    def check(self, ctx: TileContext, tile: Tile, answer: _Band) -> Callable[[], tuple[float, bool]]:
        """The band's sampled pixels (see :func:`_sample`) counted again on its device, from
        their own points (made from the pixel indices, not the band's axes; on a GPU in
        the same one launch, queued behind the band): a band placed over the wrong rows or
        window, or counts changed after the kernel, differ. The verdict is read once the stream is
        done; the share of samples that differ is the error, and any fails the band.
        (Both backends count bit-for-bit as NumPy does, which the GPU tests check, so a
        correct band matches exactly.)"""
        p, dev = self.params, ctx.dev
        rows, step = _sample(tile, p.width)
        cols = range(0, p.width, step)
        bounds = (p.xmin, p.xmax, p.ymin, p.ymax)
        if dev.is_gpu:  # the points made on the device: a copy from the host would wait for the band
            differ = mandelbrot_differ(
                answer.counts,
                first_row=tile.bounds["rows"][0],
                width=p.width,
                height=p.height,
                bounds=bounds,
                rows=rows,
                cols=cols,
                dtype=p.dtype,
                max_iter=p.max_iter,
            )
        else:
            x, y = mandelbrot_points(width=p.width, height=p.height, bounds=bounds, rows=rows, cols=cols, dtype=p.dtype)
            got = _take_sample(np, answer.counts, tile, p.width)
            differ = np.count_nonzero(got != mandelbrot_counts(np, x, y, p.max_iter))
        sampled = len(rows) * len(cols)

        def verdict() -> tuple[float, bool]:
            share = int(dev.to_host(differ).sum()) / sampled
            return share, share == 0.0

        return verdict

    def store(self, ctx: TileContext, tile: Tile, answer: _Band) -> bool:
        dev = ctx.dev
        dev.synchronize()
        ctx.mark("counted")  # the band's kernel, its sum and its check have run
        ctx.record.work = float(dev.to_host(answer.total))
        if "counts" not in self.sinks:
            return False
        r0, r1 = tile.bounds["rows"]
        self.sinks["counts"].write((slice(r0, r1), slice(None)), dev.to_host(answer.counts))
        return True

    def _axes_on(self, dev: Device) -> tuple[Any, Any]:
        """The job's x (every column) and y (every row) on ``dev``: copied there once per
        job and process, so a band copies nothing before its kernel (the first bands'
        copies, each through a new pinned buffer, held their threads ~8 ms)."""
        p = self.params
        key = (p.width, p.height, p.xmin, p.xmax, p.ymin, p.ymax, p.dtype)

        def make() -> tuple[Any, Any]:
            x, y = mandelbrot_axes(
                width=p.width,
                height=p.height,
                bounds=(p.xmin, p.xmax, p.ymin, p.ymax),
                rows=(0, p.height),
                dtype=p.dtype,
            )
            with dev.on_stream():
                axes = dev.to_device(x), dev.to_device(y)
            dev.synchronize()  # other threads read them on their own streams
            return axes

        return dev.cache.get("mandelbrot-axes", key, make)

    def ceiling(self) -> str:
        return f"mandelbrot_{self.params.dtype}"

    @classmethod
    def measure_ceilings(cls, dev: Device, only: Collection[str] | None = None) -> dict[str, float]:
        """Iterations per second of this kernel over the whole set, float32 and float64
        (those in ``only``)."""
        side, max_iter = _CEILING_SIZE[dev.backend]
        out: dict[str, float] = {}
        for dtype in ("float32", "float64"):
            if only is not None and f"mandelbrot_{dtype}" not in only:
                continue
            x, y = mandelbrot_axes(
                width=side, height=side, bounds=(-2.5, 1.0, -1.25, 1.25), rows=(0, side), dtype=dtype
            )
            xd, yd = dev.to_device(x), dev.to_device(y)
            iterations = float(mandelbrot_counts(dev.xp, xd, yd, max_iter).sum(dtype=np.int64))

            def counts(xd: Any = xd, yd: Any = yd) -> Any:
                return mandelbrot_counts(dev.xp, xd, yd, max_iter)

            seconds = median_seconds(dev, counts)
            out[f"mandelbrot_{dtype}"] = iterations / seconds / 1e9
        return out

    def warm_key(self, tile: Tile) -> str:
        # The kernels (the band's, its sum's, the check's) depend on the dtype, the check
        # and the warm-up band's width, not on the window or the steps (an argument). The
        # job's axes, made by the warm-up too, are made by a warm worker's first band.
        p = self.params
        return f"mandelbrot|{p.dtype}|{self.verify}|{min(p.width, _WARMUP_WIDTH)}"

    def warmup(self, dev: Device, tile: Tile) -> None:
        # A small band through run_tile itself, checked as the job's bands are: the check's
        # kernels, compiled or loaded on first use, otherwise land in the first real bands,
        # and loading a kernel waits for the kernels running. Wide enough (8192 columns)
        # that its sum takes a large reduction's kernels, not only a small one's.
        small = Mandelbrot(
            self.params.model_copy(
                update={"width": min(self.params.width, _WARMUP_WIDTH), "height": 8, "output": None}
            ),
            verify=self.verify,
        )
        run_tile(small, dev, Tile(-1, {"rows": (0, 8)}))
        self._axes_on(dev)

    def finish(self, client: Any) -> list[str]:
        png = getattr(self, "png_path", None)
        if not png:
            return []
        sink = self.sinks["counts"]
        # A hidden temporary name the client knows, so an interrupted render leaves nothing.
        partial = os.path.join(os.path.dirname(png), f".{os.path.basename(png)}.{time.time_ns()}.partial.png")
        try:
            client.submit(
                render_png,
                sink.partial,
                png,
                self.params.max_iter,
                partial,
                key=f"mandelbrot-png-{os.getpid()}-{time.time_ns()}",
            ).result()
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return [png]


def row_costs(p: MandelbrotParams, group: int = 1) -> np.ndarray:
    """Estimated iterations of each row of the image (or of each ``group`` rows, the last
    group the rest), from a coarse grid counted in NumPy.

    The counts of at most 256 x 128 points spread over the same window
    (:func:`~mgpu.workloads.mandelbrot.kernels.estimate_counts`), a row's mean
    interpolated to the middle of every row (or group) of the image, plus what a pixel
    costs besides its steps. The grid's counts are kept in mgpu's cache folder for later
    plans of the same window and steps, and the costs for the process's later jobs.
    """
    return _row_costs(p.width, p.height, (p.xmin, p.xmax, p.ymin, p.ymax), p.max_iter, p.dtype, group).copy()


@functools.lru_cache(maxsize=16)
def _row_costs(
    width: int, height: int, bounds: tuple[float, float, float, float], max_iter: int, dtype: str, group: int
) -> np.ndarray:
    rows, cols = min(height, _ESTIMATE_ROWS), min(width, _ESTIMATE_COLS)
    per_row = (_coarse_means(rows, cols, bounds, max_iter, dtype) + _PIXEL_STEPS) * width
    # Image row i lies at (i + 0.5) / height of the window, as does coarse row j at (j + 0.5) / rows.
    first = np.arange(0, height, group)
    size = np.minimum(group, height - first)
    at = (first + size / 2) * (rows / height) - 0.5
    return np.interp(at, np.arange(rows), per_row) * size


def _coarse_means(rows: int, cols: int, bounds: tuple[float, float, float, float], max_iter: int, dtype: str) -> Any:
    """Each coarse row's mean count, from mgpu's cache folder where an earlier plan of the
    same grid left it (a running cluster's submits each plan in a process of their own),
    else counted and left there."""
    steps = min(max_iter, _ESTIMATE_MAX_ITER)
    key = f"v1|{rows}x{cols}|{bounds!r}|{steps}|{max_iter}|{dtype}"
    path = config.load().ceilings_folder() / _ROW_COSTS / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.npy"
    try:
        kept = np.load(path)
        if kept.shape == (rows,):
            return kept
    except (OSError, ValueError):
        pass
    x, y = mandelbrot_axes(width=cols, height=rows, bounds=bounds, rows=(0, rows), dtype=dtype)
    counts = estimate_counts(x, y, steps)
    means = np.where(counts >= steps, max_iter, counts).mean(axis=1)
    _keep(path, means)
    return means


def _keep(path: Path, means: np.ndarray) -> None:
    """Write ``means`` at ``path`` whole or not at all; past _ROW_COSTS_KEPT files the
    oldest half go. A folder that cannot be written keeps nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, means)
        os.replace(tmp, path)
        kept = sorted(path.parent.glob("*.npy"), key=lambda p: p.stat().st_mtime)
        if len(kept) > _ROW_COSTS_KEPT:
            for old in kept[: len(kept) // 2]:
                old.unlink(missing_ok=True)
    except OSError:
        pass


def _sample(tile: Tile, width: int) -> tuple[range, int]:
    """The pixels of a band that are checked: rows (of the image), and a column step.

    The band's first row and one more that varies by tile (the same row when that is the
    first), over evenly spaced columns (every ``step``-th, column 0 among them); a tile
    passes when every sampled count matches.
    """
    r0, r1 = tile.bounds["rows"]
    offset = (tile.index * 7919) % (r1 - r0)
    rows = range(r0, r0 + offset + 1, offset) if offset else range(r0, r0 + 1)
    return rows, max(1, math.ceil(width / _CHECK_COLUMNS))


def _take_sample(xp: Any, counts: Any, tile: Tile, width: int) -> Any:
    """The band's sampled counts (see :func:`_sample`), gathered on its device by views
    (no index array to copy there)."""
    rows, step = _sample(tile, width)
    r0 = tile.bounds["rows"][0]
    return xp.stack([counts[r - r0, ::step] for r in rows])


def _open_counts(path: str) -> Any:
    """The counts of an ``.npy`` file (a memory map) or a Zarr store (read as sliced)."""
    if os.path.isdir(path):
        import zarr

        return zarr.open_array(path, mode="r")
    return np.load(path, mmap_mode="r")


def render_png(counts_path: str, png_path: str, max_iter: int, partial: str | None = None) -> None:
    """Draw counts as a coloured image (points in the set black), at most 4096 px a side.

    Runs on a worker, reading the counts through a memory map, so no image data passes
    through the client; the file appears under its name only once complete.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import colormaps
    from matplotlib.image import imsave

    counts = _open_counts(counts_path)
    step = max(1, math.ceil(max(counts.shape) / _PNG_MAX_SIDE))
    # Bands of whole rows, every step-th kept: a store is read a chunk's rows at a time.
    band = step * max(1, (64 << 20) // max(1, 4 * counts.shape[1] * step))
    view = np.concatenate(
        [np.asarray(counts[r : r + band], dtype=np.float64)[::step, ::step] for r in range(0, counts.shape[0], band)]
    )
    shade = np.log1p(view) / np.log1p(max_iter)
    rgba = colormaps["magma"](shade)
    rgba[view >= max_iter] = (0.0, 0.0, 0.0, 1.0)
    tmp = partial or png_path + ".partial.png"
    try:
        imsave(tmp, rgba, format="png")
    except OSError as e:  # the disk filled, say: name the file, not only the errno
        raise OSError(e.errno, f"params.output.png: could not write {png_path}: {e.strerror}") from None
    os.replace(tmp, png_path)
