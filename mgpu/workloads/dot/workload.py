"""x · y over billions of elements, accumulated in float64, each chunk recomputed to check."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
from pydantic import Field

from ...errors import JobInputError
from ...inputs import InputParams, Operand
from ...sizes import format_bytes
from ...tiling import Plan, Tile, assign_contiguous, check_tile_count, split
from ...worker import io, kernels
from ...worker.device import Device, DeviceFacts
from ...worker.kernels import to_host
from ...worker.stores import on_chunks, ranges_on
from ...worker.tile import TileContext, run_tile
from ..base import Estimates, HostBytes, TileRecord, Workload
from ..checks import unit_roundoff
from .kernels import dot_check, dot_f64, dot_scratch, random_pair, random_pair_with_sums

__all__ = ["Dot", "DotParams"]

# Pieces a chunk from files is read in on a GPU: each is reduced while the next is read.
_PIECE_BYTES = 1 << 30
_PIECE_ALIGN = 1024  # elements: every piece starts where the vector loads can


@dataclass
class _Sum:
    """A chunk's sum of products; what its check needs: the chunk, or (made inputs, read in
    pieces) the check's own sums, made beside it."""

    value: float
    x: Any = None
    y: Any = None
    want: tuple[float, float] | None = None  # (sum(x*y), sum|x*y|) by another route


class DotParams(InputParams):
    """``params:`` of a dot job."""

    input_operands = (Operand("x", ("n",)), Operand("y", ("n",)))

    # None only until validation: the input files or the defaults set both (InputParams).
    n: int = Field(None, gt=0, description="length of x and y")  # type: ignore[assignment]
    dtype: Literal["float16", "float32", "float64"] = Field(None)  # type: ignore[arg-type]


