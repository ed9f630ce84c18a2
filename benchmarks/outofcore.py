"""mgpu's out-of-core matmul and dot from .npy files, against cuBLASXt on the same host arrays.

    python3 benchmarks/outofcore.py OUTDIR [--n 49152] [--dot-n N] [--budget 16GiB] [--scratch DIR]
        [--devices 0,1] [--xt-blocks 8192,4096] [--xt-host pageable,pinned] [--quick] [--keep]
        [--only STEP,...]

Each step runs in its own process with a timeout (peers.py's runner), so one failure
costs only its own figures:

- ``inputs``: A, B (n x n) and x, y (dot_n) float32 ``.npy`` files in SCRATCH, written in
  row chunks, then read once (untimed: a file's first read after writing is slower, and
  mgpu's timed run reads the files where cuBLASXt's timed call does not); the values are mgpu's random operands of seed 0 (A
  and x operand 0, B and y operand 1), made on a GPU where there is one;
- ``reference``: C's sampled rows and x·y in float64 on the CPU, from the files;
- ``ceilings``: each GPU alone, CuPy: float32 GEMM at 16384³ and a 4 GiB pinned
  host->device copy (skipped without a GPU);
- ``host-routes``: ``gpus_from_files.py`` on x and y, no Dask, every GPU at once: the
  DMA alone, the host's own copy, the file read alone and the staged route (the dot's
  ceiling on this host; skipped without a GPU);
- ``mgpu-matmul``: ``python -m mgpu submit`` of C = A @ B from the files with
  ``params.operands: distributed`` and ``cluster.memory_limit: BUDGET``, C to SCRATCH/c.npy;
- ``mgpu-matmul-per-tile``: the same with ``operands: per-tile``, for the naive PCIe
  byte count (not with --quick);
- ``mgpu-dot``: x · y from the files under the same budget;
- ``cublasxt``: A and B read into host memory, then cuBLASXt's sgemm on the same GPUs at
  each block dimension (one untimed warm-up product first), from pageable memory and
  again with the arrays page-locked first (untimed; its best case), its C checked
  against the reference rows and mgpu's c.npy (skipped without a GPU).

The bound a run is set against: max(flops / (GPUs x single-GPU GEMM rate), bytes /
(GPUs x pinned host->device rate)), bytes = A + B + C once. mgpu's seconds are those from
the end of its warm-up to its result (panel reads, every tile and the write of C; not the
cluster's start); cuBLASXt's are its gemm call alone, on arrays already in memory.

Prints one table and writes OUTDIR/outofcore.json with every figure, the commands, the
job files, ``nvidia-smi -L`` and versions; logs land in OUTDIR/logs/.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: peers.py, cublasxt.py
from peers import Step, _event_median, _gemm, _nvidia_smi, _versions, child_main, run_step  # noqa: E402

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
DTYPE = "float32"
SEED = 0
STEPS = (
    "inputs",
    "reference",
    "ceilings",
    "host-routes",
    "mgpu-matmul",
    "mgpu-matmul-per-tile",
    "mgpu-dot",
    "cublasxt",
)
PROBE = SCRIPT.parent / "gpus_from_files.py"
HOST_ROUTES = {  # gpus_from_files.py's methods, as the table names them
    "dma-only": "host: pinned -> GPUs, the DMA alone",
    "memcpy": "host: memory -> memory, the copy alone",
    "copy-pread": "host: file -> pinned (pread), no DMA",
    "kvikio": "host: file -> GPUs by KvikIO (mgpu's route)",
}
SIZES = {  # (full, quick)
    "n": (49152, 8192),
    "ceil_n": (16384, 4096),
    "copy_bytes": (4 << 30, 256 << 20),
}
CHUNK_BYTES = 256 << 20  # rows of a file made and written at once
REFERENCE_ROWS = 6
DOT_FACTOR = 1.5  # default dot size: each device's share of x and y is this many budgets
QUICK_DOT_N = 200_000_000


# -- pure arithmetic (tested on CPU) -----------------------------------------------------


def matmul_flops(m: int, n: int, k: int) -> float:
    """Floating-point operations of C[m, n] = A[m, k] @ B[k, n]."""
    return 2.0 * m * n * k


def matmul_min_bytes(m: int, n: int, k: int, itemsize: int) -> int:
    """Bytes A, B and C take: what must cross PCIe at least (A and B in, C out, once)."""
    return itemsize * (m * k + k * n + m * n)


def tiled_matmul_bytes(m: int, n: int, k: int, tm: int, tn: int, itemsize: int) -> int:
    """Bytes a matmul tiled over C into tm x tn tiles moves when each tile reads its own A and B.

    Every column of tiles reads all of A and every row of tiles all of B; C goes out once.
    """
    return itemsize * (m * k * math.ceil(n / tn) + k * n * math.ceil(m / tm) + m * n)


def default_dot_n(budget: int, n_gpus: int, itemsize: int = 4, factor: float = DOT_FACTOR) -> int:
    """A dot length whose x and y, split over the GPUs, are ``factor`` budgets per GPU."""
    return max(1, int(factor * budget * n_gpus / (2 * itemsize)))


def outofcore_bound(
    flops: float, nbytes: float, n_gpus: int, gemm_tflops: float | None, h2d_gbps: float | None
) -> dict[str, Any] | None:
    """The fastest an out-of-core product can be: max(compute time, PCIe time) over the GPUs.

    Parameters
    ----------
    flops, nbytes
        The product's work and the bytes that must cross PCIe (A + B + C).
    n_gpus
        GPUs sharing the work.
    gemm_tflops, h2d_gbps
        One GPU's GEMM rate (TFLOP/s) and pinned host->device rate (GB/s); a missing one
        drops its term (None if both are missing).

    Returns
    -------
    dict or None
        ``seconds`` (the bound), ``compute_s``, ``pcie_s``, ``bound_by`` ("compute" or
        "pcie") and ``tflops`` (flops over the bound's seconds).
    """
    compute_s = flops / (n_gpus * gemm_tflops * 1e12) if gemm_tflops else None
    pcie_s = nbytes / (n_gpus * h2d_gbps * 1e9) if h2d_gbps else None
    terms = {k: v for k, v in (("compute", compute_s), ("pcie", pcie_s)) if v is not None}
    if not terms:
        return None
    bound_by = max(terms, key=lambda k: terms[k])
    seconds = terms[bound_by]
    return {
        "seconds": seconds,
        "compute_s": compute_s,
        "pcie_s": pcie_s,
        "bound_by": bound_by,
        "tflops": flops / seconds / 1e12,
        "n_gpus": n_gpus,
        "gemm_tflops": gemm_tflops,
        "h2d_gbps": h2d_gbps,
    }


def share_of_bound(bound_s: float | None, seconds: float | None) -> float | None:
    """How close a run came to the bound: bound seconds over the run's (1.0 = at the bound)."""
    return bound_s / seconds if bound_s and seconds else None


def speedup(reference_s: float | None, seconds: float | None) -> float | None:
    """How many times faster than the reference a run was."""
    return reference_s / seconds if reference_s and seconds else None


def dot_share(nbytes: float, seconds: float | None, n_gpus: int, h2d_gbps: float | None) -> dict[str, Any]:
    """A dot's GB/s (bytes of x and y over seconds) and its share of the GPUs' summed pinned H2D rate."""
    gbps = nbytes / seconds / 1e9 if seconds else None
    limit = n_gpus * h2d_gbps if h2d_gbps else None
    return {"gbps": gbps, "limit_gbps": limit, "share": gbps / limit if gbps and limit else None}


def host_routes(out: dict[str, Any] | None) -> dict[str, float]:
    """The best GB/s of each of gpus_from_files.py's routes (every GPU at once), by method."""
    best: dict[str, float] = {}
    for run in (out or {}).get("runs") or []:
        best[run["method"]] = max(best.get(run["method"], 0.0), run["gbps"])
    return best


def pcie_bytes(result: dict[str, Any] | None) -> int | None:
    """Bytes an mgpu result says crossed between host and devices (H2D + D2H, every device)."""
    if not result:
        return None
    return sum(int(d.get("bytes_h2d", 0)) + int(d.get("bytes_d2h", 0)) for d in result.get("per_device", []))


def job_seconds(result: dict[str, Any]) -> float:
    """An mgpu job's seconds from the end of its warm-up to its result.

    ``wall_s`` less the cluster's start, the ceilings, the plan and the warm-up: what is
    left is the panels (reading the operands), every tile and writing C. Without a
    ``startup`` record, ``compute_s``.
    """
    st = result.get("startup")
    if not st:
        return float(result["compute_s"])
    return float(result["wall_s"]) - sum(
        float(st.get(k) or 0.0) for k in ("cluster_s", "ceilings_s", "plan_s", "warmup_s")
    )


_BASIS = re.compile(r"^(\d+) x (\w+) measured")


def result_ceiling(result: dict[str, Any] | None, key: str) -> float | None:
    """One GPU's ``key`` ceiling as an mgpu result gives it, or None.

    From a per-worker ``ceilings`` map where the result has one, else from ``roofline``
    (the sum over N workers of the job's own ceiling, ``"N x KEY measured ..."``): the
    mean over the workers.
    """
    if not result:
        return None
    per_worker = result.get("ceilings")
    if isinstance(per_worker, dict) and per_worker:
        values = [c[key] for c in per_worker.values() if isinstance(c, dict) and key in c]
        if len(values) == len(per_worker):
            return sum(values) / len(values)
    roof = result.get("roofline") or {}
    m = _BASIS.match(roof.get("basis") or "")
    if m and m.group(2) == key and roof.get("limit"):
        return float(roof["limit"]) / int(m.group(1))
    return None


def pick_ceilings(result: dict[str, Any] | None, measured: dict[str, dict[str, float]] | None) -> dict[str, Any]:
    """Per-GPU ``gemm_float32`` and ``h2d_pinned``: mgpu's result first, else this run's CuPy figures.

    ``measured`` maps a GPU id to its figures; their mean stands for one GPU.
    """
    out: dict[str, Any] = {}
    for key in ("gemm_float32", "h2d_pinned"):
        value, source = result_ceiling(result, key), "mgpu result"
        if value is None:
            values = [g[key] for g in (measured or {}).values() if key in g]
            value, source = (sum(values) / len(values), "measured here (CuPy)") if values else (None, None)
        out[key] = {"value": value, "source": source}
    return out


def best_runs(runs: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The fastest run of each host memory kind (``pageable``, ``pinned``) among cuBLASXt's runs."""
    best: dict[str, dict[str, Any]] = {}
    for run in runs or []:
        host = run.get("host", "pageable")
        if run.get("seconds") and (host not in best or run["seconds"] < best[host]["seconds"]):
            best[host] = run
    return best


def rel_max_error(got: np.ndarray, want: np.ndarray) -> float:
    """max|got - want| / max|want|, in float64."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    diff = float(np.max(np.abs(got - want))) if want.size else 0.0
    return diff / scale if scale else diff


def sample_rows(n: int, count: int = REFERENCE_ROWS, seed: int = 0) -> list[int]:
    """A few row indices spread over ``range(n)``: the first, the last and some between."""
    rng = np.random.default_rng(seed)
    picked = {0, n - 1, n // 2} | {int(i) for i in rng.integers(0, n, size=max(0, count - 3))}
    return sorted(picked)


def job_doc(name: str, workload: str, params: dict[str, Any], budget: str, devices: list[int]) -> dict[str, Any]:
    """A job file's content: the workload on ``devices`` under a per-device budget."""
    return {
        "name": name,
        "workload": workload,
        "params": params,
        "cluster": {"backend": "auto", "devices": devices, "memory_limit": budget, "dashboard": None},
        "verify": True,
    }


# -- children: each runs in its own process ----------------------------------------------


def _paths(cfg: dict[str, Any]) -> dict[str, Path]:
    s = Path(cfg["scratch"])
    return {name: s / f"{name}.npy" for name in ("a", "b", "x", "y", "c", "c-per-tile")} | {"marker": s / "inputs.json"}


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _input_spec(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"n": cfg["n"], "dot_n": cfg["dot_n"], "dtype": DTYPE, "seed": SEED}


def child_inputs(cfg: dict[str, Any], out: dict[str, Any], save: Callable[[], None]) -> None:
    """A, B, x and y as .npy files, row chunks at a time; kept files of the same spec are reused."""
    from mgpu.kernels import random_block

    p = _paths(cfg)
    spec = _input_spec(cfg)
    try:
        same = json.loads(p["marker"].read_text()) == spec and all(p[k].exists() for k in "abxy")
    except (OSError, ValueError):
        same = False
    if same:
        out.update(status="reused", spec=spec)
        return
    p["marker"].unlink(missing_ok=True)
    xp: Any = np
    if _gpu_count():
        import cupy

        xp = cupy
    out.update(spec=spec, generator=xp.__name__)
    chunk = CHUNK_BYTES if xp is not np else CHUNK_BYTES // 8  # NumPy's generator holds several uint64 copies
    start = time.perf_counter()
    n, length = cfg["n"], cfg["dot_n"]
    itemsize = np.dtype(DTYPE).itemsize
    for name, operand in (("a", 0), ("b", 1)):
        mm = np.lib.format.open_memmap(p[name], mode="w+", dtype=DTYPE, shape=(n, n))
        step = max(1, chunk // (n * itemsize))
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            block = random_block(xp, seed=SEED, operand=operand, rows=(r0, r1), cols=(0, n), total_cols=n, dtype=DTYPE)
            mm[r0:r1] = block.get() if xp is not np else block
        mm.flush()
        del mm
    for name, operand in (("x", 0), ("y", 1)):  # 1-D: mgpu's RandomSource reads row 0 of a 1 x length operand
        mm = np.lib.format.open_memmap(p[name], mode="w+", dtype=DTYPE, shape=(length,))
        step = chunk // itemsize
        for c0 in range(0, length, step):
            c1 = min(length, c0 + step)
            block = random_block(
                xp, seed=SEED, operand=operand, rows=(0, 1), cols=(c0, c1), total_cols=length, dtype=DTYPE
            ).reshape(-1)
            mm[c0:c1] = block.get() if xp is not np else block
        mm.flush()
        del mm
    out["seconds"] = time.perf_counter() - start
    out["bytes"] = itemsize * (2 * n * n + 2 * length)
    # The first read of a file just written costs the kernel more than later reads (an 8 GiB
    # tmpfs file: 1.41 s, then 1.10 s): read them once here, so that neither mgpu
    # nor cuBLASXt (whose reads are not timed at all) is the one to pay it.
    out["first_read_s"] = _read_once([p[k] for k in "abxy"])
    out["status"] = "made"
    p["marker"].write_text(json.dumps(spec))


def _read_once(paths: list[Path], threads: int = 8, piece: int = 64 << 20) -> float:
    """Read every byte of ``paths`` once, ``threads`` ranges of each file at a time; the seconds."""
    from concurrent.futures import ThreadPoolExecutor

    def read(path: Path, lo: int, hi: int) -> None:
        buf = memoryview(bytearray(piece))
        fd = os.open(path, os.O_RDONLY)
        try:
            at = lo
            while at < hi:
                got = os.preadv(fd, [buf[: min(piece, hi - at)]], at)
                if got == 0:
                    break  # the file ends: nothing more to bring in
                at += got
        finally:
            os.close(fd)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for path in paths:
            size = path.stat().st_size
            starts = [(path, i * size // threads, (i + 1) * size // threads) for i in range(threads)]
            list(pool.map(lambda piece: read(*piece), starts))
    return time.perf_counter() - start


def child_reference(cfg: dict[str, Any], out: dict[str, Any], save: Callable[[], None]) -> None:
    """C's sampled rows and x·y in float64 on the CPU, from the files."""
    p = _paths(cfg)
    start = time.perf_counter()
    a = np.load(p["a"], mmap_mode="r")
    b = np.load(p["b"], mmap_mode="r")
    rows = sample_rows(a.shape[0])
    a_rows = np.asarray(a[rows], dtype=np.float64)
    ref = np.zeros((len(rows), b.shape[1]), dtype=np.float64)
    step = max(1, (512 << 20) // (8 * b.shape[1]))  # row blocks of B, 512 MiB in float64
    for k0 in range(0, b.shape[0], step):
        ref += a_rows[:, k0 : k0 + step] @ np.asarray(b[k0 : k0 + step], dtype=np.float64)
    np.save(Path(cfg["outdir"]) / "raw" / "reference-rows.npy", ref)
    out.update(rows=rows, matmul_s=time.perf_counter() - start)
    save()
    start = time.perf_counter()
    x = np.load(p["x"], mmap_mode="r")
    y = np.load(p["y"], mmap_mode="r")
    total, step = 0.0, 1 << 24
    for s in range(0, x.shape[0], step):
        total += float(
            np.dot(np.asarray(x[s : s + step], dtype=np.float64), np.asarray(y[s : s + step], dtype=np.float64))
        )
    out.update(dot=total, dot_s=time.perf_counter() - start)


def child_ceilings(cfg: dict[str, Any], out: dict[str, Any], save: Callable[[], None]) -> None:
    """Each GPU alone: float32 GEMM (TFLOP/s) and a pinned host->device copy (GB/s), CUDA events."""
    if not _gpu_count():
        out["status"] = "skipped: no GPU"
        return
    import cupy
    import cupyx

    quick = cfg["quick"]
    n, nbytes = SIZES["ceil_n"][quick], SIZES["copy_bytes"][quick]
    out.update(status="measured", gemm_n=n, copy_bytes=nbytes, per_gpu={})
    for dev in cfg["devices"]:
        with cupy.cuda.Device(dev):
            gemm = _gemm(cupy, n, "float32", False, 1, 3)
            h2d, samples = _h2d_gbps(cupy, cupyx, nbytes)
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
            out["per_gpu"][str(dev)] = {
                "gemm_float32": gemm["value"],
                "gemm_samples": gemm["samples"],
                "h2d_pinned": h2d,
                "h2d_samples": samples,
            }
        save()


def _h2d_gbps(cupy: Any, cupyx: Any, nbytes: int) -> tuple[float, list[float]]:
    """GB/s of a pinned host->device copy of ``nbytes`` on the current device (median of 5)."""
    host = cupyx.empty_pinned(nbytes, dtype=np.uint8)
    host[:] = 1
    dst = cupy.empty(nbytes, dtype=cupy.uint8)
    stream = cupy.cuda.get_current_stream()
    t, samples = _event_median(cupy, lambda: dst.set(host, stream=stream), 1, 5)
    return nbytes / t / 1e9, samples


def child_cublasxt(cfg: dict[str, Any], out: dict[str, Any], save: Callable[[], None]) -> None:
    """cuBLASXt's sgemm on A and B read into host memory, per host memory kind and block dimension.

    ``pageable``: the arrays as NumPy holds them. ``pinned``: the same arrays page-locked
    (cudaHostRegister) before the timed calls, untimed, which is cuBLASXt's best case.
    Each run's C is checked against the float64 reference rows and mgpu's c.npy.
    """
    if not _gpu_count():
        out["status"] = "skipped: no GPU"
        return
    import cublasxt
    import cupy

    p = _paths(cfg)
    out.update(status="ran", library=cublasxt.find_libcublas(), devices=cfg["devices"], runs=[])
    start = time.perf_counter()
    a, b = np.load(p["a"]), np.load(p["b"])  # read whole: host-resident operands, as cuBLASXt takes them
    c = np.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    c.fill(0)  # fault C's pages in now, not inside the timed call
    out["load_s"] = time.perf_counter() - start
    rows, ref = _reference(cfg)
    rows = rows or sample_rows(c.shape[0])
    mgpu_c = np.load(p["c"], mmap_mode="r") if p["c"].exists() else None
    flops = matmul_flops(a.shape[0], b.shape[1], a.shape[1])
    for host in cfg["xt_host"]:
        registered = []
        try:
            if host == "pinned":
                start = time.perf_counter()
                for arr in (a, b, c):
                    cupy.cuda.runtime.hostRegister(arr.ctypes.data, arr.nbytes, 0)
                    registered.append(arr)
                out["register_s"] = time.perf_counter() - start
            for block in cfg["xt_blocks"]:
                w = min(a.shape[0], 2 * block)
                wa, wb = np.ascontiguousarray(a[:w, :w]), np.ascontiguousarray(b[:w, :w])
                with cublasxt.CublasXt(cfg["devices"], block) as xt:
                    _, warm_s = xt.gemm(wa, wb)  # untimed: the handle's threads, buffers and kernels
                    del wa, wb
                    _, seconds = xt.gemm(a, b, out=c)
                    run: dict[str, Any] = {
                        "host": host,
                        "block_dim": xt.block_dim,
                        "seconds": seconds,
                        "tflops": flops / seconds / 1e12,
                        "warmup_n": w,
                        "warmup_s": warm_s,
                    }
                if ref is not None:
                    run["max_rel_error_vs_float64"] = rel_max_error(c[rows], ref)
                if mgpu_c is not None:
                    run["max_rel_error_vs_mgpu"] = rel_max_error(c[rows], mgpu_c[rows])
                out["runs"].append(run)
                save()
        finally:
            for arr in registered:
                cupy.cuda.runtime.hostUnregister(arr.ctypes.data)


def _reference(cfg: dict[str, Any]) -> tuple[list[int], np.ndarray | None]:
    raw = Path(cfg["outdir"]) / "raw"
    try:
        rows = json.loads((raw / "reference.json").read_text())["rows"]
        return rows, np.load(raw / "reference-rows.npy")
    except (OSError, ValueError, KeyError):
        return [], None


CHILDREN: dict[str, Callable[[dict[str, Any], dict[str, Any], Callable[[], None]], None]] = {
    "inputs": child_inputs,
    "reference": child_reference,
    "ceilings": child_ceilings,
    "cublasxt": child_cublasxt,
}


def run_child(outdir: Path, name: str) -> None:
    """Run one child step from OUTDIR/raw/config.json, saving its figures as they come."""
    cfg = json.loads((outdir / "raw" / "config.json").read_text())
    out: dict[str, Any] = {"done": False}
    child_main(outdir / "raw" / f"{name}.json", out, lambda save: CHILDREN[name](cfg, out, save))


# -- the steps the parent runs -----------------------------------------------------------


def _parse_child(raw: Path, log: Path) -> dict[str, Any]:
    return {"out": json.loads(raw.read_text())}


def _parse_mgpu(raw: Path, log: Path) -> dict[str, Any]:
    r = json.loads(raw.read_text())
    return {"result": r}


def write_jobs(cfg: dict[str, Any]) -> dict[str, Path]:
    """The job files of the mgpu steps, in OUTDIR; returns step name -> file."""
    import yaml

    p = _paths(cfg)
    files = {"a": str(p["a"]), "b": str(p["b"])}
    docs = {
        "mgpu-matmul": job_doc(
            "outofcore-matmul-distributed",
            "matmul",
            {"input": files, "output": str(p["c"]), "operands": "distributed"},
            cfg["budget"],
            cfg["devices"],
        ),
        "mgpu-matmul-per-tile": job_doc(
            "outofcore-matmul-per-tile",
            "matmul",
            {"input": files, "output": str(p["c-per-tile"]), "operands": "per-tile"},
            cfg["budget"],
            cfg["devices"],
        ),
        "mgpu-dot": job_doc(
            "outofcore-dot", "dot", {"input": {"x": str(p["x"]), "y": str(p["y"])}}, cfg["budget"], cfg["devices"]
        ),
    }
    out = {}
    for name, doc in docs.items():
        path = Path(cfg["outdir"]) / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        out[name] = path
    return out


def plan_steps(cfg: dict[str, Any]) -> list[Step]:
    """Every step of a run, in the order they run."""
    outdir = Path(cfg["outdir"])
    raw = outdir / "raw"
    me = [sys.executable, str(SCRIPT), str(outdir), "--child"]
    n, length = cfg["n"], cfg["dot_n"]
    gb = 4 * (3 * n * n + 2 * length) / 1e9  # every byte of every file, A to y
    p = _paths(cfg)
    routes = [
        sys.executable,
        str(PROBE),
        str(p["x"]),
        str(p["y"]),
        "--gpus",
        str(len(cfg["devices"])),
        "--methods",
        "kvikio",
        "--chunks",
        "16",
        "--repeat",
        "1",
        "--json",
        str(raw / "host-routes.json"),
    ]
    steps = [
        Step("inputs", me + ["inputs"], 300 + 5 * gb, _parse_child, raw / "inputs.json"),
        Step("reference", me + ["reference"], 300 + 3 * gb, _parse_child, raw / "reference.json"),
        Step("ceilings", me + ["ceilings"], 300, _parse_child, raw / "ceilings.json"),
        Step("host-routes", routes, 120 + gb, _parse_child, raw / "host-routes.json"),
    ]
    jobs = write_jobs(cfg)
    for name in ("mgpu-matmul", "mgpu-matmul-per-tile", "mgpu-dot"):
        if name == "mgpu-matmul-per-tile" and cfg["quick"]:
            continue
        result = outdir / f"{name}.json"
        cmd = [sys.executable, "-m", "mgpu", "submit", str(jobs[name]), "--json", str(result), "--force"]
        steps.append(Step(name, cmd, 600 + 3 * gb, _parse_mgpu, result))
    steps.append(Step("cublasxt", me + ["cublasxt"], 600 + 3 * gb, _parse_child, raw / "cublasxt.json"))
    return steps


def _mgpu_summary(result: dict[str, Any] | None, flops: float | None, nbytes: float | None) -> dict[str, Any] | None:
    """The figures of one mgpu run the report needs."""
    if not result:
        return None
    seconds = job_seconds(result)
    out = {
        "status": result.get("status"),
        "verify": (result.get("verify") or {}).get("passed"),
        "max_rel_error": (result.get("verify") or {}).get("max_rel_error"),
        "seconds": seconds,
        "compute_s": result.get("compute_s"),
        "wall_s": result.get("wall_s"),
        "startup": result.get("startup"),
        "throughput": result.get("throughput"),
        "plan": result.get("plan"),
        "backend": result.get("backend"),
        "pcie_bytes": pcie_bytes(result),
        "n_devices": len(result.get("per_device") or []),
        "value": result.get("value"),
    }
    if flops:
        out["tflops"] = flops / seconds / 1e12 if seconds else None
    if nbytes:
        out["gbps"] = nbytes / seconds / 1e9 if seconds else None
    return out


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Every figure of the run from the steps' records: bound, shares, ratios, byte counts."""
    steps = report["steps"]
    n, length, itemsize = report["n"], report["dot_n"], np.dtype(DTYPE).itemsize
    flops, min_bytes = matmul_flops(n, n, n), matmul_min_bytes(n, n, n, itemsize)
    mm = steps.get("mgpu-matmul", {}).get("result")
    pt = steps.get("mgpu-matmul-per-tile", {}).get("result")
    dot = steps.get("mgpu-dot", {}).get("result")
    measured = (steps.get("ceilings", {}).get("out") or {}).get("per_gpu")
    n_gpus = len((mm or dot or {}).get("per_device") or []) or len(report["devices"])
    ceilings = pick_ceilings(mm, measured)
    ceilings["measured_per_gpu"] = measured
    gemm, h2d = ceilings["gemm_float32"]["value"], ceilings["h2d_pinned"]["value"]
    bound = outofcore_bound(flops, min_bytes, n_gpus, gemm, h2d)
    xt = steps.get("cublasxt", {}).get("out") or {}
    bound_s = bound["seconds"] if bound else None
    xt_best = {
        host: {**run, "share_of_bound": share_of_bound(bound_s, run["seconds"])}
        for host, run in best_runs(xt.get("runs")).items()
    }
    mgpu = _mgpu_summary(mm, flops, None)
    per_tile = _mgpu_summary(pt, flops, None)
    for run in (mgpu, per_tile):
        if run:
            run["share_of_bound"] = share_of_bound(bound_s, run["seconds"])
            run["x_cublasxt"] = {host: speedup(r["seconds"], run["seconds"]) for host, r in xt_best.items()}
    per_tile_planned = None
    if pt and pt.get("plan", {}).get("tile_shape"):
        shape = pt["plan"]["tile_shape"]
        per_tile_planned = tiled_matmul_bytes(n, n, n, shape["m"], shape["n"], itemsize)
    dot_bytes = 2 * itemsize * length
    dot_sum = _mgpu_summary(dot, None, dot_bytes)
    host = host_routes(steps.get("host-routes", {}).get("out"))
    if dot_sum:
        dot_sum.update(dot_share(dot_bytes, dot_sum["seconds"], n_gpus, h2d))
        # What the host moved from the files by itself: the read alone or the staged route, the faster.
        best = max(host.get("copy-pread", 0.0), host.get("kvikio", 0.0))
        dot_sum["share_of_host_route"] = dot_sum["gbps"] / best if dot_sum["gbps"] and best else None
        ref = (steps.get("reference", {}).get("out") or {}).get("dot")
        if ref is not None and dot_sum.get("value") is not None:
            dot_sum["rel_error_vs_float64"] = abs(dot_sum["value"] - ref) / max(abs(ref), 1e-300)
    failed = {
        key: " ".join(steps[name]["error"].split())[:120]
        for key, name in (("mgpu", "mgpu-matmul"), ("per_tile", "mgpu-matmul-per-tile"), ("dot", "mgpu-dot"))
        if "error" in steps.get(name, {})
    }
    return {
        "n_gpus": n_gpus,
        "backend": (mm or dot or {}).get("backend"),
        "failed": failed,
        "ceilings": ceilings,
        "matmul": {
            "m": n,
            "n": n,
            "k": n,
            "dtype": DTYPE,
            "flops": flops,
            "bound": bound,
            "mgpu": mgpu,
            "per_tile": per_tile,
            "cublasxt": xt_best,
            "cublasxt_runs": xt.get("runs"),
            "cublasxt_status": xt.get("status") or steps.get("cublasxt", {}).get("error") or "not run",
            "check": report.get("checks", {}),
        },
        "pcie": {
            "minimum": min_bytes,
            "distributed": pcie_bytes(mm),
            "per_tile": pcie_bytes(pt),
            "per_tile_planned": per_tile_planned,
            "dot": pcie_bytes(dot),
            "dot_minimum": dot_bytes,
        },
        "dot": dot_sum,
        "host_routes": host,
        "inputs": steps.get("inputs", {}).get("out"),
    }


def check_outputs(cfg: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Each output's sampled rows against the float64 reference rows (max relative error)."""
    rows, ref = _reference(cfg)
    p = _paths(cfg)
    out: dict[str, Any] = {}
    for name in names:
        if ref is None or not p[name].exists():
            out[name] = {"error": "no reference rows" if ref is None else f"{p[name]} was not written"}
            continue
        c = np.load(p[name], mmap_mode="r")
        out[name] = {"rows": rows, "max_rel_error_vs_float64": rel_max_error(c[rows], ref)}
    return out


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def print_table(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from mgpu.sizes import format_bytes

    mm, pcie, dot = s["matmul"], s["pcie"], s["dot"]
    bound = mm["bound"]
    where = f"{s['n_gpus']} GPUs" if s["backend"] != "cpu" else f"{s['n_gpus']} CPU workers"
    table = Table(
        title=f"out of core, {mm['m']}³ {mm['dtype']} matmul and dot from .npy files, {where}", title_justify="left"
    )
    for col, just in (
        ("figure", "left"),
        ("seconds", "right"),
        ("value", "right"),
        ("unit", "left"),
        ("of bound", "right"),
        ("mgpu ×", "right"),
        ("note", "left"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    if bound:
        table.add_row(
            "bound: max(compute, PCIe)",
            _fmt(bound["seconds"], ".3g"),
            _fmt(bound["tflops"], ".4g"),
            "TFLOP/s",
            "100%",
            "",
            f"{bound['bound_by']}-bound; {s['n_gpus']} x "
            f"{_fmt(bound['gemm_tflops'], '.4g')} TFLOP/s, {s['n_gpus']} x {_fmt(bound['h2d_gbps'], '.4g')} GB/s",
        )
    for label, key in (("mgpu matmul, operands distributed", "mgpu"), ("mgpu matmul, operands per-tile", "per_tile")):
        run = mm[key]
        if run:
            ratios = ", ".join(f"{_fmt(r, '.2f')} {host}" for host, r in run["x_cublasxt"].items())
            table.add_row(
                label,
                _fmt(run["seconds"], ".3g"),
                _fmt(run.get("tflops"), ".4g"),
                "TFLOP/s",
                _fmt(run.get("share_of_bound"), ".1%"),
                ratios,
                f"verify {run['verify']}; compute_s {_fmt(run['compute_s'], '.3g')}",
            )
        elif s["failed"].get(key):
            table.add_row(label, "-", "-", "", "", "", s["failed"][key])
    for host, xt in mm["cublasxt"].items():
        table.add_row(
            f"cuBLASXt, {host}, block {xt['block_dim']}",
            _fmt(xt["seconds"], ".3g"),
            _fmt(xt["tflops"], ".4g"),
            "TFLOP/s",
            _fmt(xt.get("share_of_bound"), ".1%"),
            _fmt(speedup(xt["seconds"], (mm["mgpu"] or {}).get("seconds")), ".2f"),
            f"max rel. error vs float64 {_fmt(xt.get('max_rel_error_vs_float64'), '.2e')}, "
            f"vs mgpu {_fmt(xt.get('max_rel_error_vs_mgpu'), '.2e')}",
        )
    if not mm["cublasxt"]:
        table.add_row("cuBLASXt", "-", "-", "", "", "", str(mm["cublasxt_status"]))
    for label, key in (
        ("PCIe bytes, distributed", "distributed"),
        ("PCIe bytes, per-tile", "per_tile"),
        ("PCIe bytes, per-tile as planned", "per_tile_planned"),
        ("PCIe bytes, minimum (A+B+C)", "minimum"),
    ):
        value = pcie[key]
        if value is not None:
            table.add_row(label, "", format_bytes(value), "", "", "", f"{value / pcie['minimum']:.2f} x minimum")
    if s["backend"] == "cpu":
        table.add_row("(CPU workers: nothing crosses PCIe)", "", "", "", "", "", "")
    if not dot and s["failed"].get("dot"):
        table.add_row("mgpu dot from files", "-", "-", "", "", "", s["failed"]["dot"])
    if dot:
        table.add_row(
            "mgpu dot from files",
            _fmt(dot["seconds"], ".3g"),
            _fmt(dot["gbps"], ".4g"),
            "GB/s",
            _fmt(dot["share"], ".1%"),
            "",
            f"of {_fmt(dot['limit_gbps'], '.4g')} GB/s ({s['n_gpus']} x pinned "
            f"H2D); PCIe {format_bytes(pcie['dot'] or 0)} of {format_bytes(pcie['dot_minimum'])}",
        )
        if dot.get("share_of_host_route"):
            table.add_row(
                "mgpu dot, share of the host's route",
                "",
                _fmt(dot["share_of_host_route"], ".1%"),
                "",
                "",
                "",
                "of the faster host route from the files, no Dask (below)",
            )
    for method, label in HOST_ROUTES.items():
        if method in s["host_routes"]:
            table.add_row(
                label,
                "",
                _fmt(s["host_routes"][method], ".4g"),
                "GB/s",
                "",
                "",
                "x and y, every GPU at once, no Dask (gpus_from_files.py)",
            )
    inputs = s["inputs"] or {}
    if inputs.get("seconds"):
        table.add_row(
            "making the input files",
            _fmt(inputs["seconds"], ".3g"),
            format_bytes(inputs["bytes"]),
            "",
            "",
            "",
            f"generated with {inputs.get('generator')}",
        )
    if inputs.get("first_read_s"):
        table.add_row(
            "their first read (untimed in both)",
            _fmt(inputs["first_read_s"], ".3g"),
            _fmt(inputs["bytes"] / inputs["first_read_s"] / 1e9, ".3g"),
            "GB/s",
            "",
            "",
            "8 threads; a file's first read after writing costs the kernel more",
        )
    Console(width=160).print(table)


def orchestrate(cfg: dict[str, Any], only: set[str] | None) -> dict[str, Any]:
    """Run the steps in turn, rewriting outofcore.json after each; clean up unless kept."""
    outdir = Path(cfg["outdir"])
    for d in (outdir, outdir / "logs", outdir / "raw"):
        d.mkdir(parents=True, exist_ok=True)
    (outdir / "raw" / "config.json").write_text(json.dumps(cfg, indent=1))
    steps = plan_steps(cfg)
    if only:
        steps = [s for s in steps if s.name in only]
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": sys.argv,
        **{
            k: cfg[k]
            for k in ("quick", "n", "dot_n", "budget", "budget_bytes", "devices", "scratch", "xt_blocks", "xt_host")
        },
        "dtype": DTYPE,
        "seed": SEED,
        "nvidia_smi": _nvidia_smi(),
        "versions": _versions(),
        "jobs": {p.stem: p.read_text() for p in sorted(outdir.glob("mgpu-*.yaml"))},
        "commands": [],
        "steps": {},
        "checks": {},
        "notes": [
            "mgpu seconds: from the end of its warm-up to its result (job_seconds), i.e. reading A and B from "
            "the files, every tile and writing C; compute_s (mgpu's own tile span) is kept beside it.",
            "cuBLASXt seconds: the gemm call alone, on A and B already read into host memory and C's pages "
            "faulted in; the best block dimension of each host memory kind is the one compared. 'pinned' "
            "page-locks A, B and C before the calls (register_s, untimed): on one H100, 8192^3 ran at 5.5 "
            "TFLOP/s from pageable and 38.6 from page-locked memory.",
            "bound = max(flops / (GPUs x one GPU's gemm_float32), (A+B+C bytes) / (GPUs x one GPU's pinned "
            "H2D)); ceilings from mgpu's result where it has them, else measured here with CuPy.",
            "The files hold mgpu's random operands of seed 0, so a job with input: random and seed 0 computes "
            "the same product.",
        ],
    }
    out = outdir / "outofcore.json"
    try:
        for step in steps:
            if step.name in ("mgpu-matmul", "mgpu-matmul-per-tile"):
                # A C left by an earlier run (--keep) would be replaced at the job's end, and
                # freeing its pages (~0.65 s for 9.7 GB on tmpfs) would count in the job's time.
                _paths(cfg)["c" if step.name == "mgpu-matmul" else "c-per-tile"].unlink(missing_ok=True)
            rec = run_step(step, outdir / "logs", step.timeout)
            report["steps"][step.name] = rec
            report["commands"].append(rec["cmd"])
            status = "ok" if "error" not in rec else "FAILED: " + " ".join(rec["error"].split())[:200]
            child = rec.get("out") or {}
            if str(child.get("status", "")).startswith("skipped"):
                status = child["status"]
            click.echo(f"{step.name:<22} {rec['seconds']:7.1f} s  {status}")
            if step.name in ("mgpu-matmul", "mgpu-matmul-per-tile"):
                name = "c" if step.name == "mgpu-matmul" else "c-per-tile"
                report["checks"].update(check_outputs(cfg, [name]))
                if name == "c-per-tile" and not cfg["keep"]:
                    _paths(cfg)["c-per-tile"].unlink(missing_ok=True)
            report["summary"] = summarize(report)
            out.write_text(json.dumps(report, indent=1, default=str))
    finally:
        if not cfg["keep"]:
            _clean(cfg)
    report["summary"] = summarize(report)
    out.write_text(json.dumps(report, indent=1, default=str))
    return report


def _clean(cfg: dict[str, Any]) -> None:
    for path in _paths(cfg).values():
        path.unlink(missing_ok=True)
    if cfg.get("scratch_made"):
        shutil.rmtree(cfg["scratch"], ignore_errors=True)


def _int_list(text: str, param: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=param) from None
    if not values or any(v < 0 for v in values):
        raise click.BadParameter(f"expected one or more integers >= 0, got {text!r}", param_hint=param)
    return values


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("outdir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--n", "n", type=click.IntRange(1), help="A and B are n x n float32  [default: 49152; 8192 with --quick]")
@click.option(
    "--dot-n",
    type=click.IntRange(1),
    help="length of x and y  [default: 1.5 budgets per GPU; at most 2e8 with --quick]",
)
@click.option("--budget", default="16GiB", show_default=True, help="cluster.memory_limit, the per-device budget")
@click.option(
    "--scratch",
    type=click.Path(file_okay=False, path_type=Path),
    help="folder for the .npy files  [default: a new temporary folder]",
)
@click.option("--devices", default="0,1", show_default=True, help="GPU ids (CPU workers where there is no GPU)")
@click.option("--xt-blocks", default="8192,4096", show_default=True, help="cuBLASXt block dimensions to try")
@click.option(
    "--xt-host",
    default="pageable,pinned",
    show_default=True,
    help="cuBLASXt's host memory: pageable (as NumPy holds it), pinned (page-locked first, untimed)",
)
@click.option("--quick", is_flag=True, help="smaller sizes, no per-tile run, one cuBLASXt block dimension")
@click.option("--keep", is_flag=True, help="keep the .npy files (a later run with the same sizes reuses them)")
@click.option("--only", metavar="STEP,...", help=f"run only these steps ({', '.join(STEPS)})")
@click.option("--child", type=click.Choice(sorted(CHILDREN)), hidden=True)
def main(
    outdir: Path,
    n: int | None,
    dot_n: int | None,
    budget: str,
    scratch: Path | None,
    devices: str,
    xt_blocks: str,
    xt_host: str,
    quick: bool,
    keep: bool,
    only: str | None,
    child: str | None,
) -> None:
    """Run mgpu's out-of-core matmul and dot from .npy files and cuBLASXt on the same
    host arrays; print a table and write OUTDIR/outofcore.json."""
    outdir = outdir.resolve()
    if child:
        run_child(outdir, child)
        return
    from dask.utils import parse_bytes

    try:
        budget_bytes = parse_bytes(budget)
    except (ValueError, TypeError):
        raise click.BadParameter(f"{budget!r} is not a size (e.g. 16GiB, 512MiB)", param_hint="--budget") from None
    device_ids = _int_list(devices, "--devices")
    blocks = _int_list(xt_blocks, "--xt-blocks")
    if any(b < 1 for b in blocks):
        raise click.BadParameter("block dimensions are at least 1", param_hint="--xt-blocks")
    hosts = [h.strip() for h in xt_host.split(",") if h.strip()]
    if not hosts or set(hosts) - {"pageable", "pinned"} or len(set(hosts)) != len(hosts):
        raise click.BadParameter(f"expected pageable, pinned or both, got {xt_host!r}", param_hint="--xt-host")
    chosen = set(only.split(",")) if only else None
    if chosen and chosen - set(STEPS):
        raise click.BadParameter(
            f"unknown step(s) {sorted(chosen - set(STEPS))}; the steps are {list(STEPS)}", param_hint="--only"
        )
    made = scratch is None
    scratch = Path(tempfile.mkdtemp(prefix="mgpu-outofcore-")) if scratch is None else scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    cfg = {
        "outdir": str(outdir),
        "quick": quick,
        "n": n or SIZES["n"][quick],
        "dot_n": dot_n or min(default_dot_n(budget_bytes, len(device_ids)), QUICK_DOT_N if quick else 1 << 62),
        "budget": budget,
        "budget_bytes": budget_bytes,
        "devices": device_ids,
        "scratch": str(scratch),
        "scratch_made": made,
        "xt_blocks": blocks[:1] if quick else blocks,
        "xt_host": hosts,
        "keep": keep,
    }
    report = orchestrate(cfg, chosen)
    print_table(report["summary"])
    click.echo(f"wrote {outdir / 'outofcore.json'}")


if __name__ == "__main__":
    main()
