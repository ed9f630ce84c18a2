"""How fast the host moves two ``.npy`` vectors (a dot job's x and y) to every GPU at once,
by each route mgpu's staging has, with no Dask: the host's own ceiling for the dot from files.

    python3 benchmarks/gpus_from_files.py X.npy Y.npy [--budget 16GiB] [--chunks 16,64] [--threads 16]
        [--methods kvikio,mmap] [--json OUT.json]

One process per GPU, all started together at a barrier for every variant; each moves its
tiles of x and y as mgpu's dot job plans them under ``--budget`` (each tile's x, then its
y). The figure is the bytes of every process over the slowest one's wall time.

Routes (``--methods``), each by chunk size (MiB) and host threads per process:

- ``kvikio``: mgpu's own route for whole ranges (:func:`mgpu.io.read`, KvikIO's pool,
  ``mgpu.io.threads`` and ``mgpu.io.task-size``); ``mmap``: :class:`mgpu.transfer.Stager`,
  each host thread copying a chunk from a fresh map into its pinned buffer and DMAing it;
- ``register``, ``register-populate``, ``register-split``: no host copy: each tile's
  span of a fresh map page-locked in place (read-only) and DMAed (:func:`_registered`);
- ``hybrid``: both at once, the front of each span staged and the back locked in place
  (:func:`_locked_pieces`);
- ``hmm``: a GPU kernel reading the map in place, where the driver allows it.

Ceilings, measured first, as many bytes each: ``dma-only`` (pinned -> device, no file),
``memcpy`` (the host's own copy, memory to memory) and ``copy-pread`` (file -> pinned, no
DMA). On 2 x H200: DMA 110 GB/s, memcpy 58-61, the read alone 44-45, pread
44-49, mmap 37-41, register 17-25, hybrid 27-36; ``hmm`` is not allowed there.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import multiprocessing as mp
import os
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

import click
import numpy as np

METHODS = ("kvikio", "mmap")
OTHER_ROUTES = ("register", "register-populate", "register-split", "hybrid", "hmm")
CEILINGS = ("dma-only", "memcpy", "copy-pread")
_LIBC = ctypes.CDLL(None, use_errno=True)  # madvise(MADV_POPULATE_READ = 22), Linux 5.14+
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def dot_spans(x: str, y: str, gpus: int, budget: int) -> list[list[tuple[int, int]]]:
    """Each GPU's tiles of x · y, in order, as mgpu's dot job plans them under ``budget``."""
    from mgpu.device import DeviceFacts
    from mgpu.workloads.dot import Dot, DotParams

    job = Dot(DotParams(input={"x": x, "y": y}))
    facts = {f"gpu{g}": DeviceFacts("cuda", g, "gpu", budget, budget, "h") for g in range(gpus)}
    tiles = job.plan(facts, budget, {}).tiles
    return [[t.bounds["n"] for t in tiles if t.worker == f"gpu{g}"] for g in range(gpus)]


def _worker(
    gpu: int, spans: list[tuple[int, int]], paths: list[str], plan: list[dict[str, Any]], barrier: Any, results: Any
) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    import cupy
    import dask.config

    from mgpu import transfer
    from mgpu.device import Device, DeviceFacts

    dev = Device(
        "cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True)
    )
    info = np.load(paths[0], mmap_mode="r")
    n, dtype, offset = info.shape[0], info.dtype, info.offset
    del info
    dst = cupy.empty(max(b - a for a, b in spans), dtype)
    # The ceilings' buffers, made before any timing: pinned for the DMA alone, two plain
    # (pages already in) for the host's own copy.
    pinned = np.frombuffer(cupy.cuda.alloc_pinned_memory(1 << 30), np.uint8, 1 << 30)
    plain = [np.ones(1 << 30, np.uint8) for _ in range(2)]
    for v in plan:
        if dev.staging.threads != v["threads"]:
            dev.staging.close()  # its threads and their pinned buffers go
            dev.staging = transfer.HostStaging(v["threads"])  # the next at this variant's size
        with dask.config.set({"mgpu.transfer.host-threads": v["threads"]}):
            dev.staging.ready_buffers(_staged_chunk(v))
            barrier.wait()
            t = time.perf_counter()
            moved, phases = _run(v, paths, spans, dst, dev, (offset, n, dtype), pinned, plain)
            dev.stream.synchronize()
            wall = time.perf_counter() - t
        results.put({**v, "gpu": gpu, "bytes": moved, "wall_s": wall, "phases": phases})
        barrier.wait()


def _run(
    v: dict[str, Any],
    paths: list[str],
    spans: list[tuple[int, int]],
    dst: Any,
    dev: Any,
    layout: tuple[int, int, np.dtype],
    pinned: np.ndarray,
    plain: list[np.ndarray],
) -> tuple[int, dict[str, float]]:
    """One variant over every tile; returns the bytes moved and, for the registered route,
    the seconds of each of its steps."""
    from mgpu import io, transfer

    offset, n, dtype = layout
    total = sum(b - a for a, b in spans) * dtype.itemsize * len(paths)
    chunk, threads = v["chunk"] << 20, v["threads"]
    if v["method"] == "dma-only":  # pinned -> device, nothing read on the host
        moved, out = 0, dst.view(np.uint8)
        while moved < total:
            size = min(pinned.nbytes, total - moved, out.nbytes)
            out[:size].set(pinned[:size], stream=dev.stream)
            moved += size
        return moved, {}
    if v["method"] == "memcpy":  # the host's own copy, memory to memory, no file and no DMA
        moved = 0
        while moved < total:
            _threaded(threads, chunk, plain[0].nbytes, lambda a, b: np.copyto(plain[1][a:b], plain[0][a:b]))
            moved += plain[0].nbytes
        return moved, {}
    moved, phases = 0, {}
    stager = transfer.Stager(dev, chunk_bytes=_staged_chunk(v))
    for a, b in spans:
        for path in paths:
            if v["method"] == "copy-pread":  # file -> each thread's pinned buffer, no DMA
                fd = os.open(path, os.O_RDONLY)

                def one(lo: int, hi: int, a: int = a, fd: int = fd, path: str = path) -> None:
                    buf = dev.staging.buffers(chunk).take((hi - lo, 1), dtype)[1]
                    out, start = memoryview(buf.reshape(-1).view(np.uint8)), offset + (a + lo) * dtype.itemsize
                    done = 0
                    while done < len(out):
                        got = os.preadv(fd, [out[done:]], start + done)
                        if got == 0:
                            raise EOFError(f"{path} ends at byte {start + done}")
                        done += got

                # On mgpu's pool, whose threads made their pinned buffers before the clock started.
                _threaded(threads, chunk // dtype.itemsize, b - a, one, dev.staging.pool)
                os.close(fd)
                moved += (b - a) * dtype.itemsize
            elif v["method"] == "hmm":
                phases["pageable_access"] = float(_gpu_reads_pageable(dev))
                if phases["pageable_access"]:
                    _gpu_reads_map(path, (a, b), dst[: b - a], dev)
                    moved += (b - a) * dtype.itemsize
            elif v["method"] == "hybrid":
                # The span's front staged by the pool, its back locked in place by one more thread.
                cut = a + int((b - a) * v["split"])
                with ThreadPoolExecutor(1) as locker:
                    back = locker.submit(_locked_pieces, path, (cut, b), dst[cut - a : b - a], v["chunk"] << 20)
                    if cut > a:
                        stager.load(dst[: cut - a], np.load(path, mmap_mode="r")[a:cut])
                    for step, sec in back.result().items():
                        phases[step] = phases.get(step, 0.0) + sec
                moved += (b - a) * dtype.itemsize
            elif v["method"].startswith("register"):
                for step, sec in _registered(path, (a, b), dst, dev, v).items():
                    phases[step] = phases.get(step, 0.0) + sec
                moved += (b - a) * dtype.itemsize
            elif v["method"] == "kvikio":
                io.read(path, offset + a * dtype.itemsize, dst[: b - a])
                moved += (b - a) * dtype.itemsize
            else:
                moved += stager.load(dst[: b - a], np.load(path, mmap_mode="r")[a:b])
    return moved, phases


def _gpu_reads_pageable(dev: Any) -> bool:
    """Whether the GPU may read pageable host memory in place (HMM or ATS)."""
    import cupy

    rt = cupy.cuda.runtime
    return bool(rt.deviceGetAttribute(rt.cudaDevAttrPageableMemoryAccess, rt.getDevice()))


def _gpu_reads_map(path: str, span: tuple[int, int], dst: Any, dev: Any) -> None:
    """A copy kernel on the GPU reading a fresh map of the file in place (no host copy, no
    lock: the driver maps the pages to the GPU as it touches them)."""
    import cupy

    view = np.load(path, mmap_mode="r")[span[0] : span[1]]
    memory = cupy.cuda.UnownedMemory(view.ctypes.data, view.nbytes, view)
    src = cupy.ndarray(view.shape, view.dtype, cupy.cuda.MemoryPointer(memory, 0))
    with dev.on_stream():
        dst[...] = src
    dev.stream.synchronize()


def _locked_pieces(path: str, span: tuple[int, int], dst: Any, piece: int) -> dict[str, float]:
    """The span of the file to ``dst`` in pieces, each page-locked in place, DMAed on a
    stream of its own and unlocked once its DMA has run, the next piece locked meanwhile."""
    import cupy

    rt = cupy.cuda.runtime
    view = np.load(path, mmap_mode="r")[span[0] : span[1]]
    begin, end = view.ctypes.data, view.ctypes.data + view.nbytes
    lo = begin - begin % mmap.PAGESIZE
    piece -= piece % mmap.PAGESIZE
    stream = cupy.cuda.Stream(non_blocking=True)
    held: list[tuple[int, Any]] = []
    locking = 0.0
    for start in range(lo, end, piece):
        size = min(piece, end - start)
        size += -size % mmap.PAGESIZE
        t = time.perf_counter()
        rt.hostRegister(start, size, 0x08)  # cudaHostRegisterReadOnly
        locking += time.perf_counter() - t
        a, b = max(begin, start), min(end, start + piece)
        rt.memcpyAsync(dst.data.ptr + a - begin, a, b - a, rt.memcpyHostToDevice, stream.ptr)
        done = cupy.cuda.Event()
        done.record(stream)
        held.append((start, done))
        if len(held) > 1:  # the piece before: unlocked once its DMA is done
            prev, event = held.pop(0)
            event.synchronize()
            rt.hostUnregister(prev)
    for start, event in held:
        event.synchronize()
        rt.hostUnregister(start)
    return {"locked_bytes": float(view.nbytes), "lock_s": locking}


def _registered(path: str, span: tuple[int, int], dst: Any, dev: Any, v: dict[str, Any]) -> dict[str, float]:
    """The copy-free route: a fresh map of the span page-locked in place (read-only), one DMA
    from it, unlocked. ``register-populate`` first maps the span's pages by ``madvise`` on
    the host threads, so the driver only pins them; ``register-split`` then locks it in
    pieces of a chunk, by the host threads at once (a DMA per piece). The
    seconds of each step."""
    import cupy

    rt = cupy.cuda.runtime
    view = np.load(path, mmap_mode="r")[span[0] : span[1]]
    lo = view.ctypes.data - view.ctypes.data % mmap.PAGESIZE
    hi = view.ctypes.data + view.nbytes
    hi += -hi % mmap.PAGESIZE
    marks = [time.perf_counter()]
    if v["method"] != "register":
        _threaded(v["threads"], v["chunk"] << 20, hi - lo, lambda a, b: _LIBC.madvise(lo + a, b - a, 22))
    marks.append(time.perf_counter())
    # register-split: the span locked in pieces of a chunk each, by the host threads at once.
    piece = v["chunk"] << 20 if v["method"] == "register-split" else hi - lo
    starts = range(lo, hi, piece)
    device = rt.getDevice()

    def lock(start: int, *_: Any) -> None:
        with cupy.cuda.Device(device):
            rt.hostRegister(start, min(piece, hi - start), 0x08)  # cudaHostRegisterReadOnly

    def unlock(start: int, *_: Any) -> None:
        with cupy.cuda.Device(device):
            rt.hostUnregister(start)

    with ThreadPoolExecutor(v["threads"]) as pool:
        list(pool.map(lock, starts))
        marks.append(time.perf_counter())
        begin, end = view.ctypes.data, view.ctypes.data + view.nbytes
        for start in starts:  # a DMA per piece: one copy may not cross two registrations
            a, b = max(begin, start), min(end, start + piece)
            rt.memcpyAsync(dst.data.ptr + a - begin, a, b - a, rt.memcpyHostToDevice, dev.stream.ptr)
        dev.stream.synchronize()
        marks.append(time.perf_counter())
        list(pool.map(unlock, starts))
    marks.append(time.perf_counter())
    return {
        k: b - a
        for k, (a, b) in zip(("populate_s", "register_s", "dma_s", "unregister_s"), pairwise(marks), strict=True)
    }


def _staged_chunk(v: dict[str, Any]) -> int:
    """The staging chunk of a variant: for the hybrid route the chunk size is its locked pieces'."""
    return 16 << 20 if v["method"] == "hybrid" else v["chunk"] << 20


