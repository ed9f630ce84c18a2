"""The Zarr cases of ``mgpu bench outofcore``: the matmul from stores, C into a store, beside
the same job from ``.npy`` files.

For the first matmul side of the preset, A and B are copied from their ``.npy`` files into
Zarr stores three ways, and the job runs on each, C written to a store:

``zarr``
    uncompressed, A in chunks of 4096 rows x 2048 columns and B in chunks of 2048 whole
    rows: B's blocks are whole chunk rows, read by KvikIO in place; A's (blocks of 2048
    columns read so too, of 1024 half a chunk wide) copied from maps of the chunks
    through pinned buffers, as an ``.npy`` file's A is.
``zarr-square``
    uncompressed, 4096 x 4096 chunks: A's blocks and B's (read across chunks) copied
    from maps of the chunks through pinned buffers.
``zarr-zstd``
    zstd (zarr's default compressor), A and B as in ``zarr``: decoded on the host. The
    rate of decoding both stores alone, on this host, with zarr's threads, is measured
    first (``decode``), to set the job's input rate against.

Each run's ``vs_npy`` gives the ``.npy`` job's median seconds and the ratio of the two
rates (the store's job over the file's: 1 is as fast, above 1 faster).
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .harness import Options, job_seconds, run_jobs, say

__all__ = ["LAYOUTS", "decode_rate", "run", "write_store"]

# name -> (A's chunks, B's chunks, compressed) for a side n (chunks are capped at n).
LAYOUTS: dict[str, tuple[tuple[int, int], tuple[int, int] | None, bool]] = {
    "zarr": ((4096, 2048), (2048, 0), False),  # 0: the whole width
    "zarr-square": ((4096, 4096), (4096, 4096), False),
    "zarr-zstd": ((4096, 2048), (2048, 0), True),
}


def _chunks(shape: tuple[int, int], chunks: tuple[int, int] | None) -> tuple[int, int]:
    rows, cols = chunks or shape
    return min(rows or shape[0], shape[0]), min(cols or shape[1], shape[1])


def write_store(npy: Path, store: Path, chunks: tuple[int, int], *, compressed: bool) -> Path:
    """Copy the ``.npy`` file ``npy`` into a Zarr store of ``chunks``, a band of whole chunk
    rows at a time (no chunk written twice)."""
    import zarr

    src = np.load(npy, mmap_mode="r")
    kw: dict[str, Any] = {} if compressed else {"compressors": None}
    z = zarr.create_array(str(store), shape=src.shape, chunks=chunks, dtype=src.dtype, **kw)
    for r in range(0, src.shape[0], chunks[0]):
        z[r : r + chunks[0]] = src[r : r + chunks[0]]
    return store


def decode_rate(stores: list[Path]) -> dict[str, Any]:
    """GB/s of reading ``stores`` whole into host memory through zarr (its threads decode)."""
    import zarr

    nbytes, seconds = 0, 0.0
    for store in stores:
        arr = zarr.open_array(str(store), mode="r")
        start = time.perf_counter()
        data = np.asarray(arr[...])
        seconds += time.perf_counter() - start
        nbytes += data.nbytes
        del data
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9}


def run(
    opts: Options,
    backend: str,
    counts: list[int],
    folder: Path,
    npy: dict[str, Path],
    side: int,
    budget: str,
    matmul_job: Callable[[Path, Path, Path, str, int], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Run the Zarr cases of one matmul side (see the module's docstring), the ``.npy``
    files ``npy["a"]``, ``npy["b"]`` copied into stores under ``folder``; one entry per run.
    ``matmul_job(a, b, c, budget, devices)`` is the suite's job. Skipped (none) without
    zarr, or where ``folder`` cannot hold the stores beside the files."""
    import importlib.util

    if importlib.util.find_spec("zarr") is None:
        say("the Zarr cases need zarr (pip install 'mgpu[zarr]'): skipped")
        return []
    need = 3 * 4 * side * side  # A, B and C as stores
    if need > 0.9 * shutil.disk_usage(folder).free:
        say(f"the Zarr cases need {need / 1e9:.3g} GB more in {folder}: skipped")
        return []
    runs: list[dict[str, Any]] = []
    stores = folder / "stores"
    for name, (a_chunks, b_chunks, compressed) in LAYOUTS.items():
        stores.mkdir(exist_ok=True)
        try:
            say(f"copying A and B ({side}² float32) into Zarr stores ({name})")
            a = write_store(npy["a"], stores / "a.zarr", _chunks((side, side), a_chunks), compressed=compressed)
            b = write_store(npy["b"], stores / "b.zarr", _chunks((side, side), b_chunks), compressed=compressed)
            decode = decode_rate([a, b]) if compressed else None
            for n in counts:
                job = matmul_job(a, b, stores / "c.zarr", budget, n)
                label = f"outofcore-matmul-{side}-{job['params']['operands']}-{name}"
                entries = run_jobs(opts, [(label, job)], backend, [n])
                for entry in entries:
                    entry["store"] = {"layout": name, "a_chunks": a_chunks, "b_chunks": b_chunks, "zstd": compressed}
                    if decode is not None:
                        entry["store"]["decode"] = decode
                runs += entries
        finally:
            shutil.rmtree(stores, ignore_errors=True)
    return runs


def set_against_npy(runs: list[dict[str, Any]], side: int) -> None:
    """Give each Zarr run of ``side`` the ``.npy`` job's median seconds on as many devices
    and the ratio of the rates (npy seconds over the store's), and for zstd the job's
    input rate (A and B over its seconds) beside the decoding rate alone."""
    for entry in runs:
        store = entry.get("store")
        r = entry.get("result")
        if not store or not r or r.get("status") != "ok":
            continue
        npy = [
            job_seconds(e["result"])
            for e in runs
            if not e.get("store")
            and e["devices"] == entry["devices"]
            and e["name"].startswith(f"outofcore-matmul-{side}-")
            and e.get("result")
            and e["result"].get("status") == "ok"
        ]
        seconds = job_seconds(r)
        if npy:
            median = statistics.median(npy)
            entry["vs_npy"] = {"npy_s": median, "zarr_s": seconds, "rate_ratio": median / seconds}
        if "decode" in store:
            p = r["job"]["params"]
            inputs = 4 * (p["m"] * p["k"] + p["k"] * p["n"])
            entry["vs_decode"] = {"input_gbps": inputs / seconds / 1e9, "decode_gbps": store["decode"]["gbps"]}
