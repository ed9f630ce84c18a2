"""Host <-> device copies of large blocks through pinned staging buffers.

A copy from pageable memory (a NumPy array, an ``.npy`` memory map) reaches the GPU at a
sixth of the PCIe rate (8.9 against 55 GB/s on an H200), and one CPU thread copies
pageable memory at 7-11 GB/s. So a block moves in chunks, each
chunk by one of the worker's host threads on its own: it copies the chunk (any strides:
a column block of a row-major file is fine) into one of its two pinned buffers and
enqueues the DMA on the task's stream, and moves on to its next chunk while that DMA
runs; a buffer is refilled only once the DMA that read it has finished (an event). No
thread waits for another between chunks: with a barrier per chunk (every thread copying
a slice of one chunk, then all waiting for the DMA) a worker moved 12 GB/s, where the
same threads copying on their own move 35-55.

Whole rows of an ``.npy`` file go to a GPU through KvikIO instead (:mod:`mgpu.worker.io`);
what comes here from a file is a column block, copied from a memory map of it (36 GB/s
into an H200, where KvikIO reading it row by row moved 1.9), and the outputs: whole rows
handed to the kernel from the pinned buffers (:meth:`Stager.write`, ``pwrite``, by the
store threads, :func:`writer_threads`), other blocks copied into an ``.npy``'s memory map.

Work enqueued on the task's stream after :meth:`Stager.load` returns sees the data. On
CPU workers there is nothing to stage: the copies are plain NumPy.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from .. import config

__all__ = ["HostStaging", "Stager", "chunk_size", "load", "load_pieces", "pwrite_all", "store", "writer_threads"]

BUFFERS = 2  # per host thread: one being filled while the other's DMA runs
_PARALLEL_BYTES = 4 << 20  # below this a chunk is copied by the task's own thread


def host_threads() -> int:
    """Host copy threads per worker (``mgpu.transfer.host-threads``; ``auto``, the default:
    half the cores this process may use, at least 2, at most 16).

    On the H200 hosts measured (a fresh map of a file in the page cache into pinned
    memory), one thread moves 7-9 GB/s, 8 move 35-46 and 16 move 45-55, with two
    processes (two workers) copying at once.
    """
    n = config.load().transfer.host_threads
    return min(16, max(2, len(os.sched_getaffinity(0)) // 2)) if n == "auto" else n


def writer_threads() -> int:
    """Threads per worker that write outputs (``mgpu.io.writers``; ``auto``, the default:
    :func:`host_threads` with ``mgpu.io.write: mmap``, 2 with ``pwrite``).

    Copies into a memory map of the file take threads (each maps its chunk's pages first,
    :func:`map_for_writing`, where they faulted each 4 KiB page in): on a 2-core host
    (``benchmarks/page_cache_write.py``, 16 MiB chunks into /dev/shm, pages faulted) one
    thread wrote 1.9-2.4 GB/s, two 2.6-4.6; an H200 host's worker wrote 4.3-5.7 GB/s with
    4-16. A file system takes one ``pwrite`` to a file at a time (tmpfs, ext4 and XFS lock
    the file for it), so a second writer only overlaps its chunk's DMA with the first's
    write: on the 2-core host one thread wrote 6.1-6.7 GB/s, two 6.8-7.4, four 2.1-4.5;
    on the H200 host, into a new file, 1.9-2.0 whatever the threads.
    """
    settings = config.load().io
    if settings.writers != "auto":
        return settings.writers
    return 2 if settings.write == "pwrite" else host_threads()


def chunk_size() -> int:
    """Bytes per staged chunk, one DMA (``mgpu.transfer.chunk-bytes``, by default 16 MiB:
    long enough to run at the full PCIe rate, ~0.3 ms).

    Reading a dot's files on two H200 workers, 16, 32 and 64 MiB moved the same
    (42-45 GB/s in all); 4 MiB lost a quarter and 1 MiB four fifths (a chunk's own cost).
    """
    return config.load().transfer.chunk_bytes


def host_copy(dst: np.ndarray, src: np.ndarray, staging: HostStaging) -> None:
    """``dst[...] = src`` for 2-D arrays of one shape, split by rows over ``staging``'s host threads.

    NumPy releases the GIL while it copies, so the threads run in parallel.
    """
    rows = dst.shape[0]
    parts = min(staging.threads, rows, max(1, dst.nbytes // _PARALLEL_BYTES))
    if parts <= 1:
        np.copyto(dst, src)
        return
    bounds = [(i * rows // parts, (i + 1) * rows // parts) for i in range(parts)]
    list(staging.pool.map(lambda b: np.copyto(dst[b[0] : b[1]], src[b[0] : b[1]]), bounds))


def _rows(a: Any) -> Any:
    """View a 1-D array as one column, so that every copy below is by rows."""
    return a.reshape(-1, 1) if a.ndim == 1 else a


def chunk_rows(shape: tuple[int, int], itemsize: int, chunk_bytes: int = 16 << 20) -> list[tuple[int, int]]:
    """Row ranges of at most ``chunk_bytes`` each (at least one row) covering ``shape[0]`` rows."""
    rows, cols = shape
    per = max(1, chunk_bytes // max(1, cols * itemsize))
    return [(r, min(rows, r + per)) for r in range(0, rows, per)]


class _Buffers:
    """A host thread's pinned buffers (made on its first chunk, kept for its life)."""

    def __init__(self, nbytes: int) -> None:
        import cupy

        self.nbytes = nbytes
        self._memory = [cupy.cuda.alloc_pinned_memory(nbytes) for _ in range(BUFFERS)]
        self._arrays = [np.frombuffer(m, np.uint8, nbytes) for m in self._memory]
        self._free: list[Any] = [None] * BUFFERS  # event: the last DMA through the buffer is done
        self._next = 0

    def take(self, shape: tuple[int, int], dtype: np.dtype) -> tuple[int, np.ndarray]:
        """The next buffer, once its last DMA has run, viewed as ``shape``."""
        i, self._next = self._next, (self._next + 1) % BUFFERS
        if self._free[i] is not None:
            self._free[i].synchronize()
        nbytes = shape[0] * shape[1] * dtype.itemsize
        return i, self._arrays[i][:nbytes].view(dtype).reshape(shape)

    def release(self, i: int, event: Any) -> None:
        self._free[i] = event

    def drain(self) -> None:
        """Wait for every DMA still reading the buffers (before they are let go)."""
        for event in self._free:
            if event is not None:
                event.synchronize()


class HostStaging:
    """One device's host copy threads and each thread's pinned buffers.

    Made with its :class:`~mgpu.worker.device.Device` (the worker runtime holds both); the threads
    start, and each thread's buffers are allocated, on first use. Stores have threads of
    their own (:attr:`store_pool`): a load queued behind a long store (an output band
    written while the next band's blocks are read) would otherwise wait for all of it.
    :meth:`close` waits for the threads and lets the buffers go.

    Parameters
    ----------
    threads
        Host copy threads of each direction; by default :func:`host_threads`, read when
        they first start.
    """

    def __init__(self, threads: int | None = None) -> None:
        self._threads = threads
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._made: list[_Buffers] = []  # every thread's, so close() can drain them

    @property
    def threads(self) -> int:
        if self._threads is None:
            self._threads = host_threads()
        return self._threads

    def threads_for(self, kind: str) -> int:
        """Threads of one direction: the host copy threads, and for ``"d2h"`` (stores)
        :func:`writer_threads` unless the staging was made with a count."""
        if kind == "release":
            return 1
        if kind == "d2h" and self._threads is None:
            return writer_threads()
        return self.threads

    def pool_for(self, kind: str) -> ThreadPoolExecutor:
        """The host threads of copies of one direction, ``"h2d"`` or ``"d2h"``, of
        ``"decode"`` (a compressed store's chunks, :mod:`mgpu.worker.decoded`), or the one
        of ``"release"`` (:meth:`let_go`), started on first use."""
        with self._lock:
            if kind not in self._pools:
                name = {"d2h": "mgpu-host-store", "decode": "mgpu-decode", "release": "mgpu-release"}.get(
                    kind, "mgpu-host-copy"
                )
                self._pools[kind] = ThreadPoolExecutor(self.threads_for(kind), thread_name_prefix=name)
            return self._pools[kind]

    def let_go(self, held: list[Any]) -> None:
        """Let go of the objects in ``held`` on a host thread of their own, which empties
        the list; the caller must hold no other reference to them (whichever goes last
        pays). Letting go of a map of a file whose pages were all touched, or of a large
        host array, takes the kernel time in proportion to its pages: on the H100 host the
        map of A's rows (4 GiB) that a 32768³ streamed matmul task reads through took 84 ms
        to let go as the task returned (5% of its 1.65 s), a Zarr store's kept chunk maps
        184 ms. Here they go while the worker reports the task and starts the next, a
        large map's pages a piece at a time (:func:`drop_pages`)."""
        self.pool_for("release").submit(_let_go, held)

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The load threads (and those of plain host copies)."""
        return self.pool_for("h2d")

    @property
    def store_pool(self) -> ThreadPoolExecutor:
        return self.pool_for("d2h")

    def buffers(self, nbytes: int) -> _Buffers:
        """The calling host thread's buffers, of at least ``nbytes`` each."""
        old = getattr(self._local, "buffers", None)
        if old is not None and old.nbytes >= nbytes:
            return old
        if old is not None:
            old.drain()
        new = self._local.buffers = _Buffers(nbytes)
        with self._lock:
            self._made = [b for b in self._made if b is not old] + [new]
        return new

    def ready_buffers(self, nbytes: int | None = None, timeout: float = 10.0, kind: str = "h2d") -> None:
        """Make every host thread's pinned buffers (of ``nbytes`` each, by default
        :func:`chunk_size`) now, ahead of a job; ``kind`` "d2h" for the store threads'.

        One task per pool thread, each held at a barrier until all have made theirs, so that
        no thread takes two tasks and none is left without. A barrier not met in ``timeout``
        seconds (a thread busy with another task) leaves the rest to their first chunk.
        """
        n = self.threads_for(kind)
        nbytes = nbytes or chunk_size()
        barrier = threading.Barrier(n, timeout=timeout)

        def one() -> None:
            self.buffers(nbytes)
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass

        pool = self.pool_for(kind)
        for f in [pool.submit(one) for _ in range(n)]:
            f.result()

    @property
    def buffer_count(self) -> int:
        """How many threads' buffers are held."""
        with self._lock:
            return len(self._made)

    def close(self) -> None:
        """Stop the threads, wait for every DMA still reading a buffer, and let the buffers go."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
            made, self._made = self._made, []
        for pool in pools:
            pool.shutdown(wait=True)
        self._local = threading.local()
        if not made:
            return
        while made:
            made.pop().drain()
        import cupy

        # The buffers went back to CuPy's pinned pool; give its free blocks back to the OS.
        cupy.get_default_pinned_memory_pool().free_all_blocks()


class Stager:
    """Staged copies between host arrays and one device, for the calling task thread.

    Parameters
    ----------
    dev
        The worker's :class:`~mgpu.worker.device.Device`; bytes and DMA times are counted on it
        (for the calling thread, as its tile's copies).
    chunk_bytes
        Bytes per chunk (one DMA; by default :func:`chunk_size`); every host thread keeps
        two pinned buffers of it.
    """

    def __init__(self, dev: Any, chunk_bytes: int | None = None) -> None:
        self.dev = dev
        self.chunk_bytes = chunk_bytes or chunk_size()

    def load(self, dst: Any, src: np.ndarray, stream: Any = None) -> int:
        """Copy host ``src`` (any strides: a block of a memory map) into device ``dst``
        (C-contiguous, same shape).

        The DMAs go on ``stream`` (the thread's own by default) and are not waited for:
        work enqueued after them on that stream sees the data. Returns the bytes copied.
        """

        def move(buf: np.ndarray, rows: np.ndarray, ptr: int, stream: Any) -> tuple[Any, Any]:
            np.copyto(buf, rows)
            return _dma("h2d", ptr, buf.ctypes.data, buf.nbytes, stream)

        return self._each_chunk("h2d", src, dst, stream, move)

    def load_pieces(self, pieces: Sequence[tuple[Any, np.ndarray]], stream: Any = None) -> int:
        """Copy each host ``src`` (any strides) into its device ``dst`` (same shape, each
        row contiguous, rows any distance apart: a block of a wider array), every chunk
        of every piece on the host threads at once (no wait between pieces).

        A ``dst`` whose rows are not one range goes by 2-D DMAs (``cudaMemcpy2DAsync``,
        the rows of a chunk set at their pitch). The DMAs go on ``stream`` (the thread's
        own by default) and are not waited for, as :meth:`load`'s. Returns the bytes copied.
        """
        import cupy

        stream = stream or self.dev.stream
        jobs: list[tuple[Any, np.ndarray, tuple[int, int], int, int]] = []
        widest = 0
        for dst, src in pieces:
            dev2, host2 = _rows(dst), _rows(src)
            itemsize = np.dtype(dst.dtype).itemsize
            if dev2.shape != host2.shape or (dev2.shape[1] > 1 and dev2.strides[1] != itemsize):
                raise ValueError(
                    f"load: a device array of shape {src.shape} with contiguous rows is needed, "
                    f"got shape {dst.shape}, strides {dst.strides}"
                )
            row_bytes = dev2.shape[1] * itemsize
            pitch = dev2.strides[0] if dev2.shape[0] > 1 else row_bytes
            widest = max(widest, row_bytes)
            jobs += [
                (dev2, host2, rows, row_bytes, pitch) for rows in chunk_rows(dev2.shape, itemsize, self.chunk_bytes)
            ]
        nbytes = max(self.chunk_bytes, widest)  # a row longer than a chunk gets its own
        device = cupy.cuda.runtime.getDevice()

        def one(job: tuple[Any, np.ndarray, tuple[int, int], int, int]) -> tuple[int, Any, Any]:
            dev2, host2, (r0, r1), row_bytes, pitch = job
            buffers = self.dev.staging.buffers(nbytes)
            i, buf = buffers.take((r1 - r0, dev2.shape[1]), np.dtype(dev2.dtype))
            np.copyto(buf, host2[r0:r1])
            with cupy.cuda.Device(device):
                begin, end = _dma_rows(dev2.data.ptr + r0 * pitch, pitch, buf, row_bytes, stream)
            buffers.release(i, end)
            return buf.nbytes, begin, end

        pool = self.dev.staging.pool_for("h2d")
        chunks = [pool.submit(one, job) for job in jobs]
        wait(chunks)  # every chunk ends before an error is raised (none may still use the arrays)
        for chunk in chunks:
            self.dev.count_copy("h2d", *chunk.result())
        return sum(dst.nbytes for dst, _ in pieces)

    def store(self, dst: np.ndarray, src: Any, stream: Any = None) -> int:
        """Copy device ``src`` (C-contiguous) into host ``dst`` (any strides, same shape).

        Waits until every byte has landed in ``dst``. Each host thread enqueues its
        chunk's DMA, waits for it and copies the chunk out while the others' DMAs run.
        Returns the bytes copied.
        """

        def move(buf: np.ndarray, rows: np.ndarray, ptr: int, stream: Any) -> tuple[Any, Any]:
            begin, end = _dma("d2h", buf.ctypes.data, ptr, buf.nbytes, stream)
            map_for_writing(rows)  # while the DMA runs
            end.synchronize()
            np.copyto(rows, buf)
            return begin, end

        return self._each_chunk("d2h", dst, src, stream, move)

    def write(self, fd: int, offset: int, src: Any, stream: Any = None) -> int:
        """Write device ``src`` (C-contiguous) into the open file ``fd`` from byte ``offset``.

        Each host thread copies its chunk into one of its pinned buffers (a DMA) and hands
        the buffer to the kernel (``os.pwrite``): no page of the file is mapped into the
        worker, where a copy into a memory map faults each 4 KiB page in. Waits until every
        byte is written. Returns the bytes written.

        Raises
        ------
        OSError
            If the file system takes fewer bytes than given (it filled, say).
        """
        import cupy

        stream = stream or self.dev.stream
        if not src.flags.c_contiguous:
            raise ValueError(f"write: a C-contiguous device array is needed, got one of shape {src.shape}")
        total, ptr = src.nbytes, src.data.ptr
        device = cupy.cuda.runtime.getDevice()

        def one(lo: int) -> tuple[int, Any, Any]:
            nbytes = min(self.chunk_bytes, total - lo)
            buffers = self.dev.staging.buffers(self.chunk_bytes)
            i, buf = buffers.take((1, nbytes), np.dtype(np.uint8))
            with cupy.cuda.Device(device):
                begin, end = _dma("d2h", buf.ctypes.data, ptr + lo, nbytes, stream)
            end.synchronize()
            pwrite_all(fd, buf.reshape(-1), offset + lo)
            buffers.release(i, None)
            return nbytes, begin, end

        pool = self.dev.staging.pool_for("d2h")
        chunks = [pool.submit(one, lo) for lo in range(0, total, self.chunk_bytes)]
        wait(chunks)  # every chunk ends before an error is raised (none may still use fd)
        for chunk in chunks:
            self.dev.count_copy("d2h", *chunk.result())
        return total

    def _each_chunk(
        self,
        kind: str,
        host: Any,
        on_device: Any,
        stream: Any,
        move: Callable[[np.ndarray, Any, int, Any], tuple[Any, Any]],
    ) -> int:
        """Run ``move(pinned buffer, host rows, device address, stream)`` for every chunk on
        the host threads, each with one of its own buffers, and count the DMAs it times."""
        import cupy

        stream = stream or self.dev.stream
        dev2, host2 = _rows(on_device), _rows(host)
        if not on_device.flags.c_contiguous or dev2.shape != host2.shape:
            what = "load" if kind == "h2d" else "store"
            raise ValueError(
                f"{what}: a C-contiguous device array of shape {host.shape} is needed, got {on_device.shape}"
            )
        dtype = np.dtype(on_device.dtype)
        row_bytes = dev2.shape[1] * dtype.itemsize
        nbytes = max(self.chunk_bytes, row_bytes)  # a row longer than a chunk gets its own
        device = cupy.cuda.runtime.getDevice()

        def one(rows: tuple[int, int]) -> tuple[int, Any, Any]:
            r0, r1 = rows
            buffers = self.dev.staging.buffers(nbytes)
            i, buf = buffers.take((r1 - r0, dev2.shape[1]), dtype)
            with cupy.cuda.Device(device):
                begin, end = move(buf, host2[r0:r1], dev2.data.ptr + r0 * row_bytes, stream)
            # A loaded buffer is free once its DMA has run; a stored one is copied out already.
            buffers.release(i, end if kind == "h2d" else None)
            return buf.nbytes, begin, end

        pool = self.dev.staging.pool_for(kind)
        chunks = [pool.submit(one, rows) for rows in chunk_rows(dev2.shape, dtype.itemsize, self.chunk_bytes)]
        # Every chunk ends before any error is raised: none may still use the caller's file
        # descriptor or arrays once they are let go.
        wait(chunks)
        for chunk in chunks:
            self.dev.count_copy(kind, *chunk.result())
        return on_device.nbytes


# Pages of a map dropped at once: the kernel holds the process's map lock for each piece.
DROP_PIECE = 64 << 20
# madvise(2)'s advice that maps a range's pages in, writable, in one call (Linux 5.14).
MADV_POPULATE_WRITE = 23


def map_for_writing(block: Any) -> None:
    """Map the pages of a file's shared memory map that ``block`` (a view of an
    ``np.memmap`` opened for writing) spans, writable, in one call (``MADV_POPULATE_WRITE``),
    rather than one page fault per 4 KiB page as a copy reaches each.

    On a 2-core host, copying a 16 MiB band of C into a new map of a /dev/shm file took
    5.4-7.4 ms; mapped first, 0.8-1.0 ms to map and 1.2-2.6 to copy (80 MiB: 31 ms against
    4 + 12-13). A block whose bytes are not most of the range it spans (a column block of
    a wider map) is left to fault page by page, as are other arrays and a kernel without
    the advice.
    """
    m = getattr(block, "_mmap", None)
    if m is None or getattr(block, "mode", "r") not in ("r+", "w+") or block.size == 0:
        return
    if any(s < 0 for s in block.strides):
        return
    lo = block.ctypes.data
    hi = lo + sum((n - 1) * s for n, s in zip(block.shape, block.strides, strict=True)) + block.itemsize
    if hi - lo > 2 * block.nbytes:
        return
    start = lo // mmap.PAGESIZE * mmap.PAGESIZE
    _madvise(start, hi - start, MADV_POPULATE_WRITE)


def _madvise(start: int, length: int, advice: int) -> int:
    """``madvise(2)`` through ctypes, which lets go of the GIL (``mmap.madvise`` holds it)."""
    return int(_libc_madvise()(start, length, advice))


@functools.cache
def _libc_madvise() -> Any:
    """libc's ``madvise``, looked up once: each chunk a writer stores calls it."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def drop_pages(obj: Any) -> None:
    """Drop the page-table entries of a file's shared memory map (an ``np.memmap``; its
    bytes stay in the file's page cache) ``DROP_PIECE`` bytes at a time, so that letting
    go of it later unmaps no page. Anything else is left as it is.

    Unmapping a map's pages holds the process's map lock, and every thread that maps
    memory or faults a page in meanwhile waits (in a test here, a thread allocating 4 MiB
    arrays stalled 352 ms while a 4 GiB map was let go; with the pages dropped 64 MiB at a
    time, 18 ms). ``madvise`` is called through ctypes, which lets go of the GIL
    (``mmap.madvise`` holds it)."""
    m = getattr(obj, "_mmap", None)
    if m is None or getattr(obj, "mode", "c") == "c" or not hasattr(mmap, "MADV_DONTNEED"):
        return  # not a map, or a private one (its changed pages would be lost)
    try:
        size = len(m)
        start = np.frombuffer(m, np.uint8).ctypes.data if size else 0
    except (ValueError, TypeError):  # closed already
        return
    for at in range(0, size, DROP_PIECE):
        _madvise(start + at, min(DROP_PIECE, size - at), mmap.MADV_DONTNEED)


def _let_go(held: list[Any]) -> None:
    for obj in held:
        drop_pages(obj)
    held.clear()


def pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    """Write the bytes of the C-contiguous ``data`` into ``fd`` from byte ``offset``.

    Raises
    ------
    OSError
        If the file system takes no more bytes (it filled, say).
    """
    view = data.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):
        got = os.pwrite(fd, view[done:], offset + done)
        if got <= 0:
            raise OSError(errno.ENOSPC, f"wrote {done} of {len(view)} bytes from byte {offset}")
        done += got


def _dma(kind: str, dst: int, src: int, nbytes: int, stream: Any) -> tuple[Any, Any]:
    """Enqueue one copy on ``stream`` between events that time it; returns the events."""
    import cupy

    rt = cupy.cuda.runtime
    begin, end = cupy.cuda.Event(), cupy.cuda.Event()
    begin.record(stream)
    rt.memcpyAsync(dst, src, nbytes, rt.memcpyHostToDevice if kind == "h2d" else rt.memcpyDeviceToHost, stream.ptr)
    end.record(stream)
    return begin, end


def _dma_rows(dst: int, pitch: int, buf: np.ndarray, row_bytes: int, stream: Any) -> tuple[Any, Any]:
    """Enqueue the copy of the pinned ``buf``'s rows (``row_bytes`` each) to device
    address ``dst``, a row every ``pitch`` bytes, between events that time it."""
    if pitch == row_bytes:
        return _dma("h2d", dst, buf.ctypes.data, buf.nbytes, stream)
    import cupy

    rt = cupy.cuda.runtime
    begin, end = cupy.cuda.Event(), cupy.cuda.Event()
    begin.record(stream)
    rt.memcpy2DAsync(dst, pitch, buf.ctypes.data, row_bytes, row_bytes, buf.shape[0], rt.memcpyHostToDevice, stream.ptr)
    end.record(stream)
    return begin, end


def load(dev: Any, src: np.ndarray, out: Any = None, *, spread: bool = False) -> Any:
    """``src`` (host, any strides) on ``dev``: into ``out`` if given, else a new array.

    With ``spread`` a block smaller than a chunk per host thread goes in smaller chunks
    (down to 1 MiB), one or more per thread: a thin column block of a file's map costs a
    page fault per row whatever its width, and each thread takes its share of them.
    """
    if not dev.is_gpu:
        if out is None:
            return np.ascontiguousarray(src)
        np.copyto(out, src)
        return out
    if out is None:
        with dev.on_stream():
            out = dev.xp.empty(src.shape, src.dtype)
    chunk = chunk_size()
    if spread:
        chunk = max(1 << 20, min(chunk, src.nbytes // dev.staging.threads))
    Stager(dev, chunk).load(out, src)
    return out


def load_pieces(dev: Any, pieces: Sequence[tuple[Any, np.ndarray]], *, spread: bool = False) -> int:
    """Each host ``src`` (any strides: a block of a memory map) into its ``dst`` on ``dev``
    (rows contiguous, any pitch: see :meth:`Stager.load_pieces`), all at once; returns
    the bytes copied. ``spread`` as for :func:`load`, over the pieces' bytes together.
    Work enqueued after this returns on the thread's stream sees the data."""
    if not dev.is_gpu:
        for dst, src in pieces:
            np.copyto(dst, src)
        return sum(dst.nbytes for dst, _ in pieces)
    chunk = chunk_size()
    if spread:
        total = sum(src.nbytes for _, src in pieces)
        chunk = max(1 << 20, min(chunk, total // dev.staging.threads))
    return Stager(dev, chunk).load_pieces(pieces)


def store(dev: Any, dst: np.ndarray, src: Any) -> None:
    """``dst[...] = src`` from ``dev`` into host ``dst`` (an ``.npy`` memory map, say)."""
    if not dev.is_gpu:
        host_copy(_rows(dst), _rows(np.asarray(src)), dev.staging)
        return
    if not src.flags.c_contiguous:
        with dev.on_stream():
            src = dev.xp.ascontiguousarray(src)
    Stager(dev).store(dst, src)
