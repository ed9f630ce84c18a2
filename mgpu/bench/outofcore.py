"""``mgpu bench outofcore``: matmul and dot from ``.npy`` files larger than the devices'
memory budget, and cuBLASXt on the same operands in host memory, in one run.

The inputs are written into ``--scratch`` (``/dev/shm`` where it exists: a page cache the
reads cannot miss) and read once, untimed, before any job: a file's first read after it is
written costs the kernel more, and the job timed first would pay it. mgpu's matmul keeps
A and B in one panel per device on two devices or more (``operands: distributed``) and on
one streams them through its rows of C (``streamed``), writing C into a ``.npy``; each
result's ``roofline`` is the slower of the compute and the bytes over the devices'
summed pinned host-to-device rate. cuBLASXt runs in each configuration of
:mod:`mgpu.bench.xtcases` (operands in pinned memory, its best; pageable with its pinning
mode on; pageable) timed around its GEMM call alone, A and B read into memory first
(untimed), and once as the same work as mgpu's job (the files read into pinned memory,
the GEMM, C written into an ``.npy``), timed in parts. mgpu's time set against each is the
job's from the end of its warm-up to its result (every read, product and write); each
matmul run's ``vs`` and its summary row's ``vs_cublasxt`` hold the ratios.
The first side also runs from Zarr stores, C into a store (:mod:`mgpu.bench.stores`).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dask.config
import numpy as np

from . import stores
from .harness import BenchInputError, Options, job_seconds, resolve, run_child, run_jobs, say, skipped, summarize
from .xtcases import median_speedups, set_against

# Per preset: the matmul sides, each with the per-device budget it runs under, and the dot's
# length per device with its budget.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"matmul": [(1024, "24MiB")], "dot": 1_000_000, "dot_budget": "24MiB"},  # the file paths only
    "small": {"matmul": [(16384, "2GiB")], "dot": 500_000_000, "dot_budget": "2GiB"},
    "full": {  # x and y: 17.6 GB a device
        "matmul": [(32768, "6GiB"), (49152, "16GiB")],
        "dot": 2_200_000_000,
        "dot_budget": "16GiB",
    },
}
# Where a timeline's idle went, and its products' rates (see mgpu.results.Timeline).
TIMELINE_DETAIL = ("idle_inputs_s", "idle_writes_s", "checks_s", "blocks_tflops", "whole_k_tflops")
_ROWS_AT_ONCE = 64 << 20  # bytes of a file made and written at a time


def scratch_folder(opts: Options) -> Path:
    """``--scratch``, else ``/dev/shm`` where it exists, else the system's temporary folder."""
    if opts.extra.get("scratch"):
        return Path(opts.extra["scratch"])
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def write_arrays(folder: Path, shapes: dict[str, tuple[int, ...]], threads: int = 8) -> dict[str, Path]:
    """float32 ``.npy`` files ``FOLDER/NAME.npy`` of these shapes, uniform random in [-1, 1)
    (each name seeded apart)."""
    paths = {k: folder / f"{k}.npy" for k in shapes}

    def fill(mm: np.memmap, seed: int, lo: int, hi: int) -> None:
        block = mm[lo:hi]
        np.random.default_rng([seed, lo]).random(out=block, dtype=np.float32)
        block *= 2  # [-1, 1), as mgpu's own random operands
        block -= 1

    with ThreadPoolExecutor(threads) as pool:  # NumPy's generator fills without the GIL
        for key, path in paths.items():
            seed = int.from_bytes(key.encode(), "little")
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
    read_once(list(paths.values()))
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


def matmul_job(a: Path, b: Path, c: Path, budget: str, devices: int) -> dict[str, Any]:
    """The matmul from the files A and B, C into ``c``, under ``budget`` per device.

    On two devices or more, A and B are read once, in one panel per device (``operands:
    distributed``); one device cannot hold both panels under the budget, so it keeps its
    rows of C and streams A and B through them (``streamed``).
    """
    return {
        "workload": "matmul",
        "params": {
            "input": {"a": str(a), "b": str(b)},
            "output": str(c),
            "operands": "distributed" if devices > 1 else "streamed",
        },
        "cluster": {"memory_limit": budget},
        "force": True,  # each device count and repeat writes C anew
    }


