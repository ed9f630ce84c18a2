"""Turns at a GPU for the worker processes that share it outside MPS.

Processes with work on one GPU at once are time-sliced by the driver, and the switches
cost: on an H100, 2, 4 or 8 processes each running their share of 64 GEMMs of 8192³
took 1.12x the time of one process running all 64; taking turns (one process's work on
the GPU at a time, each turn ending once that work has run) took 1.005-1.013x. So the
workers that share a GPU (``cluster.workers_per_device``, a joined cluster's workers on
one GPU) run each tile, step and panel in a turn: an exclusive ``flock`` on a file named
by the GPU's UUID, held by the process while any of its threads is in a turn (its own
streams share the GPU without time-slicing), released once its work on the GPU has run.

Workers under MPS (:mod:`mgpu.mps`, how a cluster mgpu starts shares a GPU where NVIDIA's
control program is installed) take none: their work runs in one server context, side by
side, with no switch between contexts to save. A worker whose device no other worker
shares takes no turns either: waiting for the GPU at the
end of every step would cost its host the lead it keeps on the device. A worker killed in
a turn lets go of it with its process. One stopped (SIGSTOP) in a turn holds it: a thread
that has waited ``patience`` seconds for a turn goes on without one (time-sliced), so the
others keep working while the scheduler, no longer hearing from the stopped worker,
retires it and its tiles go elsewhere.
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

PATIENCE_S = 10.0  # how long a thread waits for a turn before it goes on without one


def turns_dir() -> Path:
    """Where the turns' lock files live: the temporary folder every process of a host sees."""
    return Path(tempfile.gettempdir()) / "mgpu-turns"


class DeviceTurns:
    """One worker process's turns at its GPU.

    The lock is taken at once where it is free; where another process holds it, a thread
    of this object's own waits for it (``flock`` cannot time out) and hands it to the
    threads that want it, each of which waits at most ``patience`` seconds.

    Parameters
    ----------
    device
        The GPU's identity (its UUID): processes that give the same one take turns.
    drain
        Waits for every piece of this process's work on the GPU (``cudaDeviceSynchronize``):
        a turn ends once it returns.
    patience
        Seconds a thread waits for a turn before it goes on without one.
    """

    def __init__(self, device: str, drain: Callable[[], None], patience: float = PATIENCE_S) -> None:
        self.device = device
        self.shared = False  # set by the client when other workers share the GPU
        self.patience = patience
        self._drain = drain
        self._fd: int | None = None
        self._cond = threading.Condition()
        self._owned = False  # this process holds the lock
        self._holders = 0  # its threads in a turn
        self._wanted = 0  # its threads waiting for the lock
        self._blocked = False  # the waiting thread is in flock()
        self._waiter: threading.Thread | None = None
        self._closed = False

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the GPU for the work enqueued inside (no-op where it is not shared, or
        once ``patience`` has run out waiting)."""
        held = self.shared and self._enter()
        try:
            yield
        finally:
            if held:
                self._leave()

    def _enter(self) -> bool:
        with self._cond:
            if not self._owned and not self._blocked and self._try_lock():
                self._owned = True
            if self._owned:
                self._holders += 1
                return True
            self._wanted += 1
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._wait_for_lock, name="mgpu-turns", daemon=True)
                self._waiter.start()
            self._cond.notify_all()
            got = self._cond.wait_for(lambda: self._owned, timeout=self.patience)
            self._wanted -= 1
            if got:
                self._holders += 1
            return got

    def _leave(self) -> None:
        with self._cond:
            self._holders -= 1
            if self._holders == 0:
                try:
                    self._drain()  # the next process's work starts on an idle GPU
                finally:
                    self._owned = False
                    fcntl.flock(self._lock_fd(), fcntl.LOCK_UN)
                    self._cond.notify_all()  # this process's waiting threads queue again

    def _try_lock(self) -> bool:
        try:
            fcntl.flock(self._lock_fd(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _wait_for_lock(self) -> None:
        """The thread that waits in ``flock`` while this process's threads want the lock."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (self._wanted > 0 and not self._owned))
                if self._closed:
                    return
                self._blocked = True
                fd = self._lock_fd()
            fcntl.flock(fd, fcntl.LOCK_EX)  # releases the GIL while it waits
            with self._cond:
                self._blocked = False
                if self._wanted == 0 or self._closed:  # every thread gave up meanwhile
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    continue
                self._owned = True
                self._cond.notify_all()

    def _lock_fd(self) -> int:
        if self._fd is None:
            folder = turns_dir()
            folder.mkdir(parents=True, exist_ok=True)
            name = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.device)
            self._fd = os.open(folder / f"{name}.lock", os.O_CREAT | os.O_RDWR, 0o666)
        return self._fd

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            if self._fd is not None and not self._blocked:
                os.close(self._fd)  # lets go of a turn held, too
                self._fd = None
