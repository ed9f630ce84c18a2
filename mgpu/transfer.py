"""Host <-> device copies of large blocks through pinned staging buffers.

A copy from pageable memory (a NumPy array, an ``.npy`` memory map) reaches the GPU at a
sixth of the PCIe rate (8.9 against 55 GB/s on an H200), and one CPU thread copies
pageable memory at about 11 GB/s. So a block moves in chunks through a ring of pinned
buffers: a pool of host threads fills chunk i+1 (any strides: a column block of a
row-major file is fine) while the DMA engine moves chunk i, and a buffer is refilled
only once the DMA that read it has finished (an event on the stream).

Each task thread has its own ring (two tiles on one GPU never share a buffer); the host
threads are shared by the worker. On CPU workers there is nothing to stage: the copies
are plain NumPy.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dask.config
import numpy as np

__all__ = ["Stager", "load", "stager", "store"]

CHUNK_BYTES = 64 << 20  # per DMA: long enough to run at the full PCIe rate
SLOTS = 3  # one being filled, one in flight, one spare
_PARALLEL_BYTES = 4 << 20  # below this a chunk is copied by the task's own thread

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()


def host_threads() -> int:
    """Host copy threads per worker (``mgpu.transfer.host-threads``, default 8).

    Eight reach the PCIe rate from the page cache on the H200 hosts measured
    (benchmarks/host_io.py: 11 GB/s with one thread, 57 with eight).
    """
    return max(1, int(dask.config.get("mgpu.transfer.host-threads", default=8)))


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(host_threads(), thread_name_prefix="mgpu-host-copy")
        return _POOL


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for 2-D arrays of one shape, split by rows over the host threads.

    NumPy releases the GIL while it copies, so the threads run in parallel.
    """
    rows = dst.shape[0]
    parts = min(host_threads(), rows, max(1, dst.nbytes // _PARALLEL_BYTES))
    if parts <= 1:
        np.copyto(dst, src)
        return
    bounds = [(i * rows // parts, (i + 1) * rows // parts) for i in range(parts)]
    list(_pool().map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))


def _rows(a: Any) -> Any:
    """View a 1-D array as one column, so that every copy below is by rows."""
    return a.reshape(-1, 1) if a.ndim == 1 else a


def chunk_rows(shape: tuple[int, int], itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """Row ranges of at most ``chunk_bytes`` each (at least one row) covering ``shape[0]`` rows."""
    rows, cols = shape
    per = max(1, chunk_bytes // max(1, cols * itemsize))
    return [(r, min(rows, r + per)) for r in range(0, rows, per)]


class Stager:
    """One task thread's ring of pinned buffers, and the copies that go through it.

    Parameters
    ----------
    dev
        The worker's :class:`~mgpu.device.Device`; bytes and DMA times are counted on it.
    """

    def __init__(self, dev: Any, chunk_bytes: int = CHUNK_BYTES) -> None:
        import cupy

        self.dev = dev
        self.chunk_bytes = chunk_bytes
        self._memory = [cupy.cuda.alloc_pinned_memory(chunk_bytes) for _ in range(SLOTS)]
        self._buffers = [np.frombuffer(m, np.uint8, chunk_bytes) for m in self._memory]
        self._free: list[Any] = [None] * SLOTS  # event: the last DMA through the slot is done

    def _slot(self, i: int, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
        event = self._free[i % SLOTS]
        if event is not None:
            event.synchronize()
        nbytes = shape[0] * shape[1] * dtype.itemsize
        return self._buffers[i % SLOTS][:nbytes].view(dtype).reshape(shape)

    def load(self, dst: Any, src: np.ndarray, stream: Any = None) -> int:
        """Copy host ``src`` (any strides) into device ``dst`` (C-contiguous, same shape).

        The DMAs go on ``stream`` (the thread's own by default) and are not waited for:
        work enqueued after them on that stream sees the data. Returns the bytes copied.
        """
        stream = stream or self.dev.stream
        dst2, src2 = _rows(dst), _rows(src)
        if not dst.flags.c_contiguous or dst2.shape != src2.shape:
            raise ValueError(f"load: a C-contiguous device array of shape {src.shape} is needed, got {dst.shape}")
        dtype = np.dtype(dst.dtype)
        row_bytes = dst2.shape[1] * dtype.itemsize
        for i, (r0, r1) in enumerate(chunk_rows(dst2.shape, dtype.itemsize, self.chunk_bytes)):
            slot = self._slot(i, (r1 - r0, dst2.shape[1]), dtype)
            host_copy(slot, src2[r0:r1])
            self._free[i % SLOTS] = self._dma("h2d", dst2.data.ptr + r0 * row_bytes, slot.ctypes.data, slot.nbytes,
                                              stream)
        return dst.nbytes

    def _dma(self, kind: str, dst: int, src: int, nbytes: int, stream: Any) -> Any:
        """Enqueue one copy on ``stream``, timed by events and counted; returns the event after it."""
        import cupy

        rt = cupy.cuda.runtime
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record(stream)
        rt.memcpyAsync(dst, src, nbytes, rt.memcpyHostToDevice if kind == "h2d" else rt.memcpyDeviceToHost, stream.ptr)
        end.record(stream)
        self.dev.count_copy(kind, nbytes, begin, end)
        return end

    def store(self, dst: np.ndarray, src: Any, stream: Any = None) -> int:
        """Copy device ``src`` (C-contiguous) into host ``dst`` (any strides, same shape).

        Waits until every byte has landed in ``dst``. The DMA of chunk i+1 runs while the
        host threads copy chunk i out of its buffer. Returns the bytes copied.
        """
        stream = stream or self.dev.stream
        dst2, src2 = _rows(dst), _rows(src)
        if not src.flags.c_contiguous or dst2.shape != src2.shape:
            raise ValueError(f"store: a C-contiguous device array of shape {dst.shape} is needed, got {src.shape}")
        dtype = np.dtype(src.dtype)
        row_bytes = src2.shape[1] * dtype.itemsize
        chunks = chunk_rows(src2.shape, dtype.itemsize, self.chunk_bytes)
        landed: list[tuple[np.ndarray, Any]] = []

        def enqueue(i: int) -> None:
            r0, r1 = chunks[i]
            slot = self._slot(i, (r1 - r0, src2.shape[1]), dtype)
            self._free[i % SLOTS] = end = self._dma("d2h", slot.ctypes.data, src2.data.ptr + r0 * row_bytes,
                                                    slot.nbytes, stream)
            landed.append((slot, end))

        for i in range(min(SLOTS - 1, len(chunks))):
            enqueue(i)
        for i, (r0, r1) in enumerate(chunks):
            slot, end = landed[i]
            end.synchronize()
            if i + SLOTS - 1 < len(chunks):
                enqueue(i + SLOTS - 1)  # its slot's last DMA (chunk i - 1) has been copied out
            host_copy(dst2[r0:r1], slot)
        return src.nbytes


def stager(dev: Any) -> Stager:
    """This task thread's :class:`Stager` (made on first use, kept for the thread's life)."""
    s = getattr(_LOCAL, "stager", None)
    if s is None or s.dev is not dev:
        s = _LOCAL.stager = Stager(dev)
    return s


def load(dev: Any, src: np.ndarray, out: Any = None) -> Any:
    """``src`` (host, any strides) on ``dev``: into ``out`` if given, else a new array."""
    if not dev.is_gpu:
        if out is None:
            return np.ascontiguousarray(src)
        np.copyto(out, src)
        return out
    if out is None:
        with dev.on_stream():
            out = dev.xp.empty(src.shape, src.dtype)
    stager(dev).load(out, src)
    return out


def store(dev: Any, dst: np.ndarray, src: Any) -> None:
    """``dst[...] = src`` from ``dev`` into host ``dst`` (an ``.npy`` memory map, say)."""
    if not dev.is_gpu:
        host_copy(_rows(dst), _rows(np.asarray(src)))
        return
    if not src.flags.c_contiguous:
        with dev.on_stream():
            src = dev.xp.ascontiguousarray(src)
    stager(dev).store(dst, src)
