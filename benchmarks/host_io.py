"""How fast data moves between an ``.npy`` file in the page cache and a GPU, by each route.

    python3 benchmarks/host_io.py SCRATCH_DIR [--gib 4] [--json OUT.json]

Routes measured (GB/s), each on the same file:
- file -> pinned buffer, by mmap + NumPy copy and by ``readinto``, with 1..16 threads,
  over one mapping (its pages mapped by the first pass) and over a fresh mapping each
  time (every 4 KiB page faulted in, as a worker reading a block does); file -> a
  pageable buffer by ``readinto``;
- pinned -> device (the PCIe rate the bound uses) and pageable -> device;
- the file's mmap registered with ``cudaHostRegister`` (read-only) and copied to the
  device directly, with the registration's own cost;
- device -> a new ``.npy``'s writable mmap, registered, and device -> pinned -> mmap, or
  pinned -> the new file by ``pwrite`` (no page faulted, none zeroed), with 1..16 threads;
- a fresh read-only mapping registered with ``cudaHostRegister`` in 64 MiB pieces by 1..8
  threads at once, each piece DMAed and unregistered (no host copy at all);
- pageable -> pageable copies with 8..32 threads: what the host's memory moves at all.
- a fresh mapping registered whole (the driver faults its pages in) and DMAed, all
  columns and a column half (a 2-D DMA), as a worker reads a row or a column panel.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
import numpy as np

_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly
_REGISTER_PORTABLE = 0x01


def _pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """The page-aligned range that holds ``nbytes`` at ``ptr`` (an .npy's data follows its header)."""
    base = ptr & ~4095
    return base, (ptr + nbytes - base + 4095) & ~4095


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _threads_copy(dst: np.ndarray, src: np.ndarray, threads: int) -> None:
    rows = np.array_split(np.arange(src.shape[0]), threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda r: np.copyto(dst[r[0] : r[-1] + 1], src[r[0] : r[-1] + 1]), [r for r in rows if len(r)]))


