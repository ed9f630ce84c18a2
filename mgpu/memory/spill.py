"""Spill to unified memory: an RMM resource that falls back to managed memory on OOM.

RMM has no ready fallback resource in Python, so this is the smallest correct one on
RMM's own pieces: a :class:`rmm.mr.CallbackMemoryResource` that asks the worker's
resource first and, when that raises ``MemoryError``, allocates managed memory instead,
remembering which pointers it handed out so each is freed by the resource that made it.
The Python call per allocation costs microseconds; mgpu's tasks make few, large ones.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["ManagedFallback"]


class ManagedFallback:
    """Wraps ``primary``; ``.resource`` is the RMM resource to install."""

    def __init__(self, primary: Any) -> None:
        import rmm

        self.primary = primary
        self.managed = rmm.mr.ManagedMemoryResource()
        self.spilled: dict[int, int] = {}  # pointer -> bytes, for allocations made in managed memory
        self.events = 0
        self.bytes = 0
        self._lock = threading.Lock()
        self.resource = rmm.mr.CallbackMemoryResource(self._allocate, self._deallocate)

    def _allocate(self, nbytes: int, stream: Any) -> int:
        try:
            return self.primary.allocate(nbytes, stream)
        except MemoryError:
            ptr = self.managed.allocate(nbytes, stream)
            with self._lock:
                self.spilled[ptr] = nbytes
                self.events += 1
                self.bytes += nbytes
            return ptr

    def _deallocate(self, ptr: int, nbytes: int, stream: Any) -> None:
        with self._lock:
            was_spilled = self.spilled.pop(ptr, None) is not None
        (self.managed if was_spilled else self.primary).deallocate(ptr, nbytes, stream)
