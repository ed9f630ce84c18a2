"""How fast this host writes into a file in the page cache, against the number of threads.

    python benchmarks/page_cache_write.py [--folder /dev/shm] [--gib 2] [--threads 1,2,4,8,16]

Each thread writes its share of the file in 16 MiB chunks from a buffer of its own, the
way mgpu's writers put a finished piece of C into an output ``.npy``: ``map`` copies into
a shared memory map of the file (a page fault per 4 KiB page), ``pwrite`` hands the
chunk to the kernel (tmpfs takes one writer of a file at a time). The file's pages are
reserved first (``posix_fallocate``), as mgpu's sinks do. Prints GB/s per method and
thread count (the best of three).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CHUNK = 16 << 20


def _map_writer(path: str, lo: int, hi: int, src: np.ndarray) -> None:
    mm = np.memmap(path, dtype=np.uint8, mode="r+", offset=lo, shape=(hi - lo,))
    for at in range(0, hi - lo, CHUNK):
        n = min(CHUNK, hi - lo - at)
        mm[at : at + n] = src[:n]
    del mm


def _pwrite_writer(path: str, lo: int, hi: int, src: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        for at in range(lo, hi, CHUNK):
            os.pwrite(fd, memoryview(src)[: min(CHUNK, hi - at)], at)
    finally:
        os.close(fd)


def rate(method: str, folder: str, nbytes: int, threads: int) -> float:
    """GB/s of one write of ``nbytes`` into a new file in ``folder`` by ``threads`` threads."""
    writer = _map_writer if method == "map" else _pwrite_writer
    sources = [np.full(CHUNK, i + 1, np.uint8) for i in range(threads)]
    fd, path = tempfile.mkstemp(dir=folder, prefix="mgpu-write-rate-")
    try:
        os.posix_fallocate(fd, 0, nbytes)
        os.close(fd)
        per = -(-nbytes // threads // CHUNK) * CHUNK
        ranges = [(lo, min(nbytes, lo + per)) for lo in range(0, nbytes, per)]
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(lambda r: writer(path, r[0], r[1], sources[ranges.index(r)]), ranges))
            seconds = time.perf_counter() - start
    finally:
        os.unlink(path)
    return nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--threads", default="1,2,4,8,16")
    args = parser.parse_args()
    nbytes = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    print(f"{nbytes / 2**30:.3g} GiB into {args.folder}, {os.cpu_count()} CPUs")
    for method in ("map", "pwrite"):
        for threads in (int(t) for t in args.threads.split(",")):
            best = max(rate(method, args.folder, nbytes, threads) for _ in range(3))
            print(f"{method:6s} {threads:3d} thread(s): {best:6.2f} GB/s")


if __name__ == "__main__":
    main()
