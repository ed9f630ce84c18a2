"""What a stepped tile sends a neighbour on another GPU of its host: device to device.

The sender copies the array into one of two buffers of its own, in plain ``cudaMalloc``
memory (CUDA IPC names whole allocations, which a pool's pieces are not), used in turn by
step; what crosses Dask is a small :class:`PeerArray` naming the buffer. The receiving
process opens the buffer once by its IPC handle and copies from it over NVLink (or PCIe
peer to peer) into a buffer of its own, again one of two used in turn. Both copies run
on the copy stream and are waited for before the step's task returns, so the Dask
dependencies order everything: a sender overwrites a buffer at its step s + 2 only after
the receivers' step s + 1 tasks, which copied from it, have returned.

A neighbour's worker on the same GPU takes the same path: it opens the buffer by IPC and
copies within the device (no peer access, which CUDA refuses for a device and itself).
Where the GPUs cannot reach each other (another host, no peer access) the core fetches
the array to the host instead (see :func:`mgpu.worker.tile.step_tile`).

What a worker keeps (its buffers, the senders' buffers it opened) is its runtime's
:class:`PeerBuffers` (:mod:`mgpu.worker.runtime`), whose ``release`` and ``free`` run on
every worker once a job ends (:func:`mgpu.worker.tasks.end_job`).
"""

from __future__ import annotations

import functools
import math
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from ..gpus import can_access_peer, cuda_count, uuid_bytes
from .panels import enable_peer_access

__all__ = ["PeerArray", "PeerBuffers", "peers_reachable"]


@functools.cache
def peers_reachable() -> bool:
    """Whether this process's GPU (its device 0) can reach every other GPU it sees."""
    count = cuda_count()
    return count > 1 and all(can_access_peer(0, k) for k in range(1, count))


@dataclass(frozen=True)
class PeerArray:
    """An array a stepped tile sent, in its process's IPC-able buffer ``handle``."""

    token: str
    host: str
    pid: int
    gpu_uuid: bytes
    handle: bytes
    shape: tuple[int, ...]
    dtype: str
    slot: tuple[int, int, int]  # (sender, receiver, parity): which of the receiver's buffers it goes to

    @property
    def nbytes(self) -> int:
        import cupy

        return int(cupy.dtype(self.dtype).itemsize * math.prod(self.shape))

    @property
    def same_device(self) -> bool:
        """Whether it lies on this process's own GPU (another worker on this GPU sent it)."""
        return self.gpu_uuid == uuid_bytes(0)


class PeerBuffers:
    """One worker's buffers of the exchange, per job token: those it sends from and
    receives into, and the senders' buffers it opened."""

    def __init__(self) -> None:
        self._sending: dict[str, dict[tuple[int, int, int], tuple[Any, bytes]]] = {}
        self._receiving: dict[str, dict[tuple[int, int, int], Any]] = {}
        self._opened: dict[str, dict[bytes, int]] = {}
        self._lock = threading.Lock()

    def export(self, dev: Any, token: str, sender: int, receiver: int, step: int, data: Any, made: Any) -> PeerArray:
        """Copy ``data`` (once the event ``made`` has passed) into the sender's buffer for
        this step and return what names it; waits for the copy."""
        import cupy

        slot = (sender, receiver, step % 2)
        with self._lock:
            mine = self._sending.setdefault(token, {})
            if slot not in mine:
                memory = cupy.cuda.memory.Memory(max(1, data.nbytes))  # cudaMalloc: its own allocation
                mine[slot] = (memory, bytes(cupy.cuda.runtime.ipcGetMemHandle(memory.ptr)))
            memory, handle = mine[slot]
        copy = dev.copy_stream
        copy.wait_event(made)
        cupy.cuda.runtime.memcpyAsync(
            memory.ptr, data.data.ptr, data.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, copy.ptr
        )
        copy.synchronize()
        return PeerArray(
            token, socket.gethostname(), os.getpid(), uuid_bytes(0), handle, tuple(data.shape), str(data.dtype), slot
        )

    def receive(self, dev: Any, ref: PeerArray, after: Any) -> Any:
        """``ref``'s array copied from the sender's GPU into a buffer on this one (after the
        event ``after``, this tile's step before, which read that buffer last); waits for it."""
        import cupy

        if ref.host != socket.gethostname():
            raise RuntimeError(f"a peer array from {ref.host} reached {socket.gethostname()}: peers share a host")
        with self._lock:
            opened = self._opened.setdefault(ref.token, {})
            if ref.handle not in opened:
                peer = (
                    0
                    if ref.same_device
                    else next((k for k in range(1, cuda_count()) if uuid_bytes(k) == ref.gpu_uuid), None)
                )
                if peer is None:
                    raise RuntimeError(
                        f"tile {ref.slot[0]}'s GPU is not one this worker sees; its rows cannot come direct"
                    )
                enable_peer_access(peer)
                opened[ref.handle] = cupy.cuda.runtime.ipcOpenMemHandle(ref.handle)
            source = opened[ref.handle]
            mine = self._receiving.setdefault(ref.token, {})
            if ref.slot not in mine:
                mine[ref.slot] = cupy.empty(ref.shape, dtype=ref.dtype)
            out = mine[ref.slot]
        copy = dev.copy_stream
        if after is not None:
            copy.wait_event(after)
        cupy.cuda.runtime.memcpyAsync(
            out.data.ptr, source, ref.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, copy.ptr
        )
        copy.synchronize()
        return out

    def release(self, token: str) -> int:
        """Close the senders' buffers opened here for one job."""
        with self._lock:
            opened = self._opened.pop(token, {})
        if not opened:
            return 0
        import cupy

        for ptr in opened.values():
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        return len(opened)

    def free(self, token: str) -> int:
        """Free this worker's send and receive buffers of one job (after every peer's :meth:`release`)."""
        with self._lock:
            sending = self._sending.pop(token, {})
            self._receiving.pop(token, None)
        return len(sending)

    def close(self) -> None:
        """Close every sender's buffer opened here, then free this worker's own."""
        with self._lock:
            tokens = set(self._opened) | set(self._sending) | set(self._receiving)
        for token in tokens:
            self.release(token)
        for token in tokens:
            self.free(token)