def _threaded(threads: int, step: int, total: int, fn: Any, pool: ThreadPoolExecutor | None = None) -> None:
    """``fn(lo, hi)`` for every range of ``step`` (bytes or elements) over ``range(total)``,
    on ``pool`` or a new one of ``threads`` threads."""
    if pool is not None:
        list(pool.map(lambda lo: fn(lo, min(total, lo + step)), range(0, total, step)))
        return
    with ThreadPoolExecutor(threads) as own:
        _threaded(threads, step, total, fn, own)


@click.command()
@click.argument("x", type=click.Path(exists=True, dir_okay=False))
@click.argument("y", type=click.Path(exists=True, dir_okay=False))
@click.option("--gpus", type=int, help="processes, one per GPU  [default: every GPU]")
@click.option("--budget", default="16GiB", show_default=True, help="the dot job's per-device budget, for its tiles")
@click.option("--threads", help="host threads per process to try  [default: mgpu's, mgpu.transfer.host-threads]")
@click.option("--chunks", default="16,64", show_default=True, help="chunk sizes (MiB) to try")
@click.option(
    "--methods",
    default=",".join(METHODS),
    show_default=True,
    help=f"routes to try, of {', '.join(METHODS + OTHER_ROUTES)}",
)
@click.option(
    "--splits",
    default="0.5",
    show_default=True,
    help="for the hybrid route: the share of each span staged (the rest is locked in place)",
)
@click.option("--repeat", default=2, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(
    x: str,
    y: str,
    gpus: int | None,
    budget: str,
    threads: str | None,
    chunks: str,
    methods: str,
    splits: str,
    repeat: int,
    json_path: Path | None,
) -> None:
    unknown = sorted(set(methods.split(",")) - set(METHODS + OTHER_ROUTES))
    if unknown:
        raise click.BadParameter(
            f"unknown route(s) {unknown}; allowed: {', '.join(METHODS + OTHER_ROUTES)}", param_hint="--methods"
        )
    try:
        import cupy

        found = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy or no driver: nothing to measure
        found = 0
    if not found:
        click.echo("skipped: no GPU")
        if json_path:
            json_path.write_text(json.dumps({"status": "skipped: no GPU", "runs": []}))
        return
    from dask.utils import parse_bytes

    from mgpu.transfer import host_threads

    gpus = gpus or found
    spans = dot_spans(x, y, gpus, parse_bytes(budget))
    threads = threads or str(host_threads())
    ts, cs = [int(t) for t in threads.split(",")], [int(c) for c in chunks.split(",")]
    plan = [{"method": m, "chunk": 16, "threads": t} for m in CEILINGS for t in ts]
    plan += [
        {"method": m, "chunk": c, "threads": t, "split": float(f)}
        for _ in range(repeat)
        for t in ts
        for c in cs
        for m in methods.split(",")
        for f in (splits.split(",") if m == "hybrid" else ["1"])
    ]
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(gpus), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(g, spans[g], [x, y], plan, barrier, results)) for g in range(gpus)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=600) for _ in range(gpus * len(plan))]
    for p in procs:
        p.join()
    out = []
    # Every process puts its row of a variant before the barrier that ends it: rows come a variant at a time.
    for run in (sorted(rows[i : i + gpus], key=lambda r: r["gpu"]) for i in range(0, len(rows), gpus)):
        gbps = sum(r["bytes"] for r in run) / max(r["wall_s"] for r in run) / 1e9
        out.append(
            {
                "method": run[0]["method"],
                "chunk_mib": run[0]["chunk"],
                "threads": run[0]["threads"],
                "split": run[0].get("split"),
                "gbps": gbps,
                "per_gpu_gbps": [r["bytes"] / r["wall_s"] / 1e9 for r in run],
                "phases": [r["phases"] for r in run],
            }
        )
        click.echo(
            f"{out[-1]['method']:11s} {out[-1]['chunk_mib']:3d} MiB {out[-1]['threads']:2d} threads "
            f"split {out[-1]['split'] or 0:.2f} "
            f"{gbps:6.1f} GB/s  per process "
            + " ".join(f"{g:5.1f}" for g in out[-1]["per_gpu_gbps"])
            + "".join(f"  {k} {v:.3f}" for k, v in run[0]["phases"].items())
        )
    if json_path:
        json_path.write_text(
            json.dumps({"status": "measured", "budget": budget, "spans": spans, "gpus": gpus, "runs": out}, indent=1)
        )


if __name__ == "__main__":
    main()
