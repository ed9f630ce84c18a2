"""Chunks of a compressed Zarr store decoded on the host, each once, ahead of the blocks
that need them.

zarr decodes the chunks that one selection meets on its own threads, but a block of the
streamed matmul meets few chunks: a block of B (2048 rows of a 32768-wide store) one
chunk, a band's block of A one. Read block by block, one thread decoded at a time, and a
chunk that two blocks meet (each half a chunk wide) was decoded for each: 32768³ from
zstd stores read 0.17 GB/s of input, where zarr decoded the two stores alone at 1.6.
Here each chunk is decoded by zarr on a pool of host threads, several at once, and kept
in host memory while there is room (the least recently used goes first); the streamed
schedule names the blocks it reads next (:meth:`DecodedChunks.ahead`), so their chunks
decode while the products of the blocks before run.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import StoreUnreadable

if TYPE_CHECKING:
    from .stores import ZarrInfo

__all__ = ["KEEP_BYTES", "DecodedChunks"]

# Decoded bytes a store's reader keeps (half of them for chunks asked for ahead): the
# chunks of four blocks of B 2048 rows x 32768 float32 ahead, and of eight of A.
KEEP_BYTES = 2 << 30


class DecodedChunks:
    """One compressed store's chunks, decoded on ``threads`` and kept by coordinates.

    Parameters
    ----------
    info
        The store (:class:`~mgpu.worker.stores.ZarrInfo`).
    threads
        The host threads that decode (the worker's, ``HostStaging.pool_for("decode")``).
    keep
        Decoded bytes kept at most (by the chunk's full size; one chunk at least), by
        default ``KEEP_BYTES``.
    """

    def __init__(self, info: ZarrInfo, threads: Executor, keep: int | None = None) -> None:
        self.info = info
        self.threads = threads
        self.keep = KEEP_BYTES if keep is None else keep
        self._kept: OrderedDict[tuple[int, ...], Future[np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()
        self._array: Any = None

    def _open(self) -> Any:
        with self._lock:
            if self._array is None:
                import zarr

                self._array = zarr.open_array(self.info.path, mode="r")
            return self._array

    def _decode(self, coords: tuple[int, ...]) -> np.ndarray:
        try:
            return np.asarray(self._open().get_block_selection(coords))
        except Exception as e:  # zarr and its codecs raise several types for a bad chunk
            raise StoreUnreadable(
                f"{self.info.key}: {self.info.path}: could not read chunk {list(coords)} ({type(e).__name__}: {e})"
            ) from None

    def _start(self, coords: tuple[int, ...]) -> Future[np.ndarray]:
        """The chunk's decoding, started if it is not kept, and made the most recently used
        (under the lock)."""
        future = self._kept.get(coords)
        if future is None:
            future = self._kept[coords] = self.threads.submit(self._decode, coords)
            while len(self._kept) > 1 and len(self._kept) * self.info.chunk_nbytes > self.keep:
                self._kept.popitem(last=False)  # a decoding still running goes on for whoever waits on it
        else:
            self._kept.move_to_end(coords)
        return future

    def get(self, coords: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        """The chunks ``coords``, decoded (all started before any is waited for).

        Raises
        ------
        StoreUnreadable
            If a chunk cannot be read or decoded (the key, store and chunk named).
        """
        with self._lock:
            futures = [self._start(c) for c in coords]
        return [f.result() for f in futures]

    def ahead(self, coords: Sequence[tuple[int, ...]]) -> None:
        """Start decoding the chunks ``coords``, in the order they will be needed, as many as
        half of ``keep`` holds (those kept already count, and are kept longer)."""
        room = self.keep // 2
        with self._lock:
            for c in dict.fromkeys(coords):
                room -= self.info.chunk_nbytes
                if room < 0:
                    break
                self._start(c)

    @property
    def kept(self) -> list[tuple[int, ...]]:
        """The coordinates of the chunks kept, least recently used first."""
        with self._lock:
            return list(self._kept)