class Dot(Workload[DotParams], Estimates, HostBytes):
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

    def expected_work(self, plan: Plan) -> float:
        p = self.params
        return 2.0 * p.n * np.dtype(p.dtype).itemsize  # x and y read once

    def expected_seconds(self, plan: Plan, rates: dict[str, float], devices: int) -> float | None:
        # x and y read at the copy rate, made first where they are random; on a CPU the
        # check is a float64 pass of its own over them (a GPU's is fused into the making).
        seconds = super().expected_seconds(plan, rates, devices)
        p = self.params
        if seconds is not None and p.input == "random" and rates.get("random"):
            seconds += 2 * p.n / (rates["random"] * 1e9) / devices
        if seconds is not None and self.verify and plan.notes.get("check_pass") and rates.get("check"):
            seconds += p.n / (rates["check"] * 1e9) / devices
        return seconds

    def naive_host_bytes(self, plan: Plan) -> int | None:
        return self.host_bytes()  # each chunk is read by one tile only

    def plan(
        self, devices: dict[str, DeviceFacts], budget: int, tiling: dict[str, int], *, spill: bool = False
    ) -> Plan:
        p = self.params
        itemsize = np.dtype(p.dtype).itemsize
        workers = list(devices)

        def chunk_bytes(length: int) -> int:
            return 2 * itemsize * length + self.scratch(devices, length)

        if "n" in tiling:
            chunk = min(tiling["n"], p.n)
            if chunk_bytes(chunk) > budget and not spill:
                raise JobInputError(
                    f"tiling.n: a chunk of {chunk} elements needs {format_bytes(chunk_bytes(chunk))} "
                    f"but the per-device budget is {format_bytes(budget)}"
                )
            n_chunks = math.ceil(p.n / chunk)
        else:
            max_len = _longest_within(chunk_bytes, budget, p.n)
            if max_len < 1:
                raise JobInputError(
                    f"cluster.memory_limit: {format_bytes(budget)} per device cannot hold one element of x and y "
                    f"({format_bytes(chunk_bytes(1))} with the kernels' temporaries)"
                )
            per_worker = math.ceil(p.n / len(workers))
            n_chunks = len(workers) * math.ceil(per_worker / max_len)
        check_tile_count(
            n_chunks,
            keys="params.n" + (", tiling.n" if "n" in tiling else ""),
            what=f"chunks of {math.ceil(p.n / n_chunks):,} elements",
        )
        bounds = split(p.n, n_chunks)
        chunks = p.chunks_of("x")
        if chunks and "n" not in tiling:  # on the stores' chunks: each tile reads whole chunks
            bounds = ranges_on(p.n, on_chunks(max(hi - lo for lo, hi in bounds), chunks[0]), chunks[0])
        owners = assign_contiguous(len(bounds), workers)
        tiles = [Tile(i, {"n": b}, owners[i]) for i, b in enumerate(bounds)]
        longest = max(hi - lo for lo, hi in bounds)
        cpu = any(f.backend == "cpu" for f in devices.values())
        return Plan(tiles, "static", {"n": longest}, chunk_bytes(longest), budget, notes={"check_pass": cpu})

    @staticmethod
    def scratch(devices: dict[str, DeviceFacts], n: int) -> int:
        """Bytes a task of at most ``n`` elements holds beside its chunks of x and y: a
        CPU's kernels' temporaries (the random chunks' hash, then the float64 pieces of
        the sums, one after the other); a GPU's kernels make none."""
        cpu = any(f.backend == "cpu" for f in devices.values())
        return max(kernels.random_scratch(n), dot_scratch(n)) if cpu else 0

    def run(self, ctx: TileContext, tile: Tile) -> _Sum:
        """Make or read the chunk's x and y and reduce them.

        Random inputs on a GPU are made by one kernel that also sums x*y and |x*y| (in
        float64) from the values as it makes them: the check then needs no pass over x and
        y of its own. Inputs read by KvikIO come in pieces, each reduced (and checked) while
        the next is read (:meth:`_pieces`). ``record.extra["phases"]`` gives each step's
        device seconds and bytes; the work counted is what the job moved (see
        :meth:`bound_note`).
        """
        dev, p = ctx.dev, self.params
        lo, hi = tile.bounds["n"]
        nbytes = 2 * (hi - lo) * np.dtype(p.dtype).itemsize
        phases: dict[str, dict[str, float]] = {}
        if p.input == "random":
            made = dict(seed=p.seed, operands=(0, 1), elements=(lo, hi), dtype=p.dtype)
            sums = None
            with ctx.timer() as gen:
                if dev.is_gpu:
                    x, y, sums = random_pair_with_sums(dev.xp, **made)  # type: ignore[arg-type]
                else:
                    x, y = random_pair(dev.xp, **made)  # type: ignore[arg-type]
            with ctx.timer() as t:
                value = dot_f64(dev.xp, x, y)
            checked: tuple[float, float] | None = None
            if ctx.verify and sums is None:  # a CPU's check: a float64 pass of its own
                with ctx.check_timer():
                    checked = dot_check(dev.xp, x, y)
            elif ctx.verify:
                total, magnitude = (float(v) for v in to_host(dev.xp, sums))  # sum(x*y), sum|x*y|
                checked = (total, magnitude)
            answer = _Sum(value, want=checked)
            phases["generate"] = {"seconds": gen.seconds, "bytes": nbytes}
            phases["reduce"] = {"seconds": t.seconds, "bytes": nbytes}
            ctx.record.work = float(2 * nbytes)  # written by the generation, read by the reduction
        else:
            answer = _Sum(0.0)
            reduce_s = check_s = 0.0
            want = [0.0, 0.0]
            for x, y, whole in self._pieces(dev, lo, hi):
                with ctx.timer() as t:
                    answer.value += dot_f64(dev.xp, x, y)
                reduce_s += t.seconds
                if whole:  # the one piece: checked by check(), as it comes
                    answer.x, answer.y = x, y
                elif ctx.verify:
                    with ctx.check_timer() as c:
                        s_, a_ = dot_check(dev.xp, x, y)
                    want, check_s = [want[0] + s_, want[1] + a_], check_s + c.seconds
            if answer.x is None and ctx.verify:
                answer.want = (want[0], want[1])
                phases["check"] = {"seconds": check_s, "bytes": nbytes}
            phases["reduce"] = {"seconds": reduce_s, "bytes": nbytes}
            ctx.record.work = float(nbytes)
        ctx.record.extra["phases"] = phases
        return answer

    def _pieces(self, dev: Device, lo: int, hi: int) -> Iterator[tuple[Any, Any, bool]]:
        """Elements ``lo:hi`` of x and y as they arrive: ``(x, y, whole)``.

        On a GPU, where KvikIO reads both files, every piece's reads start at once and each
        piece is handed on as it lands, so its reduction runs while the later pieces are
        read (reduced after the whole read, the reduction and check added 3 % to a 16 GB
        read). Elsewhere the whole chunk at once (``whole``).
        """
        src_x, src_y = self.sources()
        where_x, where_y = (src.kvikio_range((lo, hi)) if dev.is_gpu else None for src in (src_x, src_y))
        if where_x is None or where_y is None:
            yield src_x.read(dev, (lo, hi)), src_y.read(dev, (lo, hi)), True
            return
        dtype = self.params.dtype
        itemsize = np.dtype(dtype).itemsize
        x, y = dev.xp.empty(hi - lo, dtype), dev.xp.empty(hi - lo, dtype)
        step = max(_PIECE_ALIGN, _PIECE_BYTES // itemsize // _PIECE_ALIGN * _PIECE_ALIGN)
        bounds = [(a, min(a + step, hi - lo)) for a in range(0, hi - lo, step)]  # starts stay aligned
        requests = []
        for a, b in bounds:
            requests += [(src_x.info.path, where_x[0] + a * itemsize, x[a:b])]
            requests += [(src_y.info.path, where_y[0] + a * itemsize, y[a:b])]
        dev.synchronize()  # KvikIO copies on streams of its own: nothing may still use x and y
        landed = io.read_in_order(requests)
        seconds = 0.0
        for a, b in bounds:
            next(landed)
            seconds = next(landed)
            yield x[a:b], y[a:b], False
        dev.count_read("h2d", x.nbytes + y.nbytes, seconds)

    def check(self, ctx: TileContext, tile: Tile, answer: _Sum) -> tuple[float, bool]:
        """The chunk's sum again by another route, in float64, within its rounding: the
        generation's own sums, each piece's second kernel, or the whole chunk's."""
        want, scale = answer.want if answer.want is not None else dot_check(ctx.dev.xp, answer.x, answer.y)
        error = abs(answer.value - want) / scale if scale else abs(answer.value - want)
        return error, bool(error <= unit_roundoff("float64") * (16 + np.sqrt(tile.size("n"))))

    def store(self, ctx: TileContext, tile: Tile, answer: _Sum) -> bool:
        ctx.record.value = answer.value  # the partial answer combine() adds up
        return False

    def bound_note(self) -> str | None:
        p = self.params
        if p.input != "random":
            return None
        nbytes = 2 * p.n * np.dtype(p.dtype).itemsize
        return (
            f"what the job moved: x and y made on the device ({format_bytes(nbytes)} written) "
            f"and reduced ({format_bytes(nbytes)} read)"
        )

    def ceiling(self) -> str:
        return "copy"  # memory-bound: set against a device copy's bytes per second

    def warm_key(self, tile: Tile) -> str:
        # Random operands: the warm-up is the same small dot of this dtype, whatever the job.
        if self.params.input != "random":
            return super().warm_key(tile)  # its files' readers are the job's own
        return f"dot|{self.params.dtype}"

    def warmup(self, dev: Device, tile: Tile) -> None:
        small = Dot(self.params.model_copy(update={"n": 4099, "input": "random"}), verify=True)
        run_tile(small, dev, Tile(-1, {"n": (0, 4099)}))
        if self.params.input != "random" and dev.is_gpu:
            self.sources()[0].warm_up(dev, contiguous=True)

    def combine(self, records: list[TileRecord]) -> float:
        # In tile order, so the answer does not depend on which chunk finished first.
        return float(sum(cast(float, r.value) for r in sorted(records, key=lambda r: r.index)))  # every tile has one


def _longest_within(size: Callable[[int], int], budget: int, most: int) -> int:
    """The largest length in [1, most] whose ``size`` (growing with it) fits ``budget``; 0 if none."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
