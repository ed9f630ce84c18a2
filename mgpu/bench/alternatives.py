"""The alternatives mgpu is set against, each run in a child process of its own:

    python -m mgpu.bench.alternatives NAME ARGS_JSON OUT_JSON

``dask-array``  dask.array matmul and dot: CuPy chunks on dask-cuda's LocalCUDACluster
                where there are GPUs, NumPy chunks on a LocalCluster otherwise
``cupy``        CuPy on one GPU: matmul per dtype (and TF32), ``cupy.dot``
``cublasxt``    cuBLASXt's GEMM on host-resident operands (random, or two ``.npy`` files), in
                pinned and pageable memory, and from files the same work as mgpu's job

Each writes ``{"status": "ok", "figures": [...], ...}`` to OUT_JSON; the harness reads it.
The process exits without closing its cluster: a UCX shutdown can hang, and the harness
ends the process group.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mgpu.gpus import cuda_name


def _figure(name: str, unit: str, work: float, samples: list[float], **extra: Any) -> dict[str, Any]:
    seconds = statistics.median(samples)
    return {"name": name, "unit": unit, "value": work / seconds, "seconds": seconds, "samples": samples, **extra}


def _event_median(cupy: Any, fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of ``fn`` on the current stream by CUDA events, after one untimed call."""
    fn()
    cupy.cuda.Device().synchronize()
    samples = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return samples


def dask_array(args: dict[str, Any]) -> dict[str, Any]:
    """dask.array ``x @ y`` and ``da.dot`` on a fresh cluster, inputs persisted first."""
    import dask.array as da
    from distributed import Client, LocalCluster, wait

    devices, protocol = int(args["devices"]), args.get("protocol", "tcp")
    t0 = time.perf_counter()
    if args["backend"] == "cuda":
        import cupy
        from dask_cuda import LocalCUDACluster

        kwargs: dict[str, Any] = {"protocol": protocol, "enable_nvlink": protocol == "ucx"} if protocol == "ucx" else {}
        cluster = LocalCUDACluster(
            CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(devices)),
            threads_per_worker=1,
            rmm_pool_size=args.get("rmm_pool_size", "40GB"),
            dashboard_address=None,
            **kwargs,
        )
        rs = da.random.RandomState(0, RandomState=cupy.random.RandomState)

        def sync() -> None:
            cupy.cuda.Device().synchronize()
    else:
        cluster = LocalCluster(n_workers=devices, threads_per_worker=1, dashboard_address=None, protocol="tcp")
        rs = da.random.RandomState(0)

        def sync() -> None:
            pass

    client = Client(cluster)
    client.wait_for_workers(devices)
    out: dict[str, Any] = {"status": "ok", "cluster_start_s": time.perf_counter() - t0, "protocol": protocol}

    def timed(shape: tuple[int, ...], chunk: int, op: Callable[[Any, Any], Any]) -> float:
        # New inputs each time (new keys: Dask would hand back a result it still holds),
        # persisted first, so only the operation is timed.
        x, y = client.persist([rs.random_sample(shape, chunks=chunk).astype("float32") for _ in range(2)])
        wait([x, y])
        client.run(sync)
        start = time.perf_counter()
        z = client.persist(op(x, y))
        wait(z)
        client.run(sync)
        seconds = time.perf_counter() - start
        del x, y, z  # released once no reference holds them (a cancel races the next persist)
        return seconds

    n, c = int(args["matmul_n"]), int(args["matmul_chunk"])
    m, mc = int(args["dot_n"]), int(args["dot_chunk"])
    cases = [
        ("matmul", "TFLOP/s", 2.0 * n**3 / 1e12, (n, n), c, lambda x, y: x @ y),
        ("dot", "GB/s", 8.0 * m / 1e9, (m,), mc, lambda x, y: da.dot(x, y)),
    ]
    out["figures"] = []
    for name, unit, work, shape, chunk, op in cases:
        timed(shape, chunk, op)  # untimed: cuBLAS handles, pools, connections
        samples = [timed(shape, chunk, op) for _ in range(int(args["repeats"]))]
        out["figures"].append(_figure(name, unit, work, samples, shape=list(shape), chunk=chunk))
    return out


def cupy_one_gpu(args: dict[str, Any]) -> dict[str, Any]:
    """CuPy on GPU 0 alone: matmul float32, TF32 and float64, and ``cupy.dot`` of float32."""
    import cupy
    from cupy._core import _routines_linalg as linalg

    n, m, repeats = int(args["matmul_n"]), int(args["dot_n"]), int(args["repeats"])
    rs = cupy.random.RandomState(0)
    figures = []
    for name, dtype, tf32 in (
        ("matmul", "float32", False),
        ("matmul-tf32", "float32", True),
        ("matmul-float64", "float64", False),
    ):
        a, b = rs.random_sample((n, n), dtype=dtype), rs.random_sample((n, n), dtype=dtype)
        c = cupy.empty((n, n), dtype=dtype)
        previous = linalg.get_compute_type(np.float32)
        if tf32:
            linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)
        try:
            samples = _event_median(cupy, functools.partial(cupy.matmul, a, b, out=c), repeats)
        finally:
            linalg.set_compute_type(np.float32, previous)
        figures.append(_figure(name, "TFLOP/s", 2.0 * n**3 / 1e12, samples, shape=[n, n, n]))
        del a, b, c
        cupy.get_default_memory_pool().free_all_blocks()
    x, y = rs.random_sample(m, dtype="float32"), rs.random_sample(m, dtype="float32")
    figures.append(
        _figure("dot", "GB/s", 8.0 * m / 1e9, _event_median(cupy, lambda: cupy.dot(x, y), repeats), shape=[m])
    )
    return {"status": "ok", "device": cuda_name(0), "figures": figures}


