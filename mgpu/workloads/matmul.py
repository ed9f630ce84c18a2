"""C[m, n] = A[m, k] @ B[k, n], tiled over C, each tile checked by Freivalds' method."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..device import Device, DeviceFacts
from ..planner import Plan, Tile, assign_contiguous, choose_matmul_tiles, matmul_working_set, split_by_size
from ..sources import input_files, NpySink, NpySource, RandomSource, check_output_path, inspect_npy
from .base import TileRecord, Workload, injected_fault
from .checks import matvec_f64, relative_residual, unit_roundoff

__all__ = ["Matmul", "MatmulParams"]


class MatmulParams(BaseModel):
    """``params:`` of a matmul job."""

    model_config = ConfigDict(extra="forbid")

    m: int | None = Field(None, gt=0, description="rows of A and C")
    n: int | None = Field(None, gt=0, description="columns of B and C")
    k: int | None = Field(None, gt=0, description="columns of A, rows of B")
    dtype: Literal["float16", "float32", "float64"] | None = None
    precision: Literal["default", "tf32"] = "default"
    seed: int = Field(0, ge=0)
    input: Literal["random"] | dict[str, str] = "random"
    output: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return input_files(v, ('a', 'b'))

    @model_validator(mode="after")
    def _sizes(self) -> MatmulParams:
        if self.input == "random":
            for key in ("m", "n", "k"):
                if getattr(self, key) is None:
                    raise ValueError(f"{key}: required when input is random")
            self.dtype = self.dtype or "float32"
        else:
            a = inspect_npy(self.input["a"], key="input.a")
            b = inspect_npy(self.input["b"], key="input.b")
            for key, info in (("input.a", a), ("input.b", b)):
                if len(info.shape) != 2:
                    raise ValueError(f"{key}: expected a 2-D array, {info.path!r} has shape {info.shape}")
            if a.shape[1] != b.shape[0]:
                raise ValueError(f"input: A is {a.shape} and B is {b.shape}; A's columns must equal B's rows")
            if a.dtype != b.dtype:
                raise ValueError(f"input: A holds {a.dtype} and B holds {b.dtype}; they must match")
            for key, value in (("m", a.shape[0]), ("k", a.shape[1]), ("n", b.shape[1]), ("dtype", a.dtype)):
                given = getattr(self, key)
                if given is not None and given != value:
                    raise ValueError(f"{key}: {given} disagrees with the input files ({value})")
                setattr(self, key, value)
        if self.precision == "tf32" and self.dtype != "float32":
            raise ValueError(f"precision: tf32 applies to float32 only, not {self.dtype}")
        return self


@contextlib.contextmanager
def _tf32(dev: Device, enabled: bool) -> Iterator[None]:
    """Let cuBLAS use TF32 tensor cores for float32 inside the block (what CUPY_TF32=1 does)."""
    if not (enabled and dev.is_gpu):
        yield
        return
    from cupy._core import _routines_linalg as linalg

    previous = linalg.get_compute_type(np.float32)
    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)
    try:
        yield
    finally:
        linalg.set_compute_type(np.float32, previous)


class Matmul(Workload):
    """Dense matrix product, tiled over the output; each worker owns contiguous tiles."""

    name = "matmul"
    Params = MatmulParams
    unit = "TFLOP/s"
    unit_scale = 1e12
    axes = ("m", "n", "k")
    size_params = ("m", "n", "k")
    grow = ("m",)  # more rows of C: work and each device's share of A grow by N
    verify_method = "freivalds"

    def __init__(self, params: MatmulParams, *, verify: bool = True) -> None:
        super().__init__(params, verify=verify)
        self.tk = params.k

    def sources(self) -> tuple[Any, Any]:
        p = self.params
        if p.input == "random":
            return (
                RandomSource(p.seed, 0, (p.m, p.k), p.dtype),
                RandomSource(p.seed, 1, (p.k, p.n), p.dtype),
            )
        return (
            NpySource(inspect_npy(p.input["a"], key="input.a")),
            NpySource(inspect_npy(p.input["b"], key="input.b")),
        )

    def prepare(self, *, force: bool) -> None:
        p = self.params
        if p.output:
            path = check_output_path(p.output, key="params.output", suffix=".npy", force=force)
            self.sinks["c"] = NpySink.for_path(path, (p.m, p.n), p.dtype)

    def plan(self, devices: dict[str, DeviceFacts], budget: int, tiling: dict[str, int], *,
             spill: bool = False) -> Plan:
        p = self.params
        itemsize = np.dtype(p.dtype).itemsize
        tm, tn, tk = choose_matmul_tiles(
            p.m, p.n, p.k, itemsize, budget=budget, n_workers=len(devices), explicit=tiling, spill=spill
        )
        self.tk = tk
        boxes = [(r, c) for r in split_by_size(p.m, tm) for c in split_by_size(p.n, tn)]
        owners = assign_contiguous(len(boxes), list(devices))
        tiles = [Tile(i, {"m": r, "n": c}, owners[i]) for i, (r, c) in enumerate(boxes)]
        return Plan(
            tiles=tiles,
            placement="static",
            tile_shape={"m": tm, "n": tn, "k": tk},
            working_set=matmul_working_set(tm, tn, tk, p.k, itemsize),
            budget=budget,
        )

    def run_tile(self, dev: Device, tile: Tile) -> TileRecord:
        p = self.params
        xp = dev.xp
        start = time.time()
        (r0, r1), (c0, c1) = tile.bounds["m"], tile.bounds["n"]
        src_a, src_b = self.sources()
        check = self.verify
        if check:  # Freivalds: one random vector per output column, the same under any tiling
            r = RandomSource(p.seed, 2, (p.n,), "float64").read(dev, (c0, c1))
            abr = xp.zeros(r1 - r0, dtype=xp.float64)
        busy = 0.0
        c = None
        with dev.on_stream(), _tf32(dev, p.precision == "tf32"):
            for k0, k1 in split_by_size(p.k, self.tk):
                a = src_a.read(dev, (r0, r1), (k0, k1))
                b = src_b.read(dev, (k0, k1), (c0, c1))
                with dev.timer() as t:
                    c = _gemm_accumulate(xp, a, b, c)
                busy += t.seconds
                if check:
                    abr += matvec_f64(xp, a, matvec_f64(xp, b, r))
                del a, b
            if injected_fault(self.name, tile):
                c[0, 0] += 1
            error = ok = None
            if check:
                error = relative_residual(xp, matvec_f64(xp, c, r), abr)
                ok = error <= self.tolerance()
            if "c" in self.sinks:
                self.sinks["c"].write((slice(r0, r1), slice(c0, c1)), dev.to_host(c))
            dev.synchronize()
        return self.new_record(
            dev, tile, start, busy_s=busy, work=2.0 * (r1 - r0) * (c1 - c0) * p.k,
            verify_error=error, verify_ok=ok,
        )

    def ceiling(self) -> str:
        return "gemm_tf32" if self.params.precision == "tf32" else f"gemm_{self.params.dtype}"

    def warmup(self, dev: Device) -> None:
        p = self.params.model_copy(update={"m": 64, "n": 64, "k": 64, "input": "random", "output": None})
        small = Matmul(p, verify=True)
        small.run_tile(dev, Tile(-1, {"m": (0, 64), "n": (0, 64)}))

    def tolerance(self) -> float:
        """How far C·r may be from A·(B·r), relative to max|A·(B·r)|.

        Rounding in a correct product leaves a residual near the unit roundoff of the
        precision used (input rounding for TF32, the output's for float16); the sqrt(k)
        term covers accumulation over long k. A wrong element shows up orders above.
        """
        p = self.params
        u = unit_roundoff(p.dtype, tf32=p.precision == "tf32")
        return u * (16 + np.sqrt(p.k))


def _gemm_accumulate(xp: Any, a: Any, b: Any, c: Any | None) -> Any:
    """``a @ b`` on the first k block, ``c += a @ b`` after (cuBLAS with beta=1 on a GPU)."""
    if c is None:
        return xp.matmul(a, b)
    if xp.__name__ == "cupy":
        from cupy import cublas

        return cublas.gemm("N", "N", a, b, out=c, alpha=1.0, beta=1.0)
    c += a @ b
    return c
