"""Operand panels that stay on the worker that made them, and reach other GPUs directly.

A panel task makes a block of an operand once (generated or read) and keeps it in its
worker's memory; what goes back through Dask is a small :class:`PanelRef`. A tile task
on another GPU of the same node opens the panel by CUDA IPC and copies it over NVLink
(peer to peer, never through host memory) on a copy stream of its own, while its compute
stream works on what has arrived. A tile task of another worker on the same GPU opens it
by CUDA IPC too, and copies it within the device (no peer access is needed, or allowed,
to reach one's own device). Where no peer path exists (another node, no peer
access, or CPU workers) the tile makes its own copy from the operand's source instead:
inputs are deterministic, so that copy is the same data.

Panels live in plain ``cudaMalloc`` memory, outside the RMM pool: IPC handles name a
whole allocation, which a pool's sub-allocations are not. A peer's panel is opened once
per job and process and kept open until every tile has ended
(:meth:`PanelStore.close_remotes`):
closing a mapping waits for the whole device, so a tile closing it would wait for the
product of the tile beside it.

What a worker keeps (its panels, the peers' panels it opened) is its runtime's
:class:`PanelStore` (:mod:`mgpu.worker.runtime`), handed to the functions here.
"""

from __future__ import annotations

import math
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from ..gpus import can_access_peer, cuda_count, uuid_bytes

__all__ = [
    "PanelRef",
    "PanelStore",
    "RemotePanel",
    "copy_rows",
    "enable_all_peers",
    "enable_peer_access",
    "peer_ordinal",
    "publish",
    "resident",
]


@dataclass(frozen=True)
class PanelRef:
    """Where a panel lives; small enough to pass through the scheduler."""

    token: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    host: str
    pid: int
    gpu_uuid: bytes | None = None  # the owner's GPU; None on CPU workers
    ipc_handle: bytes | None = None
    record: Any = None  # the TileRecord (kind "panel") of its making: time and bytes moved


def publish(
    store: PanelStore, dev: Any, token: str, name: str, shape: tuple[int, ...], dtype: str, fill: Any
) -> PanelRef:
    """Make a panel with ``fill(out)`` (``out`` a fresh array to fill) and keep it in ``store``
    (this worker's)."""
    if dev.is_gpu:
        import cupy

        nbytes = max(1, int(cupy.dtype(dtype).itemsize * math.prod(shape)))
        memory = cupy.cuda.memory.Memory(nbytes)  # cudaMalloc: its own IPC-able allocation
        arr = cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))
        with dev.on_stream():
            fill(arr)
        dev.synchronize()
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(memory.ptr))
        ref = PanelRef(token, name, tuple(shape), str(dtype), socket.gethostname(), os.getpid(), uuid_bytes(0), handle)
    else:
        import numpy as np

        arr = np.empty(shape, dtype)
        fill(arr)
        ref = PanelRef(token, name, tuple(shape), str(dtype), socket.gethostname(), os.getpid())
    store.keep(token, name, arr)
    return ref


def resident(store: PanelStore, ref: PanelRef) -> Any | None:
    """The panel itself when this worker (whose panels ``store`` keeps) made it, else None."""
    if ref.host != socket.gethostname() or ref.pid != os.getpid():
        return None
    return store.get(ref.token, ref.name)


def peer_ordinal(ref: PanelRef) -> int | None:
    """This process's ordinal of the GPU holding ``ref``, if it can reach it directly: 0
    where another worker on this same GPU made it."""
    if ref.gpu_uuid is None or ref.host != socket.gethostname():
        return None
    if ref.gpu_uuid == uuid_bytes(0):
        return 0
    for ordinal in range(1, cuda_count()):
        if uuid_bytes(ordinal) == ref.gpu_uuid:
            return ordinal if can_access_peer(0, ordinal) else None
    return None


def enable_peer_access(peer: int) -> None:
    """Let this process's device 0 reach ``peer`` directly (NVLink or PCIe P2P); nothing
    for device 0 itself, which CUDA refuses as its own peer."""
    if peer == 0:
        return
    import cupy

    try:
        cupy.cuda.runtime.deviceEnablePeerAccess(peer)
    except cupy.cuda.runtime.CUDARuntimeError as e:
        if "PeerAccessAlreadyEnabled" not in str(e):
            raise


def enable_all_peers() -> None:
    """Enable peer access from this process's device 0 to every GPU it can reach."""
    for ordinal in range(1, cuda_count()):
        if can_access_peer(0, ordinal):
            enable_peer_access(ordinal)


class RemotePanel:
    """A peer's panel opened by CUDA IPC (:meth:`open` to :meth:`close`).

    ``peer`` is this process's ordinal of the GPU holding it (see :func:`peer_ordinal`): 0
    for a panel of another worker on this GPU, opened without peer access.
    """

    def __init__(self, ref: PanelRef, peer: int) -> None:
        self.ref = ref
        self.peer = peer
        self.ptr = 0

    def open(self) -> RemotePanel:
        import cupy

        enable_peer_access(self.peer)
        self.ptr = cupy.cuda.runtime.ipcOpenMemHandle(self.ref.ipc_handle)
        return self

    def close(self) -> None:
        import cupy

        # Close before the owner may free it (see PanelStore.close_remotes).
        cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)
        self.ptr = 0


def copy_rows(dst: Any, panel: RemotePanel, rows: tuple[int, int], stream: Any) -> int:
    """Enqueue a copy of ``panel``'s rows ``rows`` (C order) into ``dst``; returns bytes."""
    import cupy

    shape, itemsize = panel.ref.shape, cupy.dtype(panel.ref.dtype).itemsize
    row_bytes = itemsize * math.prod(shape[1:])
    nbytes = (rows[1] - rows[0]) * row_bytes
    cupy.cuda.runtime.memcpyAsync(
        dst.data.ptr, panel.ptr + rows[0] * row_bytes, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr
    )
    return nbytes


class PanelStore:
    """The panels one worker keeps: those it made and the peers' it opened, per job token."""

    def __init__(self) -> None:
        self._made: dict[str, dict[str, Any]] = {}  # job token -> panel name -> array
        self._opened: dict[str, dict[str, RemotePanel]] = {}  # job token -> panel name -> a peer's, open here
        self._lock = threading.Lock()

    def keep(self, token: str, name: str, arr: Any) -> None:
        with self._lock:
            self._made.setdefault(token, {})[name] = arr

    def get(self, token: str, name: str) -> Any | None:
        with self._lock:
            return self._made.get(token, {}).get(name)

    def held(self) -> int:
        """How many panels this worker holds, made or opened, over every job."""
        with self._lock:
            return sum(map(len, self._made.values())) + sum(map(len, self._opened.values()))

    def open_remote(self, ref: PanelRef, peer: int) -> RemotePanel:
        """``ref`` opened here on its first use in its job, then the same until closed."""
        with self._lock:
            opened = self._opened.setdefault(ref.token, {})
            if ref.name not in opened:
                opened[ref.name] = RemotePanel(ref, peer).open()
            return opened[ref.name]

    def close_remotes(self, token: str) -> int:
        with self._lock:
            opened = self._opened.pop(token, {})
        for remote in opened.values():
            remote.close()
        return len(opened)

    def release(self, token: str) -> int:
        with self._lock:
            panels = self._made.pop(token, {})
        return len(panels)

    def close(self) -> None:
        """Close every peer's panel opened here, then free every panel made here."""
        with self._lock:
            tokens = set(self._made) | set(self._opened)
        for token in tokens:
            self.close_remotes(token)
        for token in tokens:
            self.release(token)
