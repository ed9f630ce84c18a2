"""Where a Mandelbrot band's thread waits before its kernel is queued: one GPU, no Dask.

    python3 benchmarks/band_probe.py JOB.yaml [--allocator pool|async|cupy] [--threads 8]
                                     [--check run_tile|waiting-fetch] [--json OUT.json]

Runs the job's bands through ``Mandelbrot.run_tile`` on a pool of threads, as a GPU
worker's task threads do, with each step of a band timed: its axes copied to the device,
the wait for the device's in-order queue, the kernel's launch, and the marks run_tile
sets (queued, counted, sampled). A watcher thread sleeps 0.5 ms at a time and notes how
late it wakes: a thread that holds the GIL while it waits for the GPU shows as wakes
late by as long as that wait. ``--check waiting-fetch`` runs the band as it was up to
session 6, its sum and sample fetched by copies that wait for the GPU themselves; the
default runs today's run_tile, which waits for the stream once and then copies.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
import numpy as np

from mgpu import device as _device
from mgpu import plugins
from mgpu.spec import load_job
from mgpu.workloads import get_workload_class
from mgpu.workloads import mandelbrot as mb

_STEPS: dict[int, dict[str, float]] = {}
_LOCAL = threading.local()


def _mark(name: str) -> None:
    band = getattr(_LOCAL, "band", None)
    if band is not None:
        _STEPS.setdefault(band, {})[name] = time.perf_counter()


def _set_allocator(kind: str) -> None:
    import cupy

    if kind == "cupy":
        return
    import rmm
    from rmm.allocators.cupy import rmm_cupy_allocator

    if kind == "pool":
        free, _ = cupy.cuda.runtime.memGetInfo()
        rmm.reinitialize(pool_allocator=True, initial_pool_size=int(free * 0.5) // 256 * 256)
    else:
        rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource())
    cupy.cuda.set_allocator(rmm_cupy_allocator)


def _instrument(dev: Any) -> None:
    """Time the steps of run_tile that may wait: to_device, the in-order lock, the launch."""
    to_device, in_order, counts = dev.to_device, dev.in_order, mb.mandelbrot_counts

    def timed_to_device(host: Any) -> Any:
        out = to_device(host)
        _mark("to_device" if "to_device" not in _STEPS.get(_LOCAL.band, {}) else "to_device2")
        return out

    @contextlib.contextmanager
    def timed_in_order() -> Any:
        _mark("lock_wanted")
        with in_order() as queue:
            _mark("lock_held")
            yield queue
        _mark("lock_freed")

    def timed_counts(*args: Any, **kwargs: Any) -> Any:
        out = counts(*args, **kwargs)
        _mark("launched")
        return out

    dev.to_device, dev.in_order = timed_to_device, timed_in_order
    mb.mandelbrot_counts = timed_counts


def _waiting_fetch_run_tile(self: mb.Mandelbrot, dev: Any, tile: Any, panels: Any = None) -> Any:
    """run_tile as it was up to session 6: the sum and the sample fetched by copies that
    wait for the GPU themselves (``float()`` of a device scalar, ``ndarray.get``)."""
    p = self.params
    start = time.time()
    r0, r1 = tile.bounds["rows"]
    x, y = mb.mandelbrot_axes(
        width=p.width, height=p.height, bounds=(p.xmin, p.xmax, p.ymin, p.ymax), rows=(r0, r1), dtype=p.dtype
    )
    record = self.new_record(dev, tile, start, busy_s=0.0, work=0.0)
    with dev.on_stream():
        xd, yd = dev.to_device(x), dev.to_device(y)
        with dev.in_order() as queue, dev.timer(queue) as t:
            counts = mb.mandelbrot_counts(dev.xp, xd, yd, p.max_iter)
        record.marks["queued"] = time.time()
        record.work = float(counts.sum(dtype=np.int64))
        record.marks["counted"] = time.time()
        if self.verify:
            rows, cols = mb._sample(tile, p.width)
            record.extra["sample"] = counts[[r - r0 for r in rows]][:, cols].get(stream=dev.stream)
        dev.synchronize()
    record.busy_s, record.stop = t.seconds, time.time()
    return record


@click.command()
@click.argument("job_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--allocator", type=click.Choice(["pool", "async", "cupy"]), default="pool", show_default=True)
@click.option("--threads", default=8, show_default=True)
@click.option("--check", type=click.Choice(["run_tile", "waiting-fetch"]), default="run_tile", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(job_path: str, allocator: str, threads: int, check: str, json_path: Path | None) -> None:
    import cupy

    _set_allocator(allocator)
    dev = plugins._cuda_device()
    _device.install(dev)
    job = load_job(job_path)
    workload = get_workload_class(job.workload)(job.params, verify=job.verify)
    workload.prepare(force=True)
    plan = workload.plan({"probe": dev.facts}, int(dev.facts.free * 0.5), {})
    if check == "waiting-fetch":
        workload.run_tile = _waiting_fetch_run_tile.__get__(workload)
    workload.warmup(dev)
    _instrument(dev)

    lags: list[tuple[float, float]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.0005)
            late = time.perf_counter() - t - 0.0005
            if late > 0.002:
                lags.append((t, late))

    def run(tile: Any) -> Any:
        _LOCAL.band = tile.index
        _mark("start")
        record = workload.run_tile(dev, tile)
        _mark("stop")
        return record

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        records = list(pool.map(run, plan.tiles))
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    workload.judge(records, workload.reference(plan))
    busy = sum(r.busy_s for r in records)
    giter = sum(r.work for r in records) / 1e9
    print(
        f"{allocator} allocator, {threads} threads, check {check}: {len(records)} bands in {wall:.3f} s, "
        f"kernels {busy:.3f} s ({busy / wall:.1%} of the wall), {giter / wall:.0f} Giter/s, "
        f"checks {'passed' if all(r.verify_ok for r in records) else 'FAILED'}"
    )
    order = ["start", "to_device", "to_device2", "lock_wanted", "lock_held", "launched", "lock_freed", "stop"]
    gaps: dict[str, list[float]] = {}
    for steps in _STEPS.values():
        seen = [s for s in order if s in steps]
        for a, b in zip(seen, seen[1:]):
            gaps.setdefault(f"{a}->{b}", []).append(steps[b] - steps[a])
    for name, values in gaps.items():
        print(f"  {name:28s} median {np.median(values) * 1e3:7.2f} ms  max {max(values) * 1e3:7.2f} ms")
    total_lag = sum(late for _, late in lags)
    print(
        f"  GIL watcher: {len(lags)} wakes late by > 2 ms, {total_lag * 1e3:.1f} ms in all, "
        f"longest {max((late for _, late in lags), default=0) * 1e3:.1f} ms"
    )
    print(f"  {'band':>4s} " + " ".join(f"{s:>11s}" for s in order) + "  (ms from the first start)")
    first = min(s["start"] for s in _STEPS.values())
    for band, steps in sorted(_STEPS.items(), key=lambda kv: kv[1]["start"]):
        print(
            f"  {band:4d} "
            + " ".join(f"{(steps[s] - first) * 1e3:11.1f}" if s in steps else f"{'':11s}" for s in order)
        )
    if json_path:
        json_path.write_text(
            json.dumps(
                {
                    "allocator": allocator,
                    "threads": threads,
                    "check": check,
                    "wall_s": wall,
                    "busy_s": busy,
                    "giter_per_s": giter / wall,
                    "steps": {str(k): v for k, v in _STEPS.items()},
                    "marks": {str(r.index): {**r.marks, "start": r.start, "stop": r.stop} for r in records},
                    "lags": lags,
                    "cupy": cupy.__version__,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
