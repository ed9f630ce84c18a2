"""cuBLASXt in every configuration mgpu is set against, in one process, and the ratios.

cuBLASXt's GEMM on host operands runs at the device's GEMM rate only where the operands
are in pinned (page-locked) memory; on pageable NumPy arrays it runs at a fraction, more
of it with its pinning mode on (it page-locks the operands itself, inside the call). The
configurations, each timed around the gemm call alone:

``pinned``              operands and C in pinned host memory, block 8192: its best
``pinned-block-16384``  the same with larger and smaller tiles
``pinned-block-4096``
``pinning``             pageable operands, ``cublasXtSetPinningMemMode`` on
``pageable``            pageable operands as NumPy holds them

and, where A and B come from ``.npy`` files, ``same-work``: what mgpu's job does, done
with cuBLASXt — A and B read from their files into pinned buffers, the gemm, C written
into an ``.npy`` — timed in its three parts and in all. The reads and the write use
several threads (:func:`read_npy_into`, :func:`write_npy`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["CASES", "SAME_WORK", "Case", "median_speedups", "read_npy_into", "set_against", "write_npy"]

IO_THREADS = 8
_PIECE = 64 << 20  # bytes a thread reads or writes per call


class Case(NamedTuple):
    """One configuration of cuBLASXt: where the operands live, its tile side, its pinning mode."""

    name: str
    host_memory: str  # "pinned" | "pageable"
    block_dim: int
    pinning: bool = False


CASES = (
    Case("pinned", "pinned", 8192),
    Case("pinned-block-16384", "pinned", 16384),
    Case("pinned-block-4096", "pinned", 4096),
    Case("pinning", "pageable", 8192, pinning=True),
    Case("pageable", "pageable", 8192),
)
SAME_WORK = "same-work"


def _ranges(nbytes: int, parts: int) -> list[tuple[int, int]]:
    return [(i * nbytes // parts, (i + 1) * nbytes // parts) for i in range(parts) if nbytes * (i + 1) // parts > 0]


def read_npy_into(path: str | Path, out: np.ndarray, threads: int = IO_THREADS) -> float:
    """Fill ``out`` (C-contiguous, of the file's shape and dtype) with the data of the
    ``.npy`` at ``path``, ``threads`` ranges at once; returns the seconds it took.

    Raises
    ------
    ValueError
        If the file's array is not of ``out``'s shape and dtype in C order.
    EOFError
        If the file ends early.
    """
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        offset = f.tell()
    if shape != out.shape or dtype != out.dtype or fortran:
        order = "Fortran" if fortran else "C"
        raise ValueError(f"{path}: holds {dtype} {shape} in {order} order, expected {out.dtype} {out.shape} in C order")
    flat = out.reshape(-1).view(np.uint8).data

    def read(lo: int, hi: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            while lo < hi:
                got = os.preadv(fd, [flat[lo : min(hi, lo + _PIECE)]], offset + lo)
                if got <= 0:
                    raise EOFError(f"{path} ends at byte {offset + lo}, short of its header's array")
                lo += got
        finally:
            os.close(fd)

    start = time.perf_counter()
    _each(read, _ranges(out.nbytes, threads), threads)
    return time.perf_counter() - start


def write_npy(path: str | Path, data: np.ndarray, threads: int = IO_THREADS) -> float:
    """Write the C-contiguous ``data`` as an ``.npy`` at ``path``: the file is made, then
    ``threads`` threads copy row ranges into a memory map of it (on a tmpfs a file takes
    one ``pwrite`` at a time; the map's copies run side by side). Returns the seconds it
    took, the file's making included."""
    start = time.perf_counter()
    out = np.lib.format.open_memmap(path, mode="w+", dtype=data.dtype, shape=data.shape)
    rows = out.reshape(len(out), -1) if out.ndim else out.reshape(1, 1)
    src = data.reshape(rows.shape)

    def copy(lo: int, hi: int) -> None:
        np.copyto(rows[lo:hi], src[lo:hi])

    _each(copy, _ranges(len(rows), threads), threads)
    out.flush()
    return time.perf_counter() - start


def _each(fn: Callable[[int, int], None], ranges: list[tuple[int, int]], threads: int) -> None:
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for future in [pool.submit(fn, lo, hi) for lo, hi in ranges]:
            future.result()


def set_against(job_s: float, figures: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """mgpu's job (``job_s`` seconds) against each cuBLASXt figure of the same product:
    ``{config: {"seconds": its seconds, "speedup": its seconds over mgpu's}}``."""
    out: dict[str, dict[str, float]] = {}
    for fig in figures:
        if fig.get("seconds") and job_s > 0:
            out[fig.get("config", "pageable")] = {"seconds": fig["seconds"], "speedup": fig["seconds"] / job_s}
    return out


def median_speedups(per_run: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The median over runs of :func:`set_against`'s answers, per configuration."""
    configs = dict.fromkeys(c for run in per_run for c in run)
    return {
        c: {
            "seconds": next(r[c]["seconds"] for r in per_run if c in r),
            "speedup": statistics.median(r[c]["speedup"] for r in per_run if c in r),
        }
        for c in configs
    }