def cublasxt(args: dict[str, Any]) -> dict[str, Any]:
    """cuBLASXt's GEMM in each configuration of :data:`~mgpu.bench.xtcases.CASES` (those
    named in ``args["cases"]``, else all), and from files the same work as mgpu's job.

    The pageable configurations run first, on NumPy arrays; those go before the pinned
    arrays are made, so the host holds one set of operands at a time. Each handle makes
    an untimed product of a few rows first (its devices' buffers and streams).
    """
    import cupy

    from .cublasxt import CublasXt, find_libcublas
    from .xtcases import CASES, SAME_WORK, read_npy_into, write_npy

    files = "a" in args
    if files:
        heads = np.load(args["a"], mmap_mode="r"), np.load(args["b"], mmap_mode="r")
        (m, k), (_, n), dtype = heads[0].shape, heads[1].shape, heads[0].dtype
        del heads
    else:
        m = n = k = int(args["n"])
        dtype = np.dtype(np.float32)
    devices = list(range(int(args["devices"])))
    repeats = int(args.get("repeats", 1))
    wanted = set(args.get("cases") or [c.name for c in CASES] + [SAME_WORK])
    work = 2.0 * m * n * k / 1e12
    figures: list[dict[str, Any]] = []

    def fill(a: np.ndarray, b: np.ndarray) -> None:
        if files:
            read_npy_into(args["a"], a)
            read_npy_into(args["b"], b)
        else:
            rng = np.random.default_rng(0)
            rng.random(out=a, dtype=np.float32)
            rng.random(out=b, dtype=np.float32)

    def timed(case: Any, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> dict[str, Any]:
        with CublasXt(devices, case.block_dim, pinning=case.pinning) as xt:
            w = min(m, 2048)
            xt.gemm(a[:w], b, out=c[:w])  # untimed: the handle's buffers and streams
            samples = [xt.gemm(a, b, out=c)[1] for _ in range(repeats)]
            block = xt.block_dim
        return _figure(
            "matmul",
            "TFLOP/s",
            work,
            samples,
            shape=[m, n, k],
            config=case.name,
            host_memory=case.host_memory,
            block_dim=block,
            pinning=case.pinning,
        )

    pageable = [c for c in CASES if c.host_memory == "pageable" and c.name in wanted]
    if pageable:
        a, b = np.empty((m, k), dtype), np.empty((k, n), dtype)
        c = np.zeros((m, n), dtype)  # its pages made now, not in a timed call
        fill(a, b)
        figures += [timed(case, a, b, c) for case in pageable]
        del a, b, c
    pinned = [c for c in CASES if c.host_memory == "pinned" and c.name in wanted]
    same_work = files and SAME_WORK in wanted
    if pinned or same_work:
        a, b, c = (_pinned(shape, dtype) for shape in ((m, k), (k, n), (m, n)))
        c[...] = 0
        if same_work:
            with CublasXt(devices, 8192) as xt:
                w = min(m, 2048)
                xt.gemm(a[:w], b, out=c[:w])  # untimed, as above
                read_s = read_npy_into(args["a"], a) + read_npy_into(args["b"], b)
                gemm_s = xt.gemm(a, b, out=c)[1]
                out = Path(args.get("scratch") or Path(args["a"]).parent) / "cublasxt-c.npy"
                try:
                    write_s = write_npy(out, c)
                finally:
                    out.unlink(missing_ok=True)
            parts = {"read_s": read_s, "gemm_s": gemm_s, "write_s": write_s}
            figures.append(
                _figure(
                    "matmul",
                    "TFLOP/s",
                    work,
                    [read_s + gemm_s + write_s],
                    shape=[m, n, k],
                    config=SAME_WORK,
                    host_memory="pinned",
                    block_dim=8192,
                    pinning=False,
                    parts=parts,
                )
            )
        else:
            fill(a, b)
        figures += [timed(case, a, b, c) for case in pinned]
        del a, b, c
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    order = [c.name for c in CASES] + [SAME_WORK]
    figures.sort(key=lambda f: order.index(f["config"]))
    return {"status": "ok", "library": find_libcublas(), "figures": figures}


def _pinned(shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """A C-ordered host array of ``shape`` in pinned memory (CuPy's pinned pool)."""
    import cupy

    count = shape[0] * shape[1]
    memory = cupy.cuda.alloc_pinned_memory(count * dtype.itemsize)
    # np.frombuffer keeps ``memory`` alive (the array's base): the pages stay pinned as long.
    return np.frombuffer(memory, dtype, count).reshape(shape)


ALTERNATIVES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "dask-array": dask_array,
    "cupy": cupy_one_gpu,
    "cublasxt": cublasxt,
}


def main(argv: list[str]) -> int:
    """Run one alternative; its record goes to the path in ``argv[2]``."""
    name, args, path = argv[0], json.loads(argv[1]), Path(argv[2])
    out = ALTERNATIVES[name](args)
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)
    return 0


if __name__ == "__main__":
    import os

    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # leave the cluster to the harness's kill of the process group
