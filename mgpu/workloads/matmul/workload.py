"""C[m, n] = A[m, k] @ B[k, n], tiled over C, each tile checked by Freivalds' method."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from ...errors import JobInputError
from ...inputs import InputParams, Operand
from ...roofline import sustained_seconds
from ...sizes import format_bytes
from ...tiling import Panel, Plan, Tile, assign_contiguous, check_tile_count, split, split_by_size
from ...worker.device import Device, DeviceFacts
from ...worker.kernels import matvec_f64, random_block
from ...worker.panels import PanelRef, copy_rows, enable_all_peers, peer_ordinal, publish, resident
from ...worker.stores import on_chunks, output_sink, ranges_on
from ...worker.tile import TileContext, run_tile
from ..base import Estimates, HostBytes, Outputs, Workload
from ..checks import freivalds_vector, relative_residual, unit_roundoff
from . import overlap
from .tiling import choose_matmul_tiles, cpu_working_set, matmul_working_set

__all__ = ["DistributedMatmul", "Matmul", "MatmulParams", "PerTileMatmul"]

# The warm-up product keeps the tile's m and n (cuBLAS chooses its kernel mostly by them)
# with a short k, so it costs a few ms; its C stays under this many bytes.
_WARMUP_K = 1024
_WARMUP_C_BYTES = 4 << 30
# cublasMath_t's value (cuBLAS 11+); CuPy's cublas module does not name it.
_CUBLAS_TF32_TENSOR_OP_MATH = 3
# Rows of a peer's B panel per copy: small enough to start computing soon, large enough
# that each gemm stays efficient.
_PEER_BLOCK = 4096
# With an output file, distributed tiles are cut to about this many bytes of C, and
# _WRITING_TILES run on each GPU at once: their products take turns, and the copies of C
# into the file overlap them.
_WRITE_TILE_BYTES = 512 << 20
# Three, not two: early in a job a tile's write (0.15-0.18 s while the panels are still
# being read, against 0.12 s for its product on an H200) held both slots of two, and the
# GPU waited.
_WRITING_TILES = 3
# With an output file, each device's B panel is made in this many column pieces: the first
# product waits for a piece, not the whole panel (reading a 4.8 GB column panel of B from a
# file took 0.36 s on an H200 host), and the tiles, so the last write, are smaller.
_B_PARTS = 2
# The side of the square GEMMs that measure the ceilings: well past launch overheads, and
# on a GPU large enough to run at the rate a job's large tiles do.
_CEILING_SIDE = {"cuda": 16384, "cpu": 384}
# Each GEMM's ceiling on a GPU is timed over calls back to back once the GPU has run them
# for mgpu.ceilings.sustain (roofline.sustained_seconds): the rate it keeps at its power
# limit, not its first milliseconds' (on one H100, TF32 16384³ products ran at 392.7
# TFLOP/s after 0.3 s and 368.5 on average over 3.4 s; float64 62.7 and 59.6). float32's
# too, on the CUDA cores: in fresh processes on one H200, the median of three calls read
# 53.97 TFLOP/s cold and 52.38 right after, where the sustained mean read 53.06-53.21.


def _pieces(bounds: tuple[int, int], n: int) -> list[tuple[int, int]]:
    """``bounds`` cut into ``n`` near-equal ranges."""
    return [(bounds[0] + lo, bounds[0] + hi) for lo, hi in split(bounds[1] - bounds[0], n)]


class MatmulParams(InputParams):
    """``params:`` of a matmul job."""

    input_operands = (Operand("a", ("m", "k")), Operand("b", ("k", "n")))

    # None only until validation: the input files or the defaults set them (InputParams).
    m: int = Field(None, gt=0, description="rows of A and C")  # type: ignore[assignment]
    n: int = Field(None, gt=0, description="columns of B and C")  # type: ignore[assignment]
    k: int = Field(None, gt=0, description="columns of A, rows of B")  # type: ignore[assignment]
    dtype: Literal["float16", "float32", "float64"] = Field(None)  # type: ignore[arg-type]
    precision: Literal["default", "tf32"] = "default"
    output: str | None = None
    # per-tile: each tile makes the blocks of A and B it reads. distributed: A's row panels
    # and B's column panels are made once, one of each per device, and a tile reads the B
    # panel another GPU holds from that GPU directly (CUDA IPC over NVLink). streamed: each
    # device keeps its rows of C (as many as its budget holds) and streams A and B through
    # them, each block read while the one before multiplies (see stream.py).
    operands: Literal["per-tile", "distributed", "streamed"] = "per-tile"

    @model_validator(mode="after")
    def _precision(self) -> MatmulParams:
        if self.precision == "tf32" and self.dtype != "float32":
            raise ValueError(f"precision: tf32 applies to float32 only, not {self.dtype}")
        return self


@contextlib.contextmanager
def _tf32(dev: Device, enabled: bool) -> Iterator[None]:
    """Let cuBLAS use TF32 tensor cores for float32 inside the block.

    Two switches: CuPy's compute type (what CUPY_TF32=1 sets) for ``matmul``, and the
    cuBLAS handle's math mode for the ``gemm`` calls that accumulate k blocks.
    """
    if not (enabled and dev.is_gpu):
        yield
        return
    import cupy
    from cupy._core import _routines_linalg as linalg
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    previous = linalg.get_compute_type(np.float32), cublas.getMathMode(handle)
    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)
    cublas.setMathMode(handle, _CUBLAS_TF32_TENSOR_OP_MATH)
    try:
        yield
    finally:
        linalg.set_compute_type(np.float32, previous[0])
        cublas.setMathMode(handle, previous[1])


class Matmul(Workload[MatmulParams], Estimates, HostBytes, Outputs):
    """Dense matrix product, tiled over the output; each worker owns contiguous tiles.

    ``Matmul(params)`` makes the class of the schedule ``params.operands`` names (a
    subclass whose ``schedule`` it is): :class:`PerTileMatmul`, :class:`DistributedMatmul`,
    or the streamed one (:class:`~mgpu.workloads.matmul.stream.StreamedMatmul`). What they
    share is here: the params, the check, the output, the ceilings, the estimate.
    """

    name = "matmul"
    Params = MatmulParams
    unit = "TFLOP/s"
    unit_scale = 1e12
    axes = ("m", "n", "k")
    size_params = ("m", "n", "k")
    grow = ("m",)  # more rows of C: work and each device's share of A grow by N
    verify_method = "freivalds"
    example = {"m": 40, "n": 36, "k": 20}
    ceiling_units = {name: "TFLOP/s" for name in ("gemm_float16", "gemm_float32", "gemm_tf32", "gemm_float64")}
    schedule: ClassVar[str]  # the params.operands a subclass runs

    def __new__(cls, params: MatmulParams | None = None, *, verify: bool = True) -> Matmul:
        # Unpickled, or made as a subclass, the class is already the schedule's.
        if cls is Matmul and params is not None:
            cls = next(c for c in Matmul.__subclasses__() if c.schedule == params.operands)
        return super().__new__(cls)

    def host_bytes(self) -> int | None:
        p = self.params
        itemsize = np.dtype(p.dtype).itemsize
        inputs = itemsize * (p.m * p.k + p.k * p.n) if p.input != "random" else 0
        output = itemsize * p.m * p.n if p.output else 0
        return inputs + output or None

    def expected_work(self, plan: Plan) -> float:
        p = self.params
        return 2.0 * p.m * p.n * p.k

    def expected_seconds(self, plan: Plan, rates: dict[str, float], devices: int) -> float | None:
        # Per device, its share of the tiles, each: the product at the GEMM rate, its
        # random blocks of A and B made, and the check's products over B, A and C (at
        # the rates measured for those; on CPUs they take longer than the product).
        gemm = rates.get(self.ceiling())
        if not gemm:
            return None
        p = self.params
        tm, tn = plan.tile_shape["m"], plan.tile_shape["n"]
        seconds = 2.0 * tm * tn * p.k / (gemm * self.unit_scale)
        if p.input == "random" and rates.get("random"):
            seconds += (tm * p.k + p.k * tn) / (rates["random"] * 1e9)
        if self.verify and rates.get("check"):
            seconds += (p.k * tn + tm * p.k + tm * tn) / (rates["check"] * 1e9)
        return math.ceil(len(plan.tiles) / devices) * seconds

    def naive_host_bytes(self, plan: Plan) -> int | None:
        p = self.params
        if self.host_bytes() is None:
            return None
        itemsize = np.dtype(p.dtype).itemsize
        reads = sum(t.size("m") * p.k + p.k * t.size("n") for t in plan.tiles) if p.input != "random" else 0
        return itemsize * reads + (itemsize * p.m * p.n if p.output else 0)

    def sources(self) -> tuple[Any, ...]:
        return self.params.sources()

    def prepare(self, *, force: bool) -> None:
        p = self.params
        if p.output:
            self.sinks["c"] = output_sink(p.output, (p.m, p.n), p.dtype, key="params.output", force=force)

    def _run_blocks(self, ctx: TileContext, tile: Tile) -> _Product:
        """The tile's C, k block by k block, each block of A and B made or read for it."""
        p = self.params
        dev = ctx.dev
        xp = dev.xp
        (r0, r1), (c0, c1) = tile.bounds["m"], tile.bounds["n"]
        src_a, src_b = self.sources()
        r = abr = None
        if ctx.verify:  # Freivalds: one random vector per output column, the same under any tiling
            with ctx.check_timer():
                r = freivalds_vector(dev, p.seed, p.n, (c0, c1))
                abr = xp.zeros(r1 - r0, dtype=xp.float64)
        c = None
        with _tf32(dev, p.precision == "tf32"):
            for k0, k1 in ranges_on(p.k, tile.args.get("tk", p.k), (p.chunks_of("a") or (0, 0))[1]):
                a = src_a.read(dev, (r0, r1), (k0, k1))
                b = src_b.read(dev, (k0, k1), (c0, c1))
                with ctx.timer(wait=True):  # the next block is read once this product has run
                    c = _gemm_accumulate(xp, a, b, c)
                if abr is not None:
                    with ctx.check_timer():
                        abr += matvec_f64(xp, a, matvec_f64(xp, b, r))
                del a, b
        ctx.mark("queued")  # every block made or read and multiplied
        ctx.record.work = 2.0 * (r1 - r0) * (c1 - c0) * p.k
        return _Product(c, r, abr=abr)

    def check(self, ctx: TileContext, tile: Tile, answer: _Product | _Streamed) -> tuple[float, bool]:
        """Freivalds: C·r against A·(B·r), both in float64."""
        xp = ctx.dev.xp
        if isinstance(answer, _Streamed):  # both made as the rows were
            error = relative_residual(xp, answer.cr, answer.abr)
            return error, bool(error <= self.tolerance())
        got = answer.cr if answer.cr is not None else matvec_f64(xp, answer.c, answer.r)
        want = answer.abr if answer.abr is not None else matvec_f64(xp, answer.a, answer.br)
        error = relative_residual(xp, got, want)
        return error, bool(error <= self.tolerance())

    def store(self, ctx: TileContext, tile: Tile, answer: _Product | _Streamed) -> bool:
        if "c" not in self.sinks:
            return False
        if isinstance(answer, _Streamed):  # written band by band as the rows were finished
            return True
        (r0, r1), (c0, c1) = tile.bounds["m"], tile.bounds["n"]
        self.sinks["c"].write((slice(r0, r1), slice(c0, c1)), answer.c, ctx.dev)
        return True

    def ceiling(self) -> str:
        return "gemm_tf32" if self.params.precision == "tf32" else f"gemm_{self.params.dtype}"

    @classmethod
    def measure_ceilings(cls, dev: Device, only: Collection[str] | None = None) -> dict[str, float]:
        """cuBLAS (or BLAS) GEMM of two random square matrices, per dtype and with TF32
        (those in ``only``), on a GPU timed at its power limit."""
        xp, n = dev.xp, _CEILING_SIDE[dev.backend]
        out: dict[str, float] = {}
        for key, dtype, tf32 in (
            ("gemm_float16", "float16", False),
            ("gemm_float32", "float32", False),
            ("gemm_tf32", "float32", True),
            ("gemm_float64", "float64", False),
        ):
            if only is not None and key not in only:
                continue
            if dtype == "float16" and not dev.is_gpu:
                continue  # NumPy has no float16 BLAS; nothing to set a job against
            a = random_block(xp, seed=0, operand=0, rows=(0, n), cols=(0, n), total_cols=n, dtype=dtype)
            b = random_block(xp, seed=0, operand=1, rows=(0, n), cols=(0, n), total_cols=n, dtype=dtype)
            c = xp.empty((n, n), dtype=dtype)

            def product(a: Any = a, b: Any = b, c: Any = c) -> Any:
                return xp.matmul(a, b, out=c)

            with _tf32(dev, tf32):
                seconds = sustained_seconds(dev, product)
            del a, b, c
            out[key] = 2 * n**3 / seconds / 1e12
        return out

    def _warmup_shape(self, tile: Tile) -> tuple[int, int, int]:
        """The (m, n, k) of the product the warm-up runs for tiles like ``tile``."""
        # The tile's own m and n, so cuBLAS picks (and loads) the kernel the tiles use; a
        # smaller product may pick another, leaving that load, up to ~150 ms, to the first tile.
        m, n = tile.size("m"), tile.size("n")
        if self.params.operands == "streamed":  # its own products are warmed up below
            m, n = min(m, 1024), min(n, 1024)
        k = min(tile.args.get("tk", self.params.k), _WARMUP_K)
        while m * n * np.dtype(self.params.dtype).itemsize > _WARMUP_C_BYTES:
            m, n = max(1, m // 2), max(1, n // 2)
        return m, n, k

    def warm_key(self, tile: Tile) -> str:
        # Random operands, no output, no schedule of its own: the warm-up is one product of
        # the shape below (and the generator's and the check's kernels), whatever the job.
        p = self.params
        if p.input != "random" or p.output or p.operands == "streamed" or "schedule" in tile.args:
            return super().warm_key(tile)  # files, outputs and schedules are the job's own
        m, n, k = self._warmup_shape(tile)
        return f"matmul|{p.dtype}|{p.precision}|{p.operands}|{m}x{n}x{k}"

    def warmup(self, dev: Device, tile: Tile) -> None:
        m, n, k = self._warmup_shape(tile)
        p = self.params.model_copy(
            update={"m": m, "n": n, "k": k, "input": "random", "output": None, "operands": "per-tile"}
        )
        run_tile(PerTileMatmul(p, verify=True), dev, Tile(-1, {"m": (0, m), "n": (0, n)}, args={"tk": k}))
        if self.params.operands == "distributed" and dev.is_gpu:
            enable_all_peers()  # the first enable costs tens of ms; not a tile's to pay
        if self.params.input != "random" and dev.is_gpu:
            # Whole rows through KvikIO: A's (panels, tiles of full width) or, streamed, B's.
            self.sources()[1 if self.params.operands == "streamed" else 0].warm_up(dev, contiguous=True)
            dev.staging.ready_buffers()  # column blocks: the stager's pinned buffers
        if self.params.output and dev.is_gpu:
            dev.staging.ready_buffers(kind="d2h")  # and the store threads', for C

    def tolerance(self) -> float:
        """How far C·r may be from A·(B·r), relative to max|A·(B·r)|.

        Rounding in a correct product leaves a residual near the unit roundoff of the
        precision used (input rounding for TF32, the output's for float16); the sqrt(k)
        term covers accumulation over long k. A wrong element shows up orders above.
        """
        p = self.params
        u = unit_roundoff(p.dtype, tf32=p.precision == "tf32")
        return u * (16 + np.sqrt(p.k))


class PerTileMatmul(Matmul):
    """Each tile makes or reads the blocks of A and B it multiplies, k block by k block."""

    schedule = "per-tile"

    def plan(
        self, devices: dict[str, DeviceFacts], budget: int, tiling: dict[str, int], *, spill: bool = False
    ) -> Plan:
        p = self.params
        itemsize = np.dtype(p.dtype).itemsize
        # A CPU's kernels make temporaries, and NumPy a second product; a GPU's neither.
        on_cpu = any(f.backend == "cpu" for f in devices.values())
        estimate = cpu_working_set if on_cpu else matmul_working_set

        def tile_bytes(tm: int, tn: int, tk: int) -> int:
            return estimate(tm, tn, tk, p.k, itemsize)

        tm, tn, tk = choose_matmul_tiles(
            p.m,
            p.n,
            p.k,
            itemsize,
            budget=budget,
            n_workers=len(devices),
            explicit=tiling,
            spill=spill,
            working_set=tile_bytes,
        )
        # On the stores' chunks, where the inputs are stores: a tile then reads whole chunks.
        a_chunks, b_chunks = p.chunks_of("a") or (None, None), p.chunks_of("b") or (None, None)
        tm = tm if "m" in tiling else on_chunks(tm, a_chunks[0])
        tn = tn if "n" in tiling else on_chunks(tn, b_chunks[1])
        tk = tk if "k" in tiling or tk == p.k else on_chunks(tk, a_chunks[1], b_chunks[0])
        working_set = tile_bytes(tm, tn, tk)
        check_tile_count(
            math.ceil(p.m / tm) * math.ceil(p.n / tn),
            keys="params.m, params.n",
            what=f"{tm} x {tn} x {tk}, {format_bytes(working_set)} each of a {format_bytes(budget)} budget",
        )
        boxes = [(r, c) for r in ranges_on(p.m, tm, a_chunks[0]) for c in ranges_on(p.n, tn, b_chunks[1])]
        owners = assign_contiguous(len(boxes), list(devices))
        tiles = [Tile(i, {"m": r, "n": c}, owners[i], args={"tk": tk}) for i, (r, c) in enumerate(boxes)]
        return Plan(
            tiles=tiles,
            placement="static",
            tile_shape={"m": tm, "n": tn, "k": tk},
            working_set=working_set,
            budget=budget,
        )

    def run(self, ctx: TileContext, tile: Tile) -> _Product:
        if overlap.applies(self, ctx.dev, tile):  # random operands made beside the products
            p = self.params
            with _tf32(ctx.dev, p.precision == "tf32"):
                c, r, abr, cr = overlap.run(self, ctx, tile)
            ctx.mark("queued")
            (r0, r1), (c0, c1) = tile.bounds["m"], tile.bounds["n"]
            ctx.record.work = 2.0 * (r1 - r0) * (c1 - c0) * p.k
            return _Product(c, r, abr=abr, cr=cr)
        return self._run_blocks(ctx, tile)


class DistributedMatmul(Matmul):
    """A's row panels and B's column panels made once, one of each per device; a tile reads
    the B panel another GPU holds from that GPU directly (CUDA IPC over NVLink)."""

    schedule = "distributed"

    def __init__(self, params: MatmulParams, *, verify: bool = True) -> None:
        super().__init__(params, verify=verify)
        if params.output:
            self.concurrency = _WRITING_TILES  # tiles write their C into the file while another computes

    def plan(
        self, devices: dict[str, DeviceFacts], budget: int, tiling: dict[str, int], *, spill: bool = False
    ) -> Plan:
        """A_i (rows of A) and B_i (columns of B) are panels on device i; tile (i, j) runs there.

        Each device computes its own row of tiles, its own B panel's tiles first, so the
        copies of the other panels overlap those products. With an output file the tiles
        are cut into row pieces of about ``_WRITE_TILE_BYTES`` of C, and those in
        ``_B_PARTS`` column pieces, several tiles at once per device (see ``concurrency``),
        so writing one overlaps computing the next. A_i and B_i are made in the same pieces,
        a panel each: a tile waits for its own rows of A and columns of B only, and the
        last tile's write, which nothing overlaps, is a small one.
        ``budget`` is per tile task; the device holds its panels once and ``concurrency``
        tiles.
        """
        p = self.params
        if tiling:
            raise JobInputError(
                "tiling: not used with params.operands: distributed (the panels are "
                "one row of A and one column of B per device); remove tiling"
            )
        workers = list(devices)
        w = len(workers)
        rows, cols = split(p.m, w), split(p.n, w)
        tm, tn = max(hi - lo for lo, hi in rows), max(hi - lo for lo, hi in cols)
        itemsize = np.dtype(p.dtype).itemsize
        pieces = math.ceil(tm * tn * itemsize / _WRITE_TILE_BYTES) if p.output else 1
        check_tile_count(
            w * w * pieces * (_B_PARTS if p.output else 1),
            keys="params.m, params.n",
            what=f"C pieces of about {format_bytes(_WRITE_TILE_BYTES)} on {w} device(s)",
        )
        a_pieces = [_pieces(rows[i], pieces) for i in range(w)]
        b_pieces = [_pieces(cols[j], _B_PARTS if p.output else 1) for j in range(w)]
        tms = max(hi - lo for part in a_pieces for lo, hi in part)
        tns = max(hi - lo for part in b_pieces for lo, hi in part)
        kb = min(p.k, _PEER_BLOCK)
        # Both panels once; per tile its C piece, two receive buffers and a block of A.
        panels = itemsize * (tm * p.k + p.k * tn)
        per_tile = itemsize * (tms * tns + 2 * kb * tns + tms * kb) + 8 * (2 * p.k + tms + tns)
        need = panels + self.concurrency * per_tile
        if need > budget * self.concurrency and not spill:
            raise JobInputError(
                f"cluster.memory_limit: params.operands: distributed keeps {format_bytes(need)} per device "
                f"(its A and B panels and {self.concurrency} C tile(s)) but the budget is "
                f"{format_bytes(budget * self.concurrency)}; use more devices, a larger budget, or "
                "params.operands: per-tile"
            )
        made = [Panel(f"a{i}.{q}", "a", {"m": r}, workers[i]) for i in range(w) for q, r in enumerate(a_pieces[i])]
        made += [Panel(f"b{j}.{h}", "b", {"n": c}, workers[j]) for j in range(w) for h, c in enumerate(b_pieces[j])]
        tiles: list[Tile] = []
        for i in range(w):
            for step in range(w):
                j = (i + step) % w
                for h, c in enumerate(b_pieces[j]):
                    for q, r in enumerate(a_pieces[i]):
                        tiles.append(
                            Tile(
                                len(tiles),
                                {"m": r, "n": c, "a_rows": r},
                                workers[i],
                                needs=(f"a{i}.{q}", f"b{j}.{h}"),
                                args={"tk": kb},
                            )
                        )
        return Plan(
            tiles,
            "static",
            {"m": tms, "n": tns, "k": p.k},
            need,
            budget * self.concurrency,
            panels=made,
            notes={"operands": "distributed"},
        )

    def make_panel(self, ctx: TileContext, panel: Panel) -> PanelRef:
        p = self.params
        dev = ctx.dev
        src_a, src_b = self.sources()
        if panel.operand == "a":
            r0, r1 = panel.bounds["m"]
            shape, read = (r1 - r0, p.k), lambda out: src_a.read_into(dev, out, (r0, r1), (0, p.k))
        else:
            c0, c1 = panel.bounds["n"]
            shape, read = (p.k, c1 - c0), lambda out: src_b.read_into(dev, out, (0, p.k), (c0, c1))
        return publish(ctx.panel_store, dev, ctx.token, panel.name, shape, p.dtype, read)

    def run(self, ctx: TileContext, tile: Tile) -> _Product:
        # Without panels (a warm-up's tile) the tile makes its own blocks.
        return self._run_from_panels(ctx, tile) if ctx.panels else self._run_blocks(ctx, tile)

    def _run_from_panels(self, ctx: TileContext, tile: Tile) -> _Product:
        """Tile (i, j) from resident panels: A_i here, B_j here or on a peer GPU."""
        p = self.params
        dev = ctx.dev
        xp = dev.xp
        (r0, r1), (c0, c1) = tile.bounds["m"], tile.bounds["n"]
        ref_a, ref_b = (ctx.panels[name] for name in tile.needs)
        src_a, src_b = self.sources()
        a = resident(ctx.panel_store, ref_a)
        if a is None:  # only if a worker was replaced: the tile's rows of A_i are made here again
            a = src_a.read(dev, (r0, r1), (0, p.k))
        else:  # the tile's rows of the panel
            first = tile.bounds.get("a_rows", (r0, r1))[0]
            a = a[r0 - first : r1 - first]
        b = resident(ctx.panel_store, ref_b)
        peer = peer_ordinal(ref_b) if b is None and dev.is_gpu else None
        if b is None and peer is None:  # no peer path (other node, CPU): this worker makes B_j itself
            b = src_b.read(dev, (0, p.k), (c0, c1))
        r = None
        if ctx.verify:
            with ctx.check_timer():
                r = freivalds_vector(dev, p.seed, p.n, (c0, c1))
        ctx.mark("inputs")
        with _tf32(dev, p.precision == "tf32"):
            if b is not None:
                c = xp.empty((r1 - r0, c1 - c0), dtype=p.dtype)
                # In order with the other tiles on this device (see concurrency): products
                # run one at a time, so one tile's C is written while the next multiplies.
                with dev.in_order() as queue, ctx.timer(queue) as t:
                    xp.matmul(a, b, out=c)
                t.seconds  # noqa: B018 (waits for the product, outside the in-order block: nothing waits in it)
                br = None
                if r is not None:
                    with ctx.check_timer():
                        br = matvec_f64(xp, b, r)
            else:
                assert peer is not None  # B was left unread only where a peer GPU holds it
                c, br = self._gemm_from_peer(ctx, a, ref_b, peer, r, tile.args["tk"])
        ctx.mark("queued")
        ctx.record.work = 2.0 * (r1 - r0) * (c1 - c0) * p.k
        return _Product(c, r, a=a, br=br)

    def _gemm_from_peer(self, ctx: TileContext, a: Any, ref: PanelRef, peer: int, r: Any, tk: int) -> tuple[Any, Any]:
        """``a @ B`` with B on a peer GPU, copied in row blocks on the copy stream.

        Two receive buffers: block i+1 crosses NVLink while block i is multiplied; events
        order the streams (a copy waits until its buffer's previous block was used). The
        products go on the device's in-order queue, after those of tiles that got there
        first. Returns (c, B·r or None); the bytes copied and their time go in the record.
        """
        import cupy

        dev = ctx.dev
        k, tn = ref.shape
        copy = dev.copy_stream
        blocks = split_by_size(k, tk)
        bufs = [cupy.empty((tk, tn), dtype=ref.dtype) for _ in range(2)]
        used: list[Any] = [None, None]
        copies: list[tuple[Any, Any]] = []
        br = cupy.empty(k, dtype=cupy.float64) if r is not None else None
        moved, c = 0, None
        remote = ctx.panel_store.open_remote(ref, peer)  # kept open until every tile has ended

        def enqueue(i: int) -> Any:
            nonlocal moved
            slot = i % 2
            if used[slot] is not None:
                copy.wait_event(used[slot])
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            begin.record(copy)
            moved += copy_rows(bufs[slot], remote, blocks[i], copy)
            end.record(copy)
            copies.append((begin, end))
            return end

        with dev.in_order() as compute:
            arrived = enqueue(0)
            for i, (k0, k1) in enumerate(blocks):
                following = enqueue(i + 1) if i + 1 < len(blocks) else None
                compute.wait_event(arrived)
                block = bufs[i % 2][: k1 - k0]
                a_block = cupy.ascontiguousarray(a[:, k0:k1])
                with ctx.timer(compute):
                    c = _gemm_accumulate(cupy, a_block, block, c)
                if br is not None:
                    with ctx.check_timer(compute):
                        br[k0:k1] = matvec_f64(cupy, block, r)
                used[i % 2] = compute.record()
                arrived = following
        dev.stream.synchronize()
        ctx.record.bytes_d2d = moved
        if peer == 0:  # another worker on this GPU made B: the copies stayed on the device
            ctx.record.bytes_same_device, ctx.record.copies_same_device = moved, len(copies)
        ctx.record.d2d_s = sum(cupy.cuda.get_elapsed_time(b, e) for b, e in copies) / 1e3
        return c, br


@dataclass
class _Streamed:
    """A streamed tile's check: C·r and A·(B·r) of its rows, made as the rows were."""

    cr: Any
    abr: Any


@dataclass
class _Product:
    """A tile's C and what its check needs: the check vector r and A·(B·r), or A and B·r;
    C·r where it was made beside the products."""

    c: Any
    r: Any
    abr: Any = None
    a: Any = None
    br: Any = None
    cr: Any = None


def _gemm_accumulate(xp: Any, a: Any, b: Any, c: Any | None) -> Any:
    """``a @ b`` on the first k block, ``c += a @ b`` after (cuBLAS with beta=1 on a GPU)."""
    if c is None:
        return xp.matmul(a, b)
    if xp.__name__ == "cupy":
        from cupy import cublas

        return cublas.gemm("N", "N", a, b, out=c, alpha=1.0, beta=1.0)
    c += a @ b
    return c
