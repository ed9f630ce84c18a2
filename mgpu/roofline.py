"""Each device's ceilings, measured once and cached: what a result's throughput is set against.

A ceiling is what one device does alone with the plainest fast code: cuBLAS (or BLAS)
GEMM per dtype, a device-to-device copy (bytes read + written), mgpu's own Mandelbrot
kernel and, on GPUs, pinned host<->device copies and copies to each peer GPU it sees. They are measured on the workers, keyed by device model and software
versions, and cached in ``~/.cache/mgpu/ceilings.json`` (``mgpu.cache-dir`` in Dask's
config moves it), so only the first run on a machine pays the few seconds.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dask.config
import numpy as np

from . import kernels
from .device import Device, current

if TYPE_CHECKING:
    from .device import DeviceFacts

__all__ = ["ceilings_for", "measure_ceilings"]

# Sizes that keep each device busy well past launch overheads, per backend.
_SIZES = {
    "cuda": {"gemm": 8192, "copy_bytes": 1 << 30, "mandel": 8192, "max_iter": 1000, "repeat": 5},
    "cpu": {"gemm": 384, "copy_bytes": 32 << 20, "mandel": 128, "max_iter": 200, "repeat": 3},
}


def _median(dev: Device, fn: Any, repeat: int) -> float:
    fn()  # warm-up: compiles, plans, allocates
    samples = []
    for _ in range(repeat):
        with dev.timer() as t:
            fn()
        samples.append(t.seconds)
    return statistics.median(samples)


def measure_ceilings() -> dict[str, float]:
    """Measure this worker's device alone (runs as a task on the worker)."""
    from .workloads.matmul import _tf32

    dev = current()
    xp = dev.xp
    size = _SIZES[dev.backend]
    out: dict[str, float] = {}
    n = size["gemm"]
    with dev.on_stream():
        for key, dtype, tf32 in (
            ("gemm_float16", "float16", False),
            ("gemm_float32", "float32", False),
            ("gemm_tf32", "float32", True),
            ("gemm_float64", "float64", False),
        ):
            if dtype == "float16" and not dev.is_gpu:
                continue  # NumPy has no float16 BLAS; nothing to set a job against
            a = kernels.random_block(xp, seed=0, operand=0, rows=(0, n), cols=(0, n), total_cols=n, dtype=dtype)
            b = kernels.random_block(xp, seed=0, operand=1, rows=(0, n), cols=(0, n), total_cols=n, dtype=dtype)
            with _tf32(dev, tf32):
                seconds = _median(dev, lambda: xp.matmul(a, b), size["repeat"])
            out[key] = 2 * n**3 / seconds / 1e12  # TFLOP/s
            del a, b
        src = xp.ones(size["copy_bytes"] // 4, dtype=xp.float32)
        dst = xp.empty_like(src)
        out["copy"] = 2 * src.nbytes / _median(dev, lambda: dst.__setitem__(slice(None), src), size["repeat"]) / 1e9
        del src, dst
        side = size["mandel"]
        for dtype in ("float32", "float64"):
            x, y = kernels.mandelbrot_axes(
                width=side, height=side, bounds=(-2.5, 1.0, -1.25, 1.25), rows=(0, side), dtype=dtype
            )
            xd, yd = dev.to_device(x), dev.to_device(y)
            iterations = float(kernels.mandelbrot_counts(xp, xd, yd, size["max_iter"]).sum(dtype=np.int64))
            seconds = _median(dev, lambda: kernels.mandelbrot_counts(xp, xd, yd, size["max_iter"]), size["repeat"])
            out[f"mandelbrot_{dtype}"] = iterations / seconds / 1e9  # Giter/s
        if dev.is_gpu:
            out.update(_transfer_rates(dev, size["copy_bytes"], size["repeat"]))
    if dev.is_gpu:
        xp.get_default_memory_pool().free_all_blocks()
    return out


def _transfer_rates(dev: Device, nbytes: int, repeat: int) -> dict[str, float]:
    """GB/s of pinned host->device and device->host copies, and of copies to each peer.

    ``peer`` is the slowest of this GPU's peers (what a tile move can count on); the
    worker sees every GPU of its node, its own as device 0. Absent with no peer access.
    """
    import cupy
    import cupyx

    from .panels import enable_peer_access

    out: dict[str, float] = {}
    stream = dev.stream
    src = cupy.empty(nbytes, dtype=cupy.uint8)
    host = cupyx.empty_pinned(nbytes, dtype=np.uint8)
    out["h2d_pinned"] = nbytes / _median(dev, lambda: src.set(host, stream=stream), repeat) / 1e9
    out["d2h_pinned"] = nbytes / _median(dev, lambda: src.get(stream=stream, out=host), repeat) / 1e9
    del host
    rates = []
    for peer in range(1, cupy.cuda.runtime.getDeviceCount()):
        if not cupy.cuda.runtime.deviceCanAccessPeer(0, peer):
            continue
        enable_peer_access(peer)
        with cupy.cuda.Device(peer):
            dst = cupy.empty(nbytes, dtype=cupy.uint8)
        copy = lambda: cupy.cuda.runtime.memcpyPeerAsync(  # noqa: E731
            dst.data.ptr, peer, src.data.ptr, 0, nbytes, stream.ptr
        )
        rates.append(nbytes / _median(dev, copy, repeat) / 1e9)
        del dst
    if rates:
        out["peer"] = min(rates)
    return out


def _cache_path() -> Path:
    folder = dask.config.get("mgpu.cache-dir", default=None) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mgpu"
    )
    return Path(folder) / "ceilings.json"


# Bump when measure_ceilings measures something new, so older cached entries are redone.
_MEASURES = 2


def _cache_key(facts: DeviceFacts, versions: dict[str, str]) -> str:
    name = facts.name if facts.backend == "cuda" else f"{platform.processor() or platform.machine()}"
    return "|".join(
        [f"v{_MEASURES}", facts.backend, name, f"{facts.memory >> 30}GiB"]
        + [f"{k}={v}" for k, v in sorted(versions.items())]
    )


def _software() -> dict[str, str]:
    from .info import _versions

    v = _versions()
    return {k: v[k] for k in ("numpy", "cupy", "cupy-cuda13x", "cupy-cuda12x", "mgpu") if k in v}


def ceilings_for(client: Any, devices: dict[str, DeviceFacts], *, refresh: bool = False) -> dict[str, dict[str, float]]:
    """Ceilings for each worker (address -> {name: rate}), from the cache or measured now.

    One worker per distinct device model measures; its figures stand for its peers.
    """
    path = _cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    versions = client.run(_software)
    keys = {addr: _cache_key(f, versions.get(addr, {})) for addr, f in devices.items()}
    missing = {}
    for addr, key in keys.items():
        if (refresh or key not in cache) and key not in missing.values():
            missing[addr] = key
    if missing:
        futures = {
            key: client.submit(
                measure_ceilings, key=f"roofline-calibrate-{i}", workers=[addr], allow_other_workers=False, pure=False
            )
            for i, (addr, key) in enumerate(missing.items())
        }
        for key, fut in futures.items():
            cache[key] = fut.result()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home still gets its figures for this run
    return {addr: cache[key] for addr, key in keys.items()}
