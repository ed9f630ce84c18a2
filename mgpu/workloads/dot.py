"""x · y over billions of elements, accumulated in float64, each chunk recomputed to check."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

from .. import transfer
from ..device import Device, DeviceFacts
from ..errors import JobInputError
from ..inputs import InputParams, Operand
from ..kernels import dot_check, dot_f64
from ..planner import Plan, Tile, assign_contiguous, split
from ..sizes import format_bytes
from ..tiles import TileContext, run_tile
from .base import TileRecord, Workload
from .checks import unit_roundoff

__all__ = ["Dot", "DotParams"]


@dataclass
class _Sum:
    """A chunk's sum of products, and the chunk (for the check)."""

    value: float
    x: Any
    y: Any


class DotParams(InputParams):
    """``params:`` of a dot job."""

    input_operands = (Operand("x", ("n",)), Operand("y", ("n",)))

    n: int | None = Field(None, gt=0, description="length of x and y")
    dtype: Literal["float16", "float32", "float64"] | None = None


class Dot(Workload):
    """Dot product in contiguous chunks, one run of chunks per worker."""

    name = "dot"
    Params = DotParams
    unit = "GB/s"
    unit_scale = 1e9
    axes = ("n",)
    size_params = ("n",)
    grow = ("n",)
    verify_method = "float64 recompute"
    example = {"n": 100_003}

    def sources(self) -> tuple[Any, ...]:
        return self.params.sources()

    def host_bytes(self) -> int | None:
        p = self.params
        return 2 * p.n * np.dtype(p.dtype).itemsize if p.input != "random" else None

    def naive_host_bytes(self, plan: Plan) -> int | None:
        return self.host_bytes()  # each chunk is read by one tile only

    def plan(
        self, devices: dict[str, DeviceFacts], budget: int, tiling: dict[str, int], *, spill: bool = False
    ) -> Plan:
        p = self.params
        itemsize = np.dtype(p.dtype).itemsize
        workers = list(devices)
        # x and y of a chunk, plus room for the check's float64 pieces.
        max_len = int(budget * 0.75) // (2 * itemsize)
        if "n" in tiling:
            chunk = min(tiling["n"], p.n)
            if 2 * itemsize * chunk > budget and not spill:
                raise JobInputError(
                    f"tiling.n: a chunk of {chunk} elements needs {format_bytes(2 * itemsize * chunk)} "
                    f"but the per-device budget is {format_bytes(budget)}"
                )
            n_chunks = math.ceil(p.n / chunk)
        else:
            if max_len < 1:
                raise JobInputError(
                    f"cluster.memory_limit: {format_bytes(budget)} per device cannot hold one element of x and y"
                )
            per_worker = math.ceil(p.n / len(workers))
            n_chunks = len(workers) * math.ceil(per_worker / max_len)
        bounds = split(p.n, n_chunks)
        owners = assign_contiguous(len(bounds), workers)
        tiles = [Tile(i, {"n": b}, owners[i]) for i, b in enumerate(bounds)]
        longest = max(hi - lo for lo, hi in bounds)
        return Plan(tiles, "static", {"n": longest}, 2 * itemsize * longest, budget)

    def run(self, ctx: TileContext, tile: Tile) -> _Sum:
        dev = ctx.dev
        lo, hi = tile.bounds["n"]
        src_x, src_y = self.sources()
        x = src_x.read(dev, (lo, hi))
        y = src_y.read(dev, (lo, hi))
        with ctx.timer():
            value = dot_f64(dev.xp, x, y)
        ctx.record.work = float(x.nbytes + y.nbytes)
        return _Sum(value, x, y)

    def check(self, ctx: TileContext, tile: Tile, answer: _Sum) -> tuple[float, bool]:
        """The chunk's sum again by another kernel, in float64, within its rounding."""
        want, scale = dot_check(ctx.dev.xp, answer.x, answer.y)
        error = abs(answer.value - want) / scale if scale else abs(answer.value - want)
        return error, error <= unit_roundoff("float64") * (16 + np.sqrt(tile.size("n")))

    def store(self, ctx: TileContext, tile: Tile, answer: _Sum) -> bool:
        ctx.record.value = answer.value  # the partial answer reduce() adds up
        return False

    def spoil(self, answer: _Sum) -> _Sum:
        return _Sum(answer.value + 1.0, answer.x, answer.y)

    def ceiling(self) -> str:
        return "copy"  # memory-bound: set against a device copy's bytes per second

    def warmup(self, dev: Device, tile: Tile) -> None:
        small = Dot(self.params.model_copy(update={"n": 4099, "input": "random"}), verify=True)
        run_tile(small, dev, Tile(-1, {"n": (0, 4099)}))
        if self.params.input != "random" and dev.is_gpu:
            transfer.ready_buffers()  # the first tile paid for 32 cudaHostAlloc calls (2 a host thread)

    def reduce(self, records: list[TileRecord]) -> float:
        # In tile order, so the answer does not depend on which chunk finished first.
        return float(sum(r.value for r in sorted(records, key=lambda r: r.index)))
