"""Each device's ceilings, measured once and cached: what a result's throughput is set against.

A ceiling is what one device does alone with the plainest fast code. The device's own are
measured here: a device-to-device copy (bytes read + written) and, on GPUs, pinned
host<->device copies and copies to each peer GPU it sees. Every workload measures the
rates that bound it (see :meth:`mgpu.workloads.base.Workload.measure_ceilings`); this
module asks them through the registry and names none. They are measured on the workers,
keyed by device model and software versions, and cached in ``~/.cache/mgpu/ceilings.json``
(``mgpu.cache-dir`` in Dask's config moves it), so only the first run on a machine pays
the few seconds.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import platform
import statistics
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import config
from .gpus import can_access_peer, cuda_count, driver_version
from .worker import kernels
from .worker.device import Device
from .worker.tasks import with_device

if TYPE_CHECKING:
    from .worker.device import DeviceFacts
    from .workloads.base import Workload

__all__ = [
    "DEVICE_CEILINGS",
    "all_groups",
    "cache_key",
    "cache_keys",
    "ceiling_units",
    "ceilings_at_once",
    "ceilings_for",
    "groups_missing",
    "job_groups",
    "keep_busy",
    "measure_ceilings",
    "median_seconds",
    "read_cache",
    "shared_key",
    "software",
    "sustained_seconds",
    "write_cache",
]

# The device's own ceilings (name -> unit); a workload may name one as its bound.
DEVICE_CEILINGS = {
    "copy": "GB/s",
    "h2d_pinned": "GB/s",
    "d2h_pinned": "GB/s",
    "peer": "GB/s",
    # A tile's work besides its main kernel: making random operands (mgpu's generator) and
    # the checks' float64 matrix-vector products; on CPUs most of a small product tile's time.
    "random": "Gelem/s",
    "check": "Gelem/s",
}
# The side of the square blocks the generator and the check are timed on, per backend.
_SIDE = {"cuda": 8192, "cpu": 1024}
# The group of ceilings measured here (the others are named by their workload).
_DEVICE = "device"
# Bytes copied per sample of a device copy: well past launch overheads and caches, per backend.
_COPY_BYTES = {"cuda": 1 << 30, "cpu": 32 << 20}
# Bytes per sample of a host<->device or peer copy: at 256 MiB a PCIe or NVLink copy runs at
# its full rate (a few ms); pinning 1 GiB of host memory for it took a first job 0.3 s more.
_TRANSFER_BYTES = 256 << 20


def median_seconds(dev: Device, fn: Callable[[], Any], *, first: bool = True) -> float:
    """The median device time of ``fn()`` on ``dev`` over ``mgpu.ceilings.samples`` calls,
    after one untimed call (``first``; leave it out where ``fn`` has run already).

    For a workload's :meth:`~mgpu.workloads.base.Workload.measure_ceilings`: ``fn`` enqueues
    device work on the current stream (its first call compiles, plans and allocates).
    """
    if first:
        fn()
    samples = []
    for _ in range(config.load().ceilings.samples):
        with dev.timer() as t:
            fn()
        samples.append(t.seconds)
    return statistics.median(samples)


def sustained_seconds(dev: Device, fn: Callable[[], Any]) -> float:
    """The mean device time of ``fn()`` on ``dev`` over calls run back to back for as long
    again as the ``mgpu.ceilings.sustain`` seconds of them before: on a GPU, the rate its
    clocks keep over a long job, not its first milliseconds'. CPUs need no such window
    (:func:`median_seconds`).

    A GEMM draws the GPU up to its power limit within about a second, and from there the
    clocks swing: on one H100, TF32 16384³ products ran at 392.7 TFLOP/s after 0.3 s, then
    between 328 and 390 in quarter seconds, 368.5 on average over 3.4 s; float64 62.7 after
    0.3 s and 59.6 on average. The mean over a whole window is what a long job's products
    can keep, where the median of a few calls reads a crest or a trough of the swing.
    """
    sustain = config.load().ceilings.sustain if dev.is_gpu else 0.0
    if sustain <= 0:
        return median_seconds(dev, fn)
    calls = keep_busy(dev, fn, sustain)
    with dev.timer() as t:  # as many calls again, enqueued at once: the device never waits
        for _ in range(calls):
            fn()
    return t.seconds / calls


def keep_busy(dev: Device, fn: Callable[[], Any], seconds: float) -> int:
    """Run ``fn`` back to back until the device has spent ``seconds`` on it; returns the
    calls that took them.

    A first call goes untimed: it may load its kernels and plan. Sized by a process's
    first 16384³ TF32 GEMM (about 0.09 s of device time on an H100, where the next took
    0.025), the GPU ran 0.31-0.36 s before the window, not 1, and the ceiling read 372-375
    TFLOP/s, before the power limit; sized by a second call, 355.6-356.9 (fresh processes
    on one H100, two of each). One call is timed to size the rest, which go in one batch
    enqueued at once (the device never waits); another follows only if it came short.
    """
    fn()
    busy, calls = 0.0, 0
    while busy < seconds:
        batch = 1 if not calls else math.ceil((seconds - busy) / max(busy / calls, 1e-6))
        with dev.timer() as t:
            for _ in range(batch):
                fn()
        busy, calls = busy + t.seconds, calls + batch
    return calls


def ceiling_units(workload: type[Workload] | None = None) -> dict[str, str]:
    """Every ceiling's unit by name: the device's own and those of ``workload``, or of every
    registered workload (each imported: 30 ms and more, spent in each job's planning when
    its own were enough)."""
    from .workloads import get_workload_class, workload_names

    units = dict(DEVICE_CEILINGS)
    for cls in [workload] if workload is not None else [get_workload_class(n) for n in workload_names()]:
        units.update(cls.ceiling_units)
    return units


def measure_ceilings(groups: Sequence[str], dev: Device) -> dict[str, float]:
    """Measure ``dev`` alone (a worker's, in a task: :func:`mgpu.worker.tasks.with_device`).

    ``groups``: ``"device"`` (the copy and transfer rates), workload names (each
    measures its own) and ``"WORKLOAD:CEILING"`` (one of a workload's, see :func:`job_groups`).
    """
    out: dict[str, float] = {}
    with dev.on_stream():
        for group in groups:
            if group == _DEVICE:
                out.update(_device_ceilings(dev))
            else:
                cls, only = _group(group)
                if only is not None and "only" in inspect.signature(cls.measure_ceilings).parameters:
                    out.update(cls.measure_ceilings(dev, only=only))
                else:  # a plug-in's that measures all of its ceilings at once
                    out.update(cls.measure_ceilings(dev))
    if dev.is_gpu:
        dev.xp.get_default_memory_pool().free_all_blocks()
    return out


def _device_ceilings(dev: Device) -> dict[str, float]:
    xp = dev.xp
    nbytes = _COPY_BYTES[dev.backend]
    src = xp.ones(nbytes // 4, dtype=xp.float32)
    dst = xp.empty_like(src)
    out = {"copy": 2 * src.nbytes / median_seconds(dev, lambda: dst.__setitem__(slice(None), src)) / 1e9}
    src = dst = None  # freed before the transfers allocate theirs
    n = _SIDE[dev.backend]

    def made(operand: int = 1) -> Any:
        return kernels.random_block(
            xp, seed=0, operand=operand, rows=(0, n), cols=(0, n), total_cols=n, dtype="float32"
        )

    out["random"] = n * n / median_seconds(dev, made) / 1e9
    mat, vec = made(0), xp.ones(n, dtype=xp.float64)
    out["check"] = n * n / median_seconds(dev, lambda: kernels.matvec_f64(xp, mat, vec)) / 1e9
    mat = vec = None
    if dev.is_gpu:
        out.update(_transfer_rates(dev, _TRANSFER_BYTES))
    return out


def _transfer_rates(dev: Device, nbytes: int) -> dict[str, float]:
    """GB/s of pinned host->device and device->host copies, and of copies to each peer.

    ``peer`` is the slowest of this GPU's peers (what a tile move can count on); the
    worker sees every GPU of its node, its own as device 0. Absent with no peer access.
    """
    import cupy
    import cupyx

    from .worker.panels import enable_peer_access

    out: dict[str, float] = {}
    stream = dev.stream
    src = cupy.empty(nbytes, dtype=cupy.uint8)
    host = cupyx.empty_pinned(nbytes, dtype=np.uint8)
    out["h2d_pinned"] = nbytes / median_seconds(dev, lambda: src.set(host, stream=stream)) / 1e9
    out["d2h_pinned"] = nbytes / median_seconds(dev, lambda: src.get(stream=stream, out=host)) / 1e9
    host = None
    rates = []
    for peer in range(1, cuda_count()):
        if not can_access_peer(0, peer):
            continue
        enable_peer_access(peer)
        with cupy.cuda.Device(peer):
            dst = cupy.empty(nbytes, dtype=cupy.uint8)
        copy = lambda dst=dst, peer=peer: cupy.cuda.runtime.memcpyPeerAsync(  # noqa: E731
            dst.data.ptr, peer, src.data.ptr, 0, nbytes, stream.ptr
        )
        rates.append(nbytes / median_seconds(dev, copy) / 1e9)
        del dst, copy
    if rates:
        out["peer"] = min(rates)
    return out


def _cache_path() -> Path:
    return config.load().ceilings_folder() / "ceilings.json"


# Bump when measure_ceilings measures something new, so older cached entries are redone.
_MEASURES = 8


def cache_key(facts: DeviceFacts, versions: dict[str, str]) -> str:
    """The cache's key of a device's ceilings: its model and memory, the GPU driver, and
    the software (``versions``, :func:`software` where the device is). Every key is made
    here (see :func:`cache_keys`), by the workers' runs and the client's estimate alike."""
    name = facts.name if facts.backend == "cuda" else f"{platform.processor() or platform.machine()}"
    if facts.backend != "cuda":  # a CPU's rates do not depend on the GPU driver beside it
        versions = {k: v for k, v in versions.items() if k != "driver"}
    return "|".join(
        [f"v{_MEASURES}", facts.backend, name, f"{facts.memory >> 30}GiB"]
        + [f"{k}={v}" for k, v in sorted(versions.items())]
    )


def cache_keys(
    devices: dict[str, DeviceFacts], software: dict[str, dict[str, str]], *, at_once: bool = False
) -> dict[str, str]:
    """The cache's key of each device's ceilings (address -> key), from its facts and its
    ``software`` (address -> :func:`software`). With ``at_once``, the CPU workers of a
    host that has several are keyed as measured all at once (:func:`shared_key`)."""
    keys = {addr: cache_key(f, software.get(addr, {})) for addr, f in devices.items()}
    if at_once:
        for addrs in cpu_hosts(devices).values():
            keys.update(dict.fromkeys(addrs, shared_key(keys[addrs[0]], len(addrs))))
    return keys


@functools.cache
def _driver() -> str | None:
    """The GPU driver's version, or None without NVML or a GPU (asked once a process)."""
    return driver_version()


def software(*, driver: bool = True) -> dict[str, str]:
    """The versions of the software a ceiling depends on, in this process, and the GPU
    driver's where there is one (``driver``: look for it; a CPU-only caller need not)."""
    from .info import _versions

    v = _versions(load=False)  # the same in a client (which imports no GPU library) as on a worker
    out: dict[str, str] = {k: v[k] for k in ("numpy", "cupy-cuda13x", "cupy-cuda12x", "mgpu") if k in v}
    found = _driver() if driver and ("cupy-cuda13x" in out or "cupy-cuda12x" in out) else None
    if found:
        out["driver"] = found
    return out


def _group(group: str) -> tuple[Any, set[str] | None]:
    """A workload's group of ceilings: its class, and the one ceiling asked for or None (all)."""
    from .workloads import get_workload_class

    name, _, ceiling = group.partition(":")
    return get_workload_class(name), ({ceiling} if ceiling else None)


def job_groups(workload: Any) -> list[str]:
    """The group of ceilings a job of ``workload`` (an instance) reads of its workload's
    own: its bound alone (``"matmul:gemm_float32"``), or the whole group where its bound
    is one of the device's. The device's own are added by :func:`all_groups`."""
    bound = workload.ceiling()
    return [f"{workload.name}:{bound}" if bound in type(workload).ceiling_units else workload.name]


def groups_missing(rates: dict[str, float], groups: Sequence[str]) -> list[str]:
    """The groups none of whose ceilings ``rates`` holds (a workload may measure none of
    its ceilings on a backend: it is asked again, at no cost); a workload that declares
    none (it is bound by one of the device's) is never asked."""
    missing = []
    for group in groups:
        if group == _DEVICE:
            names = {"copy"}
        else:
            cls, only = _group(group)
            names = set(cls.ceiling_units) if only is None else only & set(cls.ceiling_units)
        if names and not names & set(rates):
            missing.append(group)
    return missing


def ceilings_for(
    client: Any,
    devices: dict[str, DeviceFacts],
    workloads: Sequence[str] | None = None,
    *,
    refresh: bool = False,
    software: dict[str, dict[str, str]] | None = None,
) -> dict[str, dict[str, float]]:
    """Ceilings for each worker (address -> {name: rate}), from the cache or measured now.

    ``workloads`` names the workloads whose ceilings are wanted besides the device's own
    (all registered ones by default). One worker per distinct device model measures what
    its model's cache entry lacks; its figures stand for its peers. ``software`` is each
    worker's (address -> :func:`software`), asked for here where not given.
    """

    groups = all_groups(workloads)
    cache = read_cache()
    keys = cache_keys(devices, software if software is not None else client.run(_software))
    missing: dict[str, tuple[str, list[str]]] = {}  # addr -> (key, groups to measure)
    for addr, key in keys.items():
        todo = groups if refresh else groups_missing(cache.get(key, {}), groups)
        if todo and key not in (k for k, _ in missing.values()):
            missing[addr] = (key, list(todo))
    if missing:
        futures = {
            key: client.submit(
                with_device,
                measure_ceilings,
                todo,
                key=f"roofline-calibrate-{i}",
                workers=[addr],
                allow_other_workers=False,
                pure=False,
            )
            for i, (addr, (key, todo)) in enumerate(missing.items())
        }
        for key, fut in futures.items():
            cache[key] = {**({} if refresh else cache.get(key, {})), **fut.result()}
        write_cache(cache)
    return {addr: cache[key] for addr, key in keys.items()}


def _software() -> dict[str, str]:
    return software()  # on a worker, by Client.run


def shared_key(key: str, workers: int) -> str:
    """The cache's key of the ceilings of one of ``workers`` CPU workers of a host, measured
    while all of them measure at once (a device's own ``key`` holds them measured alone)."""
    return f"{key}|{workers} at once"


def cpu_hosts(devices: dict[str, DeviceFacts]) -> dict[str, list[str]]:
    """The addresses of the CPU workers of each host that has more than one."""
    hosts: dict[str, list[str]] = {}
    for addr, f in devices.items():
        if f.backend == "cpu":
            hosts.setdefault(f.host, []).append(addr)
    return {host: addrs for host, addrs in hosts.items() if len(addrs) > 1}


def combine_at_once(measured: Sequence[dict[str, float]]) -> dict[str, float]:
    """One figure per ceiling from the workers that measured at once: the slowest's (the
    job's static tiles wait for it)."""
    names = set.intersection(*(set(m) for m in measured)) if measured else set()
    return {name: min(m[name] for m in measured) for name in sorted(names)}


def ceilings_at_once(
    client: Any,
    devices: dict[str, DeviceFacts],
    alone: dict[str, dict[str, float]],
    workloads: Sequence[str] | None = None,
    *,
    software: dict[str, dict[str, str]] | None = None,
) -> dict[str, dict[str, float]]:
    """The ceilings a job's tiles run at when every worker works (address -> {name: rate}),
    for its estimate: ``alone`` (from :func:`ceilings_for`) for GPUs, which share nothing
    a ceiling measures; for CPU workers of one host, which share its cores, caches and
    memory, the rates measured on all of them at once (cached as :func:`shared_key`)."""
    hosts = cpu_hosts(devices)
    if not hosts:
        return alone
    groups = all_groups(workloads)
    cache = read_cache()
    keys = cache_keys(devices, software if software is not None else client.run(_software), at_once=True)
    out = dict(alone)
    for addrs in hosts.values():
        key = keys[addrs[0]]
        todo = groups_missing(cache.get(key, {}), groups)
        if todo:
            run = uuid.uuid4().hex[:8]  # a key of its own: another client's measure may be under way
            futures = [
                client.submit(
                    with_device,
                    measure_ceilings,
                    todo,
                    key=f"roofline-at-once-{run}-{i}",
                    workers=[addr],
                    allow_other_workers=False,
                    pure=False,
                )
                for i, addr in enumerate(addrs)
            ]
            cache[key] = {**cache.get(key, {}), **combine_at_once(client.gather(futures))}
            write_cache(cache)
        out.update({addr: cache[key] for addr in addrs})
    return out


def all_groups(workloads: Sequence[str] | None = None) -> list[str]:
    """The groups of ceilings measured together: the device's own (where one of the
    workloads reads them), then each workload's (``workloads``, or every registered one;
    an entry may be ``"WORKLOAD:CEILING"``, see :func:`job_groups`)."""
    from .workloads import get_workload_class, workload_names

    names = workload_names() if workloads is None else list(workloads)
    device = workloads is None or any(get_workload_class(w.partition(":")[0]).uses_device_ceilings for w in names)
    return [_DEVICE, *names] if device else names


def read_cache() -> dict[str, dict[str, float]]:
    """Every cached device's ceilings (key -> {name: rate}); empty without a cache."""
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def write_cache(cache: dict[str, dict[str, float]]) -> None:
    """Replace the cache with ``cache`` at once (a reader never sees half of it)."""
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home still gets its figures for this run
