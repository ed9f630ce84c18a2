"""``workload: stencil`` — a 2-D Jacobi (heat-equation) sweep over a grid in row bands.

The grid (random from the seed, or an ``.npy`` file) is cut into row bands, one or more
per device; each band stays on its worker for the whole run. The bands exchange deep
halos: each keeps ``w`` halo rows above and below it (``sweeps_per_exchange``), and one of
mgpu's steps (a task per band) runs ``w`` sweeps, the rows it can still renew shrinking
by one a sweep on each side with a neighbour (:mod:`mgpu_stencil.halo`), then sends its
first and last ``w`` rows to the bands above and below it, which take them as their halo
rows (on one worker the rows stay on the device; between workers they go device to
device where they can, else through the host). Each cell gets the same arithmetic as in a
sweep of the whole grid, so the result does not depend on the bands or on ``w``; a job
of ``steps`` sweeps exchanges ``ceil(steps / w) - 1`` times, not ``steps - 1``. Every
sweep reads the grid once and writes it once, so a job's rate is bytes per second, set
against the device's copy ceiling.

Checked two ways: after every step, a sample of each band's rows (its first and last,
which use the halos, and one more) is recomputed in float64 from the sweep before; and
on a grid that fits the client, the final bands are compared with NumPy's sweep of the
whole grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

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

from . import halo
from .kernels import jacobi_step, row_error

__all__ = ["Stencil", "StencilParams", "sweep"]

# The client checks the final grid against NumPy's own sweep when the grid and the sweep
# are this small (NumPy does ~0.5-1 G cell-steps a second on one core).
_REFERENCE_CELLS = 1 << 22
_REFERENCE_CELL_STEPS = 1 << 31
# Rows read from the input per piece when a band is made (bounds the temporary).
_READ_BYTES = 256 << 20
# Sweeps per exchange at most, where params.sweeps_per_exchange is auto. An exchange costs
# a round trip through the scheduler (3-10 ms where workers share a GPU, which idles
# meanwhile), paid once per step; a deeper halo costs about w - 1 rows swept twice per band
# and sweep, and 2 w rows of memory. On one H100 (65536² float32, a sweep ~12.6 ms), with 8
# bands and a 10 ms round trip, 200 sweeps cost ~2 s of round trips at w = 1, 125 ms at 16
# (5%, the limit wanted), 60 ms at 32, while the rows swept twice stay under 0.4% of the
# work: 32 leaves room for slower round trips at a cost no one measures.
_AUTO_SWEEPS = 32


class StencilParams(InputParams):
    """``params:`` of a stencil job."""

    input_operands = (Operand("grid", ("height", "width")),)

    height: int | None = Field(None, ge=3, description="rows of the grid")
    width: int | None = Field(None, ge=3, description="columns of the grid")
    steps: int = Field(100, gt=0, description="Jacobi steps")
    dtype: Literal["float32", "float64"] | None = None
    bands_per_device: int = Field(1, gt=0)
    sweeps_per_exchange: int | Literal["auto"] = Field(
        "auto",
        description="sweeps a band runs between two halo exchanges, its halo that many rows deep "
        f"(auto: {_AUTO_SWEEPS}, or fewer where the steps or the shortest band are fewer)",
    )
    output: str | None = None  # the final grid, as .npy or a .zarr store

    @field_validator("sweeps_per_exchange", mode="before")
    @classmethod
    def _sweeps(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"{value!r}; allowed: a whole number of sweeps, 1 or more, or auto")

    @model_validator(mode="after")
    def _float(self) -> StencilParams:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"input.grid: holds {self.dtype}; allowed: float32, float64")
        if self.height < 3 or self.width < 3:  # type: ignore[operator]
            raise ValueError(f"input.grid: a grid of {self.height} x {self.width}; both sides must be 3 or more")
        return self


@dataclass
class _Band:
    """A band on its device: the grid now (``cur``) and a sweep before (``prev``), each with
    its halo rows (``depth`` above and below), and the largest error the sampled rows had
    so far (when checked)."""

    cur: Any
    prev: Any
    error: Any = None
    sends: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # neighbour -> its two blocks of send rows


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


def sweeps_per_exchange(p: StencilParams, shortest: int) -> int:
    """The sweeps between exchanges (the halos' depth) for bands of ``shortest`` rows or
    more: the param, or at most ``_AUTO_SWEEPS`` where it is auto; never more than the
    steps, and never more than a band's rows where bands exchange (a neighbour's halo is
    made of one band's rows)."""
    if p.sweeps_per_exchange == "auto":
        return max(1, min(_AUTO_SWEEPS, p.steps, shortest))
    return min(p.sweeps_per_exchange, p.steps)


class Stencil(Workload, HostBytes, Stepped, Outputs):
    """Row bands of a grid swept ``steps`` times, each exchanging deep halos with its
    neighbours every ``sweeps_per_exchange`` sweeps."""

    name = "stencil"
    Params = StencilParams
    unit = "GB/s"
    unit_scale = 1e9
    axes = ("rows",)
    size_params = ("height", "width")
    grow = ("height",)
    verify_method = "sampled rows recomputed each step; NumPy sweep when the grid fits the client"
    example = {"height": 40, "width": 24, "steps": 5, "sweeps_per_exchange": 2}

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
        shortest = min(hi - lo for lo, hi in bands)
        depth = sweeps_per_exchange(p, shortest)
        if len(bands) > 1 and depth > shortest:
            raise JobInputError(
                f"params.sweeps_per_exchange: {depth} sweeps between exchanges need halos of {depth} rows, "
                f"made of a band's rows, but the shortest band has {shortest}; allowed: 1 to {shortest}, or auto"
            )
        # Both copies of the band with their halo rows, and the rows sent and received
        # (two blocks of each per neighbour).
        exchanged = 8 * depth if len(bands) > 1 else 0
        need = (2 * (tallest + 2 * depth) + exchanged) * p.width * itemsize
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
                args={"above": i - 1 if i > 0 else None, "below": i + 1 if i < last else None, "depth": depth},
            )
            for i, b in enumerate(bands)
        ]
        steps = math.ceil(p.steps / depth)  # the last runs what is left of the sweeps
        return Plan(tiles, "static", {"rows": tallest, "cols": p.width}, need, budget, steps=steps)

    # -- on a worker ------------------------------------------------------------------
    def start(self, ctx: TileContext, tile: Tile) -> _Band:
        """The band and the ``depth`` rows above and below it, from the input."""
        p = self.params
        dev, xp = ctx.dev, ctx.dev.xp
        (source,) = self.sources()
        r0, r1 = tile.bounds["rows"]
        depth = tile.args["depth"]
        lo, hi = max(0, r0 - depth), min(p.height, r1 + depth)
        cur = xp.empty((r1 - r0 + 2 * depth, p.width), dtype=p.dtype)
        piece = max(1, _READ_BYTES // (p.width * np.dtype(p.dtype).itemsize))
        for a, b in split_by_size(hi - lo, piece):
            at = lo + a - (r0 - depth)  # the local row of grid row lo + a
            cur[at : at + b - a] = source.read(dev, (lo + a, lo + b), (0, p.width))
        error = xp.zeros((), dtype=np.float64) if ctx.verify else None
        return self._band(ctx, tile, cur, error)

    def _band(self, ctx: TileContext, tile: Tile, cur: Any, error: Any) -> _Band:
        """A band around ``cur`` (its rows and halos as they are now), with the rest of what
        its steps use."""
        p = self.params
        xp = ctx.dev.xp
        r0, r1 = tile.bounds["rows"]
        depth = tile.args["depth"]
        prev = xp.empty_like(cur)
        # Rows beyond the grid's edges: read by the sweeps of the grid's first and last
        # rows, which keep their values, and never written.
        for buf in (cur, prev):
            buf[: max(0, depth - r0)] = 0
            buf[buf.shape[0] - max(0, r1 + depth - p.height) :] = 0
        sends = {
            n: (xp.empty((depth, p.width), dtype=p.dtype), xp.empty((depth, p.width), dtype=p.dtype))
            for n in (tile.args["above"], tile.args["below"])
            if n is not None
        }
        return _Band(cur, prev, error, sends)

    def sources(self) -> tuple[Any, ...]:
        return self.params.sources()

    def _sweeps(self, tile: Tile, step: int) -> int:
        """The sweeps of step ``step``: ``depth``, the last step what is left."""
        depth = tile.args["depth"]
        return min(depth, self.params.steps - step * depth)

    def _sends(self, tile: Tile, step: int) -> bool:
        """Whether step ``step`` sends its neighbours anything (the last step does not)."""
        last = math.ceil(self.params.steps / tile.args["depth"]) - 1
        return step < last and (tile.args["above"] is not None or tile.args["below"] is not None)

    def _sweep(self, xp: Any, tile: Tile, src: Any, dst: Any, span: halo.Span) -> None:
        """One sweep of local rows ``span`` from ``src`` into ``dst``."""
        lo, hi = span
        r0 = tile.bounds["rows"][0]
        jacobi_step(xp, src[lo - 1 : hi + 1], dst[lo - 1 : hi + 1], r0 - tile.args["depth"] + lo, self.params.height)

    def step(self, ctx: TileContext, tile: Tile, step: int, received: dict[int, Any]) -> dict[int, Any]:
        """The halo rows in, then the sweeps of the rows the neighbours' halos depend on,
        and the band's first and last ``depth`` rows after them (what the neighbours get);
        the interior follows in finish_step, while those rows travel."""
        dev, xp = ctx.dev, ctx.dev.xp
        band: _Band = ctx.state
        r0, r1 = tile.bounds["rows"]
        rows, depth = r1 - r0, tile.args["depth"]
        above, below = tile.args["above"], tile.args["below"]
        for neighbour, at in ((above, 0), (below, rows + depth)):
            if neighbour in received:
                rows_in = received[neighbour]
                band.cur[at : at + depth] = (
                    dev.to_device(rows_in) if isinstance(rows_in, np.ndarray) and dev.is_gpu else rows_in
                )
        if not self._sends(tile, step):
            return {}
        bufs = (band.cur, band.prev)
        with ctx.timer():
            for j in range(1, depth + 1):
                for span in halo.edges(rows, depth, j, above is not None, below is not None):
                    self._sweep(xp, tile, bufs[(j - 1) % 2], bufs[j % 2], span)
        # Into the band's own send rows, two blocks of each, used in turn: the rows of this
        # step are read by the neighbour's next step, which the core orders before this
        # band's step after next (a fresh array each step could be freed and reused too soon).
        done = bufs[depth % 2]
        sends = {}
        for neighbour, at in ((above, depth), (below, rows)):
            if neighbour is not None:
                out = band.sends[neighbour][step % 2]
                out[...] = done[at : at + depth]
                sends[neighbour] = out
        return sends

    def finish_step(self, ctx: TileContext, tile: Tile, step: int) -> None:
        p = self.params
        xp = ctx.dev.xp
        band: _Band = ctx.state
        r0, r1 = tile.bounds["rows"]
        rows, depth = r1 - r0, tile.args["depth"]
        above, below = tile.args["above"] is not None, tile.args["below"] is not None
        sweeps, sent = self._sweeps(tile, step), self._sends(tile, step)
        bufs = (band.cur, band.prev)
        with ctx.timer():
            for j in range(1, sweeps + 1):
                span = halo.interior(rows, depth, sweeps, j, above, below, sent=sent)
                if span is not None:
                    self._sweep(xp, tile, bufs[(j - 1) % 2], bufs[j % 2], span)
        if sweeps % 2:
            band.cur, band.prev = band.prev, band.cur  # cur: after this step's last sweep; prev: before it
        if band.error is not None:
            for r in _sampled_rows(rows, step):
                local = depth - 1 + r
                error = row_error(xp, band.prev, band.cur, local, r0 - depth + 1, p.height)
                band.error = xp.maximum(band.error, error)
        ctx.record.work += (
            sweeps * 2.0 * rows * p.width * band.cur.itemsize
        )  # each sweep reads and writes the band once

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
        """The band as :meth:`save` kept it; sends its first and last ``depth`` rows, as its
        step before did."""
        dev, xp = ctx.dev, ctx.dev.xp
        cur = dev.to_device(saved["cur"]) if dev.is_gpu else saved["cur"].copy()
        error = None if saved["error"] is None else xp.asarray(saved["error"], dtype=np.float64)
        r0, r1 = tile.bounds["rows"]
        rows, depth = r1 - r0, tile.args["depth"]
        band = ctx.state = self._band(ctx, tile, cur, error)
        out = {}
        for neighbour, at in ((tile.args["above"], depth), (tile.args["below"], rows)):
            if neighbour is not None:
                out[neighbour] = band.sends[neighbour][(step - 1) % 2]
                out[neighbour][...] = band.cur[at : at + depth]
        return out

    def run(self, ctx: TileContext, tile: Tile) -> _Band:
        """The band after its last step (the steps did the work; where the plan has one
        step, the core runs none, and the band makes it here)."""
        if ctx.state is None:
            ctx.state = self.start(ctx, tile)
            self.step(ctx, tile, 0, {})
            self.finish_step(ctx, tile, 0)
        return ctx.state

    def check(self, ctx: TileContext, tile: Tile, answer: _Band) -> tuple[float, bool]:
        """The rows sampled at every step, and the final band's sample recomputed from the sweep before."""
        p = self.params
        xp = ctx.dev.xp
        r0, r1 = tile.bounds["rows"]
        depth = tile.args["depth"]
        error = answer.error
        for r in _sampled_rows(r1 - r0, math.ceil(p.steps / depth)):
            local = depth - 1 + r
            error = xp.maximum(error, row_error(xp, answer.prev, answer.cur, local, r0 - depth + 1, p.height))
        value = float(ctx.dev.to_host(error))
        return value, value <= 4 * float(np.finfo(p.dtype).eps)

    def store(self, ctx: TileContext, tile: Tile, answer: _Band) -> bool:
        p = self.params
        r0, r1 = tile.bounds["rows"]
        depth = tile.args["depth"]
        rows = answer.cur[depth : depth + r1 - r0]
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
    """The rows of a band (1 its first, ``rows`` its last) checked after a step: its first
    and last (they use the halos) and one more that moves with the step."""
    return sorted({1, rows, 1 + (step * 7919) % rows})
