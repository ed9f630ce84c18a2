"""File <-> GPU through KvikIO: byte ranges of ``.npy`` files read straight into device
memory, and rows of an output written straight from it.

KvikIO splits a read into tasks (``mgpu.io.task-size``) run by its thread pool
(``mgpu.io.threads``); each task goes through GPUDirect Storage where the driver has it
and otherwise (compat mode) through a pinned bounce buffer and a DMA. On an H200 host
(an 8 GiB file in the page cache) KvikIO 26.10 in compat mode read 45-47 GB/s with 16
threads and 4 or 8 MiB tasks (40 with 16 MiB tasks, 24-37 with 8 threads), where mgpu's
former pinned stager (a pread pool) read 37.2; pinned host-to-device copies run at
49-55. A dot of two 8 GB files read 43-44 GB/s with 4 MiB tasks and 45-46 with 8 MiB.

KvikIO reads contiguous byte ranges only. A column block of a C-ordered file is one
range per row, and read row by row KvikIO moved 1.9 GB/s: such blocks are copied from a
memory map by :mod:`mgpu.worker.transfer` instead (36 GB/s). The pool is one per process and
the CPU backend never imports KvikIO.

Whole rows of an output are copied through the pinned stager into a memory map of the
file by default (``mgpu.io.write: mmap``), handed to the kernel from the stager's pinned
buffers with ``pwrite``, or written by KvikIO with ``kvikio``. Its one pool per process
also reads the inputs, and a write's tasks queue ahead of the reads the products wait for:
on an H200, 32768³ from files with a 6 GiB budget took 2.35-3.01 s with KvikIO's writes
and 2.02-2.50 s through the map, in the same runs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from .. import config

__all__ = [
    "Started",
    "read",
    "read_in_order",
    "read_method",
    "started",
    "task_size",
    "threads",
    "warm_up",
    "write",
    "write_method",
]


def threads() -> int:
    """KvikIO's threads per worker process (``mgpu.io.threads``, 16 by default)."""
    return config.load().io.threads


def task_size() -> int:
    """Bytes per KvikIO task (``mgpu.io.task-size``, 8 MiB by default)."""
    return config.load().io.task_size


def read_method(contiguous: bool = True) -> str:
    """How a GPU worker reads a block of an ``.npy`` input: ``"kvikio"`` (the file's bytes
    straight into device memory) or ``"mmap"`` (copied from a memory map through pinned
    buffers, :mod:`mgpu.worker.transfer`).

    ``mgpu.io.read`` picks one for every block, or ``"auto"`` (the default): KvikIO for a
    block that is contiguous in the file (whole rows, a range of a vector), the map for a
    column block (one range per row: KvikIO 1.9 GB/s, the map 36).
    """
    method = config.load().io.read
    if method == "auto":
        return "kvikio" if contiguous else "mmap"
    return method


def write_method() -> str:
    """How a worker writes whole rows of an output ``.npy`` (``mgpu.io.write``):
    ``"mmap"`` (the default: through the pinned stager into a memory map of the file),
    ``"pwrite"`` (handed to the kernel, from a GPU through the stager's pinned buffers)
    or ``"kvikio"`` (GPU workers: straight from device memory)."""
    return config.load().io.write


def _kvikio() -> Any:
    """KvikIO, its pool and task size set from mgpu's config. Set again only when KvikIO's
    own settings differ (setting the thread count remakes the pool, which other threads
    of the process may be using)."""
    import kvikio
    import kvikio.defaults

    want = {"num_threads": threads(), "task_size": task_size()}
    if any(kvikio.defaults.get(k) != v for k, v in want.items()):
        kvikio.defaults.set(want)
    return kvikio


def read(path: str, offset: int, out: Any) -> float:
    """Fill the C-contiguous device array ``out`` with ``out.nbytes`` bytes of ``path``
    from byte ``offset``; returns the seconds the read took.

    The data is in place when this returns. The caller makes sure no device work still
    uses ``out``'s memory (KvikIO copies on streams of its own).

    Raises
    ------
    EOFError
        If the file ends before the range does.
    """
    nbytes = out.nbytes
    size = os.stat(path).st_size
    if offset + nbytes > size:
        raise EOFError(f"{path} is truncated: it ends at byte {size}, short of the data its header describes")
    kvikio = _kvikio()
    start = time.perf_counter()
    with kvikio.CuFile(path, "r") as f:
        got = f.pread(out, nbytes, offset).get()
    if got != nbytes:
        raise EOFError(f"{path}: read {got} of {nbytes} bytes from byte {offset}")
    return time.perf_counter() - start