def _threads_readinto(path: str, offset: int, dst: np.ndarray, threads: int) -> None:
    """Read the file's data into ``dst`` with ``preadv``, one contiguous range a thread."""
    flat = memoryview(dst.reshape(-1).view(np.uint8))
    n = len(flat)
    fd = os.open(path, os.O_RDONLY)
    try:

        def one(lo: int, hi: int) -> None:
            done = 0
            while done < hi - lo:
                done += os.preadv(fd, [flat[lo + done : hi]], offset + lo + done)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: one(i * n // threads, (i + 1) * n // threads), range(threads)))
    finally:
        os.close(fd)


@click.command()
@click.argument("scratch", type=click.Path(file_okay=False, path_type=Path))
@click.option("--gib", default=4.0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(scratch: Path, gib: float, json_path: Path | None) -> None:
    try:
        import cupy
    except ImportError:  # the host routes alone
        cupy = None
    scratch.mkdir(parents=True, exist_ok=True)
    cols = 16384
    rows = int(gib * (1 << 30)) // (4 * cols)
    path = str(scratch / "probe.npy")
    out: dict[str, float | str] = {}
    t = time.perf_counter()
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, cols))
    for r in range(0, rows, 4096):
        mm[r : r + 4096] = np.float32(r)
    mm.flush()
    del mm
    out["write_file_gbps"] = _rate(rows * cols * 4, time.perf_counter() - t)
    src = np.load(path, mmap_mode="r")
    nbytes = src.nbytes
    offset = src.offset if hasattr(src, "offset") else 128
    pinned_mem = cupy.cuda.alloc_pinned_memory(nbytes) if cupy else bytearray(nbytes)
    pinned = np.frombuffer(pinned_mem, np.float32, rows * cols).reshape(rows, cols)
    pageable = np.ones((rows, cols), np.float32)  # its pages mapped already
    for threads in (1, 2, 4, 8, 16):
        fresh = np.load(path, mmap_mode="r")  # a new mapping: each page faults in the copy
        t = time.perf_counter()
        _threads_copy(pinned, fresh, threads)
        out[f"fresh_mmap_to_pinned_{threads}t_gbps"] = _rate(nbytes, time.perf_counter() - t)
        del fresh
        t = time.perf_counter()
        _threads_copy(pinned, src, threads)
        out[f"mmap_to_pinned_{threads}t_gbps"] = _rate(nbytes, time.perf_counter() - t)
        t = time.perf_counter()
        _threads_readinto(path, offset, pinned, threads)
        out[f"readinto_pinned_{threads}t_gbps"] = _rate(nbytes, time.perf_counter() - t)
        t = time.perf_counter()
        _threads_readinto(path, offset, pageable, threads)
        out[f"readinto_pageable_{threads}t_gbps"] = _rate(nbytes, time.perf_counter() - t)
    assert pinned[min(4096, rows - 1), 0] == float(min(4096, rows - 1) // 4096 * 4096)
    assert np.array_equal(pageable, pinned)
    if cupy is not None:
        _device_routes(cupy, scratch, src, pinned, out)
    big = np.empty_like(pageable)
    big[...] = 0  # its pages mapped
    for threads in (8, 16, 32):
        t = time.perf_counter()
        _threads_copy(big, pageable, threads)
        out[f"memcpy_pageable_{threads}t_gbps"] = _rate(nbytes, time.perf_counter() - t)
    del big
    for line in sorted(out.items()):
        print(f"{line[0]:36s} {line[1]:.4g}" if isinstance(line[1], float) else f"{line[0]:36s} {line[1]}")
    if json_path:
        json_path.write_text(json.dumps(out, indent=1))
    for f in scratch.glob("probe*.npy"):
        f.unlink()


def _device_routes(cupy: Any, scratch: Path, src: np.ndarray, pinned: np.ndarray, out: dict[str, Any]) -> None:
    """The DMAs: pinned and pageable H2D, a registered file map, D2H into a new file."""
    rows, cols = src.shape
    nbytes = src.nbytes
    dev = cupy.empty((rows, cols), np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    for name, host in (("pinned", pinned), ("pageable_mmap", src)):
        for _ in range(2):  # the second is the figure
            stream.synchronize()
            t = time.perf_counter()
            if name == "pinned":
                cupy.cuda.runtime.memcpyAsync(
                    dev.data.ptr, host.ctypes.data, nbytes, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr
                )
            else:
                with stream:
                    dev.set(np.asarray(host), stream=stream)
            stream.synchronize()
            out[f"h2d_{name}_gbps"] = _rate(nbytes, time.perf_counter() - t)
    # The file's own pages, registered and copied by DMA with no host copy.
    try:
        ptr = src.ctypes.data
        t = time.perf_counter()
        cupy.cuda.runtime.hostRegister(*_pages(ptr, nbytes), _REGISTER_READ_ONLY | _REGISTER_PORTABLE)
        out["register_ro_s"] = time.perf_counter() - t
        for _ in range(2):
            t = time.perf_counter()
            cupy.cuda.runtime.memcpyAsync(dev.data.ptr, ptr, nbytes, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
            stream.synchronize()
            out["h2d_registered_mmap_gbps"] = _rate(nbytes, time.perf_counter() - t)
        t = time.perf_counter()
        cupy.cuda.runtime.hostUnregister(_pages(ptr, nbytes)[0])
        out["unregister_s"] = time.perf_counter() - t
        assert float(dev[4096, 0]) == 4096.0
    except Exception as e:  # noqa: BLE001 - the probe reports what the platform refuses
        out["register_ro_error"] = repr(e)
    for half in (False, True):
        try:
            _registered_stream(cupy, src.filename, dev, stream, half, out)
        except Exception as e:  # noqa: BLE001
            out[f"registered_fresh{'_colhalf' if half else ''}_error"] = repr(e)
    # Device -> a new file: registered writable mmap, and pinned + host copy.
    dst_path = str(scratch / "probe-out.npy")
    dst = np.lib.format.open_memmap(dst_path, mode="w+", dtype=np.float32, shape=(rows, cols))
    try:
        t = time.perf_counter()
        cupy.cuda.runtime.hostRegister(*_pages(dst.ctypes.data, nbytes), _REGISTER_PORTABLE)
        out["register_rw_s"] = time.perf_counter() - t
        t = time.perf_counter()
        cupy.cuda.runtime.memcpyAsync(
            dst.ctypes.data, dev.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr
        )
        stream.synchronize()
        out["d2h_registered_mmap_gbps"] = _rate(nbytes, time.perf_counter() - t)
        cupy.cuda.runtime.hostUnregister(_pages(dst.ctypes.data, nbytes)[0])
    except Exception as e:  # noqa: BLE001
        out["register_rw_error"] = repr(e)
    t = time.perf_counter()
    cupy.cuda.runtime.memcpyAsync(
        pinned.ctypes.data, dev.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr
    )
    stream.synchronize()
    out["d2h_pinned_gbps"] = _rate(nbytes, time.perf_counter() - t)
    for threads in (1, 4, 8, 16):
        dst2 = np.lib.format.open_memmap(
            str(scratch / f"probe-out{threads}.npy"), mode="w+", dtype=np.float32, shape=(rows, cols)
        )
        t = time.perf_counter()
        _threads_copy(dst2, pinned, threads)
        out[f"pinned_to_new_mmap_{threads}t_gbps"] = _rate(nbytes, time.perf_counter() - t)
        del dst2
        out[f"pinned_to_new_file_pwrite_{threads}t_gbps"] = _rate(
            nbytes, _threads_pwrite(str(scratch / f"probe-pw{threads}.npy"), pinned, threads)
        )
    for threads in (1, 4, 8):
        try:
            out[f"registered_pieces_{threads}t_gbps"] = _registered_pieces(cupy, src.filename, dev, threads)
        except Exception as e:  # noqa: BLE001
            out[f"registered_pieces_{threads}t_error"] = repr(e)


def _threads_pwrite(path: str, src: np.ndarray, threads: int) -> float:
    """Seconds to write ``src`` into a new (sparse) ``.npy`` by ``pwrite``, 16 MiB a call,
    the calls dealt round-robin over ``threads``."""
    dst = np.lib.format.open_memmap(path, mode="w+", dtype=src.dtype, shape=src.shape)
    offset = dst.offset
    del dst
    flat = memoryview(src.reshape(-1).view(np.uint8))
    piece = 16 << 20
    starts = list(range(0, len(flat), piece))
    fd = os.open(path, os.O_WRONLY)
    try:

        def one(i: int) -> None:
            for lo in starts[i::threads]:
                view = flat[lo : lo + piece]
                done = 0
                while done < len(view):
                    done += os.pwritev(fd, [view[done:]], offset + lo + done)

        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(threads)))
        seconds = time.perf_counter() - t
    finally:
        os.close(fd)
    check = np.load(path, mmap_mode="r")
    assert np.array_equal(check[-1], src[-1]) and np.array_equal(check[0], src[0])
    del check
    os.unlink(path)
    return seconds


def _registered_pieces(cupy: Any, path: str, dev: Any, threads: int) -> float:
    """GB/s of a fresh read-only mapping moved to ``dev`` in 64 MiB pieces, each registered,
    DMAed on its thread's stream and unregistered, by ``threads`` threads at once."""
    rt = cupy.cuda.runtime
    fresh = np.load(path, mmap_mode="r")
    base, size = _pages(fresh.ctypes.data, fresh.nbytes)
    piece = 64 << 20
    starts = list(range(0, size, piece))
    device = rt.getDevice()
    dst = dev.data.ptr

    def one(i: int) -> None:
        with cupy.cuda.Device(device):
            stream = cupy.cuda.Stream(non_blocking=True)
            for lo in starts[i::threads]:
                n = min(piece, size - lo)
                rt.hostRegister(base + lo, n, _REGISTER_READ_ONLY | _REGISTER_PORTABLE)
                count = max(0, min(n, dev.nbytes - lo))  # the mapping's pages may pass the array's end
                if count:
                    rt.memcpyAsync(dst + lo, base + lo, count, rt.memcpyHostToDevice, stream.ptr)
                    stream.synchronize()
                rt.hostUnregister(base + lo)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    seconds = time.perf_counter() - t
    del fresh
    return _rate(size, seconds)


def _registered_stream(cupy: Any, path: str, dev: Any, stream: Any, col_half: bool, out: dict[str, Any]) -> None:
    """A fresh mapping registered whole (read-only; every page faulted in by the driver), then DMAed."""
    rt = cupy.cuda.runtime
    fresh = np.load(path, mmap_mode="r")
    rows, cols = fresh.shape
    width = cols // 2 if col_half else cols
    name = "registered_fresh" + ("_colhalf" if col_half else "")
    stream.synchronize()
    t = time.perf_counter()
    base, size = _pages(fresh.ctypes.data, fresh.nbytes)
    rt.hostRegister(base, size, _REGISTER_READ_ONLY | _REGISTER_PORTABLE)
    t_reg = time.perf_counter()
    rt.memcpy2DAsync(
        dev.data.ptr, width * 4, fresh.ctypes.data, cols * 4, width * 4, rows, rt.memcpyHostToDevice, stream.ptr
    )
    stream.synchronize()
    t_dma = time.perf_counter()
    rt.hostUnregister(base)
    t_end = time.perf_counter()
    out[f"{name}_register_gbps"] = _rate(fresh.nbytes, t_reg - t)
    out[f"{name}_dma_gbps"] = _rate(rows * width * 4, t_dma - t_reg)
    out[f"{name}_unregister_s"] = t_end - t_dma
    out[f"{name}_total_gbps"] = _rate(rows * width * 4, t_dma - t)
    assert float(dev.reshape(-1)[min(4096, rows - 1) * width]) == float(min(4096, rows - 1) // 4096 * 4096)


if __name__ == "__main__":
    main()
