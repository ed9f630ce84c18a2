"""``mgpu bench outofcore``: matmul and dot from ``.npy`` files larger than the devices'
memory budget, and cuBLASXt on the same operands in host memory, in one run.

The inputs are written into ``--scratch`` (``/dev/shm`` where it exists: a page cache the
reads cannot miss) and read once, untimed, before any job: a file's first read after it is
written costs the kernel more, and the job timed first would pay it. mgpu's matmul keeps
A and B in one panel per device (``operands: distributed``) and writes C into a ``.npy``;
each result's ``roofline`` is the slower of the compute and the bytes over the devices'
summed pinned host-to-device rate. cuBLASXt reads A and B whole into memory first
(untimed) and is timed around its GEMM call alone; mgpu's time set against it is the
job's from the end of its warm-up to its result (panel reads, every tile, the write of C).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dask.config
import numpy as np

from .harness import BenchInputError, Options, job_seconds, resolve, run_child, run_jobs, say, skipped, summarize

SIZES: dict[str, dict[str, Any]] = {  # matmul side, dot length per device, the per-device budget both run under
    "tiny": {"n": 1024, "dot": 1_000_000, "budget": "24MiB"},  # the file paths only: not beyond the budget
    "small": {"n": 16384, "dot": 500_000_000, "budget": "2GiB"},
    "full": {"n": 49152, "dot": 2_200_000_000, "budget": "16GiB"},  # x and y: 17.6 GB a device
}
_ROWS_AT_ONCE = 64 << 20  # bytes of a file made and written at a time


def scratch_folder(opts: Options) -> Path:
    """``--scratch``, else ``/dev/shm`` where it exists, else the system's temporary folder."""
    if opts.extra.get("scratch"):
        return Path(opts.extra["scratch"])
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def write_inputs(folder: Path, n: int, length: int, threads: int = 8) -> dict[str, Path]:
    """A, B (n x n) and x, y (length) float32 ``.npy`` files, uniform random in [-1, 1)."""
    paths = {k: folder / f"{k}.npy" for k in "abxy"}
    shapes = {"a": (n, n), "b": (n, n), "x": (length,), "y": (length,)}

    def fill(mm: np.memmap, seed: int, lo: int, hi: int) -> None:
        block = mm[lo:hi]
        np.random.default_rng([seed, lo]).random(out=block, dtype=np.float32)
        block *= 2  # [-1, 1), as mgpu's own random operands
        block -= 1

    with ThreadPoolExecutor(threads) as pool:  # NumPy's generator fills without the GIL
        for seed, (key, path) in enumerate(paths.items()):
            mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shapes[key])
            step = max(1, _ROWS_AT_ONCE // (mm.itemsize * (mm.shape[1] if mm.ndim == 2 else 1)))
            list(
                pool.map(
                    lambda lo, mm=mm, seed=seed, step=step: fill(mm, seed, lo, min(len(mm), lo + step)),
                    range(0, len(mm), step),
                )
            )
            mm.flush()
            del mm
    return paths


def read_once(paths: list[Path], threads: int = 8, piece: int = 64 << 20) -> None:
    """Read every byte of ``paths`` once, ``threads`` ranges of a file at a time."""

    def read(path: Path, lo: int, hi: int) -> None:
        buf = bytearray(piece)
        with open(path, "rb", buffering=0) as f:
            f.seek(lo)
            left = hi - lo
            while left > 0:
                got = f.readinto(memoryview(buf)[: min(piece, left)])
                if not got:
                    break
                left -= got

    with ThreadPoolExecutor(threads) as pool:
        for path in paths:
            size = path.stat().st_size
            list(pool.map(lambda i, p=path, s=size: read(p, i * s // threads, (i + 1) * s // threads), range(threads)))


def jobs(p: dict[str, Path], folder: Path, devices: int) -> list[tuple[str, dict[str, Any]]]:
    """The matmul (C into FOLDER/c.npy) and the dot from the input files.

    On two devices or more, A and B are read once, in one panel per device (``operands:
    distributed``); one device cannot hold both panels under the budget, so it keeps its
    rows of C and streams A and B through them (``streamed``).
    """
    operands = "distributed" if devices > 1 else "streamed"
    matmul = {
        "workload": "matmul",
        "params": {
            "input": {"a": str(p["a"]), "b": str(p["b"])},
            "output": str(folder / "c.npy"),
            "operands": operands,
        },
        "force": True,  # each device count and repeat writes C anew
    }
    dot = {"workload": "dot", "params": {"input": {"x": str(p["x"]), "y": str(p["y"])}}}
    return [(f"outofcore-matmul-{operands}", matmul), ("outofcore-dot", dot)]


def run(opts: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the suite; returns (what was resolved, the record's body)."""
    backend, sizes, counts = resolve(opts)
    s = SIZES[sizes]
    n, length = s["n"], s["dot"] * max(counts)
    scratch = scratch_folder(opts)
    need = 4 * (3 * n * n + 2 * length)  # A, B, C, x and y
    free = shutil.disk_usage(scratch).free
    if need > 0.9 * free:
        raise BenchInputError(
            f"--scratch: the inputs and C take {need / 1e9:.3g} GB, and {scratch} has {free / 1e9:.3g} GB free;"
            " choose a larger folder or smaller --sizes"
        )
    folder = Path(tempfile.mkdtemp(prefix="mgpu-outofcore-", dir=scratch))
    try:
        say(f"writing A, B ({n}² float32) and x, y ({length:.3g}) into {folder}")
        p = write_inputs(folder, n, length)
        read_once(list(p.values()))
        budget = [f"cluster.memory_limit={s['budget']}"]
        opts.sets[:0] = budget  # the user's --set comes after, and may change the budget
        runs = []
        with tempfile.TemporaryDirectory(prefix="mgpu-ceilings-") as cache, dask.config.set({"mgpu.cache-dir": cache}):
            for n in counts:
                runs += run_jobs(opts, jobs(p, folder, n), backend, [n])
        alternatives: dict[str, Any] = {}
        if backend == "cuda":
            alternatives["cublasxt"] = {
                str(n): run_child(
                    opts, "cublasxt", f"cublasxt-{n}", {"a": str(p["a"]), "b": str(p["b"]), "devices": n}, 1800
                )
                for n in counts
            }
            for n, alt in alternatives["cublasxt"].items():
                _set_against(runs, int(n), alt)
        else:
            alternatives["cublasxt"] = skipped("cuBLASXt needs GPUs; it runs with --backend cuda")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    resolved = {"backend": backend, "sizes": sizes, "device_counts": counts, "budget": s["budget"]}
    return resolved, {"runs": runs, "alternatives": alternatives, "summary": summarize(runs)}


def _set_against(runs: list[dict[str, Any]], devices: int, alt: dict[str, Any]) -> None:
    """Note in each matching run how many times faster mgpu was than the alternative."""
    figures = alt.get("figures") or []
    if not figures:
        return
    for entry in runs:
        r = entry.get("result")
        if entry["name"].startswith("outofcore-matmul") and entry["devices"] == devices and r and job_seconds(r):
            entry["vs"] = {"cublasxt_s": figures[0]["seconds"], "speedup": figures[0]["seconds"] / job_seconds(r)}