def run(opts: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the suite; returns (what was resolved, the record's body).

    One matmul side at a time: its A and B are written, every device count runs it (then
    cuBLASXt, on GPUs), and its files go before the next side's are written; the dot's x
    and y come last. The scratch folder holds one case's files at a time.
    """
    backend, sizes, counts = resolve(opts)
    s = SIZES[sizes]
    length = s["dot"] * max(counts)
    scratch = scratch_folder(opts)
    need = 4 * max([3 * n * n for n, _ in s["matmul"]] + [2 * length])
    free = shutil.disk_usage(scratch).free
    if need > 0.9 * free:
        raise BenchInputError(
            f"--scratch: the largest case's files take {need / 1e9:.3g} GB, and {scratch} has {free / 1e9:.3g} GB"
            " free; choose a larger folder or smaller --sizes"
        )
    folder = Path(tempfile.mkdtemp(prefix="mgpu-outofcore-", dir=scratch))
    runs: list[dict[str, Any]] = []
    cublasxt: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="mgpu-ceilings-") as cache, dask.config.set({"mgpu.cache-dir": cache}):
            for side, budget in s["matmul"]:
                say(f"writing A and B ({side}² float32) into {folder}")
                p = write_arrays(folder, {"a": (side, side), "b": (side, side)})
                for n in counts:
                    job = matmul_job(p["a"], p["b"], folder / "c.npy", budget, n)
                    runs += run_jobs(
                        opts, [(f"outofcore-matmul-{side}-{job['params']['operands']}", job)], backend, [n]
                    )
                if backend == "cuda":
                    for n in counts:
                        label = f"cublasxt-{side}-{n}"
                        args = {"a": str(p["a"]), "b": str(p["b"]), "devices": n, "scratch": str(folder)}
                        cublasxt[f"{side}/{n}"] = alt = run_child(opts, "cublasxt", label, args, 1800)
                        _set_against(runs, side, n, alt)
                if side == s["matmul"][0][0]:  # the same job from Zarr stores, C into a store
                    runs += stores.run(opts, backend, counts, folder, p, side, budget, matmul_job)
                    stores.set_against_npy(runs, side)
                for path in folder.iterdir():
                    path.unlink()
            say(f"writing x and y ({length:.3g} float32) into {folder}")
            p = write_arrays(folder, {"x": (length,), "y": (length,)})
            dot = {
                "workload": "dot",
                "params": {"input": {"x": str(p["x"]), "y": str(p["y"])}},
                "cluster": {"memory_limit": s["dot_budget"]},
            }
            for n in counts:
                runs += run_jobs(opts, [("outofcore-dot", dot)], backend, [n])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    alternatives = {
        "cublasxt": cublasxt if backend == "cuda" else skipped("cuBLASXt needs GPUs; it runs with --backend cuda")
    }
    resolved = {"backend": backend, "sizes": sizes, "device_counts": counts, "matmul": s["matmul"]}
    summary = summarize(runs)
    for row in summary:  # each matmul's median against every cuBLASXt configuration, and its timeline
        mine = [e for e in runs if (e["name"], e["devices"]) == (row["name"], row["devices"])]
        speedups = [e["vs"] for e in mine if e.get("vs")]
        if speedups:
            row["vs_cublasxt"] = median_speedups(speedups)
        timeline = median_timeline([e["result"] for e in mine if e.get("result")])
        if timeline:
            row["timeline"] = timeline
    return resolved, {"runs": runs, "alternatives": alternatives, "summary": summary}


def median_timeline(results: list[dict[str, Any]]) -> dict[str, float] | None:
    """The median over runs of each part of the slowest tile's timeline (see
    :class:`mgpu.results.Timeline`), or None where no run has one."""
    slowest = [max(r["timeline"], key=lambda t: t["span_s"]) for r in results if r.get("timeline")]
    if not slowest:
        return None
    parts = ("span_s", "first_load_s", "products_s", "idle_s", "write_tail_s", "writes_s", *TIMELINE_DETAIL)
    return {k: statistics.median(t[k] for t in slowest) for k in parts if all(t.get(k) is not None for t in slowest)}


def _set_against(runs: list[dict[str, Any]], side: int, devices: int, alt: dict[str, Any]) -> None:
    """Note in each matmul run of this side and device count how many times faster mgpu
    was than each cuBLASXt configuration (``vs``: configuration -> seconds, speedup)."""
    figures = alt.get("figures") or []
    for entry in runs:
        r = entry.get("result")
        if (
            figures
            and entry["name"].startswith(f"outofcore-matmul-{side}-")
            and entry["devices"] == devices
            and r
            and job_seconds(r)
        ):
            entry["vs"] = set_against(job_seconds(r), figures)
