"""Ctrl-C and SIGTERM end a run the same clean way.

SIGINT raises KeyboardInterrupt in the main thread; SIGTERM (what ``kill``, Slurm and
container runtimes send) is made to raise it too, so that one path unwinds both: the
runner cancels the job's tasks, the cluster mgpu started is closed, and the outputs'
temporary files are removed. A second signal while that runs is ignored, so the cleanup
itself is not cut short (SIGKILL still ends everything at once).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Iterator

__all__ = ["Interrupted", "cancel_on_signals"]

_HANDLED = (signal.SIGINT, signal.SIGTERM)


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


def _interrupt(signum: int, frame: Any) -> None:
    for sig in _HANDLED:
        signal.signal(sig, _already_stopping)
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