def write(path: str, offset: int, data: Any) -> float:
    """Write the C-contiguous device array ``data`` into ``path`` from byte ``offset`` (the
    file is sized already); returns the seconds the write took. ``data`` must not change
    until this returns (KvikIO copies it on streams of its own).

    Raises
    ------
    OSError
        If the file system takes fewer bytes than given (it filled, say).
    """
    kvikio = _kvikio()
    start = time.perf_counter()
    with kvikio.CuFile(path, "r+") as f:
        got = f.pwrite(data, data.nbytes, offset).get()
    if got != data.nbytes:
        raise OSError(errno.ENOSPC, f"wrote {got} of {data.nbytes} bytes from byte {offset}", path)
    return time.perf_counter() - start


def read_in_order(requests: list[tuple[str, int, Any]]) -> Iterator[float]:
    """Start every read ``(path, offset, out)`` at once and yield as each one lands, in
    order, the seconds since the first started (:func:`read`'s rules apply to each).

    KvikIO runs its tasks in the order they came, so the first read lands first and the
    caller can work on it while the rest are read.

    Raises
    ------
    EOFError
        If a file ends before its range does (before any read starts).
    """
    for path, offset, out in requests:
        size = os.stat(path).st_size
        if offset + out.nbytes > size:
            raise EOFError(f"{path} is truncated: it ends at byte {size}, short of the data its header describes")
    kvikio = _kvikio()
    files = {path: kvikio.CuFile(path, "r") for path in {r[0] for r in requests}}
    start = time.perf_counter()
    futures: list[Any] = []
    waited = 0  # futures whose get() was called (a second call is an error in KvikIO)
    try:
        futures = [files[path].pread(out, out.nbytes, offset) for path, offset, out in requests]
        for path, offset, out in requests:
            got = futures[waited].get()
            waited += 1
            if got != out.nbytes:
                raise EOFError(f"{path}: read {got} of {out.nbytes} bytes from byte {offset}")
            yield time.perf_counter() - start
    finally:
        for future in futures[waited:]:  # none may still write into the caller's arrays
            future.get()
        for f in files.values():
            f.close()


class Started:
    """KvikIO reads started together by :func:`started`; :meth:`wait` for them to land."""

    def __init__(self, requests: Sequence[tuple[str, int, Any]]) -> None:
        self.requests = list(requests)
        self._futures: list[Any] = []
        self._files: dict[str, Any] = {}
        self._waited = 0  # futures whose get() was called (a second call is an error in KvikIO)
        self._seconds = 0.0
        self._start = time.perf_counter()

    def start(self) -> None:
        for path, offset, out in self.requests:
            size = os.stat(path).st_size
            if offset + out.nbytes > size:
                raise EOFError(f"{path} is truncated: it ends at byte {size}, short of the data its header describes")
        if not self.requests:
            return
        kvikio = _kvikio()
        self._files = {path: kvikio.CuFile(path, "r") for path in {r[0] for r in self.requests}}
        self._start = time.perf_counter()
        for path, offset, out in self.requests:
            self._futures.append(self._files[path].pread(out, out.nbytes, offset))

    def wait(self) -> float:
        """Wait for every read; returns the seconds from their start until the last landed.

        Raises
        ------
        EOFError
            If a read got fewer bytes than its range (the file was cut short meanwhile).
        """
        short = None
        while self._waited < len(self._futures):
            got = self._futures[self._waited].get()
            path, offset, out = self.requests[self._waited]
            self._waited += 1
            if got != out.nbytes and short is None:
                short = f"{path}: read {got} of {out.nbytes} bytes from byte {offset}"
        if self._futures and not self._seconds:
            self._seconds = time.perf_counter() - self._start
        if short is not None:
            raise EOFError(short)
        return self._seconds

    def close(self) -> None:
        """Wait for any read still running (none may write into the caller's arrays
        after this) and close the files."""
        try:
            while self._waited < len(self._futures):
                self._waited += 1
                self._futures[self._waited - 1].get()
        finally:
            for f in self._files.values():
                f.close()
            self._files = {}


@contextlib.contextmanager
def started(requests: Sequence[tuple[str, int, Any]]) -> Iterator[Started]:
    """Start every read ``(path, offset, out)`` at once (:func:`read`'s rules apply to
    each) and hand them over while they run: the caller does other work, then calls
    ``wait()``. Leaving the block waits for any read not waited for, so no read still
    writes into ``out`` once it is left, even on an error.

    Raises
    ------
    EOFError
        If a file ends before its range does (before any read starts).
    """
    reads = Started(requests)
    try:
        reads.start()
        yield reads
    finally:
        reads.close()


def warm_up(path: str, offset: int, nbytes: int) -> None:
    """Read up to one task per thread of ``path`` once, untimed: starts KvikIO's pool and
    gives each thread its bounce buffer, so the job's first read is not charged for them."""
    import cupy

    n = min(nbytes, threads() * task_size())
    if n > 0:
        read(path, offset, cupy.empty(n, dtype=cupy.uint8))
