"""Ctrl-C and SIGTERM end a run the same clean way.

SIGINT raises KeyboardInterrupt in the main thread; SIGTERM (what ``kill``, Slurm and
container runtimes send) is made to raise it too, so that one path unwinds both: the
client side cancels the job's tasks, the cluster mgpu started is closed, and the outputs'
temporary files are removed. A second signal while that runs is ignored, and a first one that
arrives while a cluster is being closed waits until it is closed, so the cleanup itself is
not cut short (SIGKILL still ends everything at once). One that Python hands to the
handler inside a finalizer, where an exception is printed and dropped, comes again once
the finalizer has returned.

The workers of a cluster mgpu starts load this module as a preload (``dask_setup``) and
ignore SIGINT: Ctrl-C at a terminal reaches every process of the foreground group, and the
workers are mgpu's to close, not the terminal's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = [
    "WORKER_PRELOAD",
    "Interrupted",
    "cancel_on_signals",
    "dask_setup",
    "deferred",
    "exit_on_signals_while_starting",
]

_HANDLED = (signal.SIGINT, signal.SIGTERM)

# Passed as ``preload`` to the workers of clusters mgpu starts; see dask_setup.
WORKER_PRELOAD = __name__


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal; ``exit_code`` is the shell's 128 + signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _already_stopping(signum: int, frame: Any) -> None:
    print("mgpu: already stopping: cancelling the tasks and closing the cluster", file=sys.stderr)


# Code whose exceptions Python prints and drops: an object's finalizer, weakref.finalize's.
_FINALIZER_CODES = (weakref.finalize.__call__.__code__,)
# How soon a signal that landed in a finalizer is delivered again, past its end.
_REDELIVER_S = 0.01


def _in_finalizer(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a finalizer: a ``__del__`` (a Dask future's, releasing
    its key as the client drops it) or a weakref.finalize callback."""
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code in _FINALIZER_CODES:
            return True
        frame = frame.f_back
    return False


def _interrupt(signum: int, frame: Any) -> None:
    if _in_finalizer(frame):
        # Raised here, Interrupted would be printed ("Exception ignored in ...") and dropped,
        # and the run would go on as if never stopped, its outputs kept: the signal comes
        # again once the finalizer has returned, to this same handler.
        threading.Timer(_REDELIVER_S, os.kill, (os.getpid(), signum)).start()
        return
    for sig in _HANDLED:
        signal.signal(sig, _already_stopping)
    # mgpu says what it does about it in one line; Dask's own account of the teardown that
    # follows (a scheduler here logging its workers' streams closing) would print with it.
    # A filter on the handlers too: a cluster stopped while it starts puts back its handlers'
    # levels, not their filters.
    distributed = logging.getLogger("distributed")
    distributed.setLevel(logging.CRITICAL)
    for handler in distributed.handlers:
        handler.addFilter(lambda record: False)
    raise Interrupted(signum)


@contextlib.contextmanager
def cancel_on_signals() -> Iterator[None]:
    """Inside the block, SIGINT and SIGTERM raise :class:`Interrupted` (once); the handlers
    that were there before are put back after it. Outside the main thread, does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in _HANDLED}
    for sig in _HANDLED:
        signal.signal(sig, _interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM off while the block runs (closing a cluster); one that
    arrives meanwhile is delivered again, to the handler before, once the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in _HANDLED}
    for sig in _HANDLED:
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


def _exit_now(signum: int, frame: Any) -> None:
    # Nothing is started yet (imports, reading the job files): nothing to clean up.
    print(f"mgpu: interrupted ({signal.Signals(signum).name}) before anything started", file=sys.stderr)
    os._exit(128 + signum)


def exit_on_signals_while_starting() -> None:
    """In the ``mgpu`` command, from its first import: Ctrl-C or SIGTERM ends it at once with
    one line and exit 130/143 (no traceback) until a run installs :func:`cancel_on_signals`.

    Only for the command: imported as a library, mgpu leaves the signals to its caller.
    """
    from .lifetime import is_command

    if not is_command():
        return
    if threading.current_thread() is threading.main_thread():
        for sig in _HANDLED:
            signal.signal(sig, _exit_now)


def dask_setup(worker: Any) -> None:
    """Preload of a worker process of a cluster mgpu starts: leave Ctrl-C to mgpu, and keep
    Dask's notes on the worker's connections (streams opened and closed) out of the
    terminal mgpu writes to; its warnings and errors still print."""
    logging.getLogger("distributed").setLevel(logging.WARNING)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
