"""File -> GPU through KvikIO: byte ranges of ``.npy`` files read straight into device memory.

KvikIO splits a read into tasks (``mgpu.io.task-size``) run by its thread pool
(``mgpu.io.threads``); each task goes through GPUDirect Storage where the driver has it
and otherwise (compat mode) through a pinned bounce buffer and a DMA. On an H200 host
(an 8 GiB file in the page cache) KvikIO 26.10 in compat mode read 45-47 GB/s with 16
threads and 4 or 8 MiB tasks (40 with 16 MiB tasks, 24-37 with 8 threads), where mgpu's
former pinned stager (a pread pool) read 37.2; pinned host-to-device copies run at
49-55. A dot of two 8 GB files read 43-44 GB/s with 4 MiB tasks and 45-46 with 8 MiB.

KvikIO reads contiguous byte ranges only. A column block of a C-ordered file is one
range per row, and read row by row KvikIO moved 1.9 GB/s: such blocks are copied from a
memory map by :mod:`mgpu.transfer` instead (36 GB/s). The pool is one per process and
the CPU backend never imports KvikIO.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from . import config

__all__ = ["read", "read_in_order", "read_method", "task_size", "threads", "warm_up"]

_LOCK = threading.Lock()
_APPLIED: tuple[int, int] | None = None  # (threads, task size) KvikIO was last set to


def threads() -> int:
    """KvikIO's threads per worker process (``mgpu.io.threads``, 16 by default)."""
    return config.load().io.threads


def task_size() -> int:
    """Bytes per KvikIO task (``mgpu.io.task-size``, 8 MiB by default)."""
    return config.load().io.task_size


def read_method(contiguous: bool = True) -> str:
    """How a GPU worker reads a block of an ``.npy`` input: ``"kvikio"`` (the file's bytes
    straight into device memory) or ``"mmap"`` (copied from a memory map through pinned
    buffers, :mod:`mgpu.transfer`).

    ``mgpu.io.read`` picks one for every block, or ``"auto"`` (the default): KvikIO for a
    block that is contiguous in the file (whole rows, a range of a vector), the map for a
    column block (one range per row: KvikIO 1.9 GB/s, the map 36).
    """
    method = config.load().io.read
    if method == "auto":
        return "kvikio" if contiguous else "mmap"
    return method


def _kvikio() -> Any:
    """KvikIO, its pool and task size set from mgpu's config (again only when it changed:
    setting the thread count remakes the pool)."""
    global _APPLIED
    import kvikio
    import kvikio.defaults

    want = (threads(), task_size())
    with _LOCK:
        if _APPLIED != want:
            kvikio.defaults.set({"num_threads": want[0], "task_size": want[1]})
            _APPLIED = want
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


def warm_up(path: str, offset: int, nbytes: int) -> None:
    """Read up to one task per thread of ``path`` once, untimed: starts KvikIO's pool and
    gives each thread its bounce buffer, so the job's first read is not charged for them."""
    import cupy

    n = min(nbytes, threads() * task_size())
    if n > 0:
        read(path, offset, cupy.empty(n, dtype=cupy.uint8))
