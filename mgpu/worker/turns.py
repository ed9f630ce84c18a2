"""Turns at a GPU for the worker processes that share it.

Processes with work on one GPU at once are time-sliced by the driver, and the switches
cost: on an H100, 2, 4 or 8 processes each running their share of 64 GEMMs of 8192³
took 1.12x the time of one process running all 64; taking turns (one process's work on
the GPU at a time, each turn ending once that work has run) took 1.005-1.013x. So the
workers that share a GPU (``cluster.workers_per_device``, a joined cluster's workers on
one GPU) run each tile, step and panel in a turn: an exclusive ``flock`` on a file named
by the GPU's UUID, held by the process while any of its threads is in a turn (its own
streams share the GPU without time-slicing), released once its work on the GPU has run.

A worker whose device no other worker shares takes no turns: waiting for the GPU at the
end of every step would cost its host the lead it keeps on the device. A worker killed in
a turn lets go of it with its process; one stopped (SIGSTOP) in a turn holds it, and the
workers that share its GPU wait with it until their tiles' deadlines retire them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["DeviceTurns", "turns_dir"]


def turns_dir() -> Path:
    """Where the turns' lock files live: the temporary folder every process of a host sees."""
    return Path(tempfile.gettempdir()) / "mgpu-turns"


class DeviceTurns:
    """One worker process's turns at its GPU.

    Parameters
    ----------
    device
        The GPU's identity (its UUID): processes that give the same one take turns.
    drain
        Waits for every piece of this process's work on the GPU (``cudaDeviceSynchronize``):
        a turn ends once it returns.
    """

    def __init__(self, device: str, drain: Callable[[], None]) -> None:
        self.device = device
        self.shared = False  # set by the client when other workers share the GPU
        self._drain = drain
        self._fd: int | None = None
        self._holders = 0  # this process's threads in a turn
        self._gate = threading.Lock()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the GPU for the work enqueued inside (no-op where it is not shared)."""
        if not self.shared:
            yield
            return
        self._enter()
        try:
            yield
        finally:
            self._leave()

    def _enter(self) -> None:
        with self._gate:  # one thread waits for the lock for all of this process's
            if self._holders == 0:
                if self._fd is None:
                    folder = turns_dir()
                    folder.mkdir(parents=True, exist_ok=True)
                    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.device)
                    self._fd = os.open(folder / f"{name}.lock", os.O_CREAT | os.O_RDWR, 0o666)
                fcntl.flock(self._fd, fcntl.LOCK_EX)  # releases the GIL while it waits
            self._holders += 1

    def _leave(self) -> None:
        with self._gate:
            self._holders -= 1
            if self._holders == 0 and self._fd is not None:
                try:
                    self._drain()  # the next process's work starts on an idle GPU
                finally:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self._gate:
            if self._fd is not None:
                os.close(self._fd)  # lets go of a turn held, too
                self._fd = None
