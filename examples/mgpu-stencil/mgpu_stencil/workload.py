"""``workload: stencil`` — a 2-D Jacobi (heat-equation) sweep over a grid in row bands.

The grid (random from the seed, or an ``.npy`` file) is cut into row bands, one or more
per device; each band stays on its worker for the whole run and, at every step, sends
its first and last rows to the bands above and below it and takes theirs as its halo
rows (mgpu's stepped tiles: on one worker the rows stay on the device, between workers
they go through the host). Every step reads the grid once and writes it once, so a
job's rate is bytes per second, set against the device's copy ceiling.

Checked two ways: every step, a sample of each band's rows (its first and last, which
use the halos, and one more) is recomputed in float64 from the step before; and on a
grid that fits the client, the final bands are compared with NumPy's sweep of the
whole grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from mgpu.workload import (
    Device,
    DeviceFacts,
    HostBytes,
    InputParams,
    JobInputError,
    Operand,
    Outputs,
    Plan,
    Stepped,
    Tile,
    TileContext,
    TileRecord,
    Workload,
    assign_contiguous,
    format_bytes,
    output_sink,
    split,
    split_by_size,
)

from .kernels import jacobi_step, row_error

__all__ = ["Stencil", "StencilParams", "sweep"]

# The client checks the final grid against NumPy's own sweep when the grid and the sweep
# are this small (NumPy does ~0.5-1 G cell-steps a second on one core).
_REFERENCE_CELLS = 1 << 22
_REFERENCE_CELL_STEPS = 1 << 31
# Rows read from the input per piece when a band is made (bounds the temporary).
_READ_BYTES = 256 << 20


class StencilParams(InputParams):
    """``params:`` of a stencil job."""

    input_operands = (Operand("grid", ("height", "width")),)

    height: int | None = Field(None, ge=3, description="rows of the grid")
    width: int | None = Field(None, ge=3, description="columns of the grid")
    steps: int = Field(100, gt=0, description="Jacobi steps")
    dtype: Literal["float32", "float64"] | None = None
    bands_per_device: int = Field(1, gt=0)
    output: str | None = None  # the final grid, as .npy or a .zarr store

    @model_validator(mode="after")
    def _float(self) -> StencilParams:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"input.grid: holds {self.dtype}; allowed: float32, float64")
        if self.height < 3 or self.width < 3:  # type: ignore[operator]
            raise ValueError(f"input.grid: a grid of {self.height} x {self.width}; both sides must be 3 or more")
        return self


@dataclass
class _Band:
    """A band on its device: the grid now (``cur``) and a step before (``prev``), each with
    its halo rows, and the largest error the sampled rows had so far (when checked)."""

    cur: Any
    prev: Any
    error: Any = None
    sends: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # neighbour -> its two send rows


def sweep(grid: np.ndarray, steps: int) -> np.ndarray:
    """``steps`` Jacobi steps of a whole grid in NumPy, as the bands compute them."""
    height = grid.shape[0]
    u = np.empty((height + 2, grid.shape[1]), grid.dtype)
    u[1:-1] = grid
    out = u.copy()
    for _ in range(steps):
        jacobi_step(np, u, out, 0, height)
        u, out = out, u
    return u[1:-1].copy()


class Stencil(Workload, HostBytes, Stepped, Outputs):
    """Row bands of a grid swept ``steps`` times, each exchanging halo rows with its neighbours."""

    name = "stencil"
    Params = StencilParams
    unit = "GB/s"
    unit_scale = 1e9
    axes = ("rows",)
    size_params = ("height", "width")
    grow = ("height",)
    verify_method = "sampled rows recomputed each step; NumPy sweep when the grid fits the client"
    example = {"height": 40, "width": 24, "steps": 5}

    def prepare(self, *, force: bool) -> None:
        p = self.params
        if p.output:
            self.sinks["grid"] = output_sink(p.output, (p.height, p.width), p.dtype, key="params.output", force=force)

    def ceiling(self) -> str:
        return "copy"  # a step reads the grid and writes it once: the device's copy rate bounds it

    def host_bytes(self) -> int | None:
        p = self.params
        grid = p.height * p.width * np.dtype(p.dtype).itemsize
        total = (grid if p.input != "random" else 0) + (grid if p.output else 0)
        return total or None

    def plan(
        self, devices: dict[str, DeviceFacts], budget: int, tiling: dict[str, int], *, spill: bool = False
    ) -> Plan:
        p = self.params
        itemsize = np.dtype(p.dtype).itemsize
        workers = list(devices)
        if "rows" in tiling:
            bands = split_by_size(p.height, tiling["rows"])
        else:
            bands = split(p.height, len(workers) * p.bands_per_device)
        tallest = max(hi - lo for lo, hi in bands)
        # Both copies of the band with their halo rows, and the halo rows on their way.
        need = 2 * (tallest + 2) * p.width * itemsize + 4 * p.width * 8
        if need > budget and not spill:
            raise JobInputError(
                f"cluster.memory_limit: a band of {tallest} x {p.width} needs {format_bytes(need)} per device "
                f"(two copies of it) but the budget is {format_bytes(budget)}; use more devices or "
                "params.bands_per_device, or a larger budget"
            )
        owners = assign_contiguous(len(bands), workers)
        last = len(bands) - 1
        tiles = [
            Tile(
                i,
                {"rows": b},
                owners[i],
                neighbours=tuple(n for n in (i - 1, i + 1) if 0 <= n <= last),
                args={"above": i - 1 if i > 0 else None, "below": i + 1 if i < last else None},
            )
            for i, b in enumerate(bands)
        ]
        return Plan(tiles, "static", {"rows": tallest, "cols": p.width}, need, budget, steps=p.steps)

    # -- on a worker ------------------------------------------------------------------
    def start(self, ctx: TileContext, tile: Tile) -> _Band:
        """The band and the rows just above and below it, from the input."""
        p = self.params
        dev, xp = ctx.dev, ctx.dev.xp
        (source,) = self.sources()
        r0, r1 = tile.bounds["rows"]
        lo, hi = max(0, r0 - 1), min(p.height, r1 + 1)
        cur = xp.empty((r1 - r0 + 2, p.width), dtype=p.dtype)
        piece = max(1, _READ_BYTES // (p.width * np.dtype(p.dtype).itemsize))
        for a, b in split_by_size(hi - lo, piece):
            at = lo + a - (r0 - 1)  # the local row of grid row lo + a
            cur[at : at + b - a] = source.read(dev, (lo + a, lo + b), (0, p.width))
        if r0 == 0:
            cur[0] = 0  # above the grid: never read
        if r1 == p.height:
            cur[-1] = 0
        error = xp.zeros((), dtype=np.float64) if ctx.verify else None
        sends = {
            n: (xp.empty(p.width, dtype=p.dtype), xp.empty(p.width, dtype=p.dtype))
            for n in (tile.args["above"], tile.args["below"])
            if n is not None
        }
        return _Band(cur, xp.empty_like(cur), error, sends)

    def sources(self) -> tuple[Any, ...]:
        return self.params.sources()

    def step(self, ctx: TileContext, tile: Tile, step: int, received: dict[int, Any]) -> dict[int, Any]:
        """The halo rows in, then the band's first and last rows (what the neighbours get);
        the interior follows in finish_step, while those rows travel."""
        p = self.params
        dev, xp = ctx.dev, ctx.dev.xp
        band: _Band = ctx.state
        r0, r1 = tile.bounds["rows"]
        rows = r1 - r0
        above, below = tile.args["above"], tile.args["below"]
        for neighbour, row in ((above, 0), (below, rows + 1)):
            if neighbour in received:
                halo = received[neighbour]
                band.cur[row] = dev.to_device(halo) if isinstance(halo, np.ndarray) and dev.is_gpu else halo
        with ctx.timer():
            for r in sorted({1, rows}):  # each with the rows beside it, as a band of one
                jacobi_step(xp, band.cur[r - 1 : r + 2], band.prev[r - 1 : r + 2], r0 + r - 1, p.height)
        # Into the band's own send rows, two of each, used in turn: the rows of this step
        # are read by the neighbour's next step, which the core orders before this band's
        # step after next (a fresh array each step could be freed and reused too soon).
        sends = {}
        for neighbour, row in ((above, 1), (below, rows)):
            if neighbour is not None:
                out = band.sends[neighbour][step % 2]
                out[...] = band.prev[row]  # prev: where this step writes, until the swap
                sends[neighbour] = out
        return sends

    def finish_step(self, ctx: TileContext, tile: Tile, step: int) -> None:
        p = self.params
        xp = ctx.dev.xp
        band: _Band = ctx.state
        r0, r1 = tile.bounds["rows"]
        rows = r1 - r0
        if rows > 2:  # the rows between the first and the last
            with ctx.timer():
                jacobi_step(xp, band.cur[1 : rows + 1], band.prev[1 : rows + 1], r0 + 1, p.height)
        band.cur, band.prev = band.prev, band.cur  # cur: after this step; prev: before it
        if band.error is not None:
            for r in _sampled_rows(rows, step):
                band.error = xp.maximum(band.error, row_error(xp, band.prev, band.cur, r, r0, p.height))
        ctx.record.work += 2.0 * rows * p.width * band.cur.itemsize  # the band read once, written once

    def save(self, ctx: TileContext, tile: Tile) -> dict[str, Any]:
        """The band after a step (with its halo rows) and its sampled error, in host memory."""
        band: _Band = ctx.state
        dev = ctx.dev
        cur = dev.to_host(band.cur)  # on a GPU a new array; on a CPU the band, which the next steps overwrite
        return {
            "cur": cur if dev.is_gpu else cur.copy(),
            "error": None if band.error is None else float(dev.to_host(band.error)),
        }

    def restore(self, ctx: TileContext, tile: Tile, step: int, saved: dict[str, Any]) -> dict[int, Any]:
        """The band as :meth:`save` kept it; sends its first and last rows, as its step before did."""
        p = self.params
        dev, xp = ctx.dev, ctx.dev.xp
        cur = dev.to_device(saved["cur"]) if dev.is_gpu else saved["cur"].copy()
        error = None if saved["error"] is None else xp.asarray(saved["error"], dtype=np.float64)
        r0, r1 = tile.bounds["rows"]
        rows = r1 - r0
        above, below = tile.args["above"], tile.args["below"]
        sends = {
            n: (xp.empty(p.width, dtype=p.dtype), xp.empty(p.width, dtype=p.dtype))
            for n in (above, below)
            if n is not None
        }
        band = ctx.state = _Band(cur, xp.empty_like(cur), error, sends)
        out = {}
        for neighbour, row in ((above, 1), (below, rows)):
            if neighbour is not None:
                out[neighbour] = band.sends[neighbour][(step - 1) % 2]
                out[neighbour][...] = band.cur[row]
        return out

    def run(self, ctx: TileContext, tile: Tile) -> _Band:
        """The band after its last step (the steps did the work)."""
        return ctx.state

    def check(self, ctx: TileContext, tile: Tile, answer: _Band) -> tuple[float, bool]:
        """The rows sampled at every step, and the final band's sample recomputed from the step before."""
        p = self.params
        xp = ctx.dev.xp
        r0, r1 = tile.bounds["rows"]
        error = answer.error
        for r in _sampled_rows(r1 - r0, p.steps):
            error = xp.maximum(error, row_error(xp, answer.prev, answer.cur, r, r0, p.height))
        value = float(ctx.dev.to_host(error))
        return value, value <= 4 * float(np.finfo(p.dtype).eps)

    def store(self, ctx: TileContext, tile: Tile, answer: _Band) -> bool:
        p = self.params
        r0, r1 = tile.bounds["rows"]
        rows = answer.cur[1 : r1 - r0 + 1]
        if ctx.verify and _small(p):  # judge() sets it against NumPy's sweep
            ctx.record.extra["band"] = ctx.dev.to_host(rows)
        if "grid" not in self.sinks:
            return False
        self.sinks["grid"].write((slice(r0, r1), slice(None)), rows, ctx.dev)
        return True

    def warmup(self, dev: Device, tile: Tile) -> None:
        # The kernel (compiled on first use) and the check's array code, on a small band.
        xp = dev.xp
        with dev.on_stream():
            u = xp.ones((6, 64), dtype=self.params.dtype)
            out = xp.empty_like(u)
            jacobi_step(xp, u, out, 1, 10)
            float(dev.to_host(row_error(xp, u, out, 2, 1, 10)))

    # -- on the client ----------------------------------------------------------------
    def reference(self, plan: Plan) -> dict[int, np.ndarray] | None:
        """NumPy's sweep of the whole grid, cut into the plan's bands (small grids only)."""
        p = self.params
        if not _small(p):
            return None
        (source,) = self.sources()
        cpu = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 0, 0, "client"))
        final = sweep(np.ascontiguousarray(source.read(cpu, (0, p.height), (0, p.width))), p.steps)
        return {t.index: final[t.bounds["rows"][0] : t.bounds["rows"][1]] for t in plan.tiles}

    def judge(self, records: list[TileRecord], reference: dict[int, np.ndarray] | None) -> None:
        if reference is None:
            return
        for record in records:
            got = record.extra.pop("band", None)
            want = reference[record.index]
            if got is None or got.shape != want.shape:
                record.verify_ok = False
                continue
            scale = max(float(np.abs(want).max()), float(np.finfo(np.float64).tiny))
            error = float(np.abs(got.astype(np.float64) - want).max()) / scale
            record.verify_error = max(record.verify_error or 0.0, error)
            record.verify_ok = bool(record.verify_ok) and error <= 4 * float(np.finfo(want.dtype).eps)


def _small(p: StencilParams) -> bool:
    cells = p.height * p.width  # type: ignore[operator]
    return cells <= _REFERENCE_CELLS and cells * p.steps <= _REFERENCE_CELL_STEPS


def _sampled_rows(rows: int, step: int) -> list[int]:
    """The local rows of a band checked after a step: its first and last (they use the
    halos) and one more that moves with the step."""
    return sorted({1, rows, 1 + (step * 7919) % rows})
