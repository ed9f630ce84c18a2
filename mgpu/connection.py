"""A client's connection to the scheduler, without the waits Dask's defaults put in a
short job's way: the connection to a running cluster (or the version report a new client
sends) is made ahead, on a thread of its own, while the jobs are checked; and what the
client sends goes out as it comes rather than in 10 ms batches."""

from __future__ import annotations

import atexit
import contextlib
import functools
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["PROMPT_S", "ahead", "connect_ahead", "forget_ahead", "read_versions_ahead", "send_promptly", "take_ahead"]

# How long a client holds a message to the scheduler to batch it with those that follow:
# what a Dask worker's stream to a client waits (distributed.worker), not the client's
# own 10 ms, which a job's first tiles, sent within 10 ms of the client's last message
# (its connecting, the previous job's keys released), waited out.
PROMPT_S = 0.001


def read_versions_ahead() -> threading.Thread | None:
    """Read the versions a new Dask client reports to the scheduler as it connects
    (``distributed.versions.get_versions``: a ``uname -p`` process and the packages'
    metadata, ~10 ms on its first call) on a thread of its own, so that connecting later
    finds them read. Returns the thread, or None where Dask's client is not imported yet:
    importing it on a second thread while this one imports could leave a module half made.

    Call it from a thread that is importing nothing at the moment (the main thread between
    steps): then a module it finds imported is whole.
    """
    if "distributed.versions" not in sys.modules:
        return None
    from distributed.versions import get_versions  # imported already: nothing runs

    reader = threading.Thread(target=get_versions, name="mgpu-dask-versions", daemon=True)
    reader.start()
    return reader


# How long the process, ending, waits for a connection begun ahead that no job took.
_UNTAKEN_S = 2.0
# The interpreter's switch interval while a connection is made ahead (see connect_ahead).
_SWITCH_S = 0.0002


def ahead(address: str | None, name: str | None = None) -> None:
    """What joining a cluster takes, begun now on threads of their own: the versions a new
    client reports (:func:`read_versions_ahead`) and, given ``address``, the connection to
    the scheduler there (no TLS; see :func:`connect_ahead`), which reports them once
    connected. Dask's client, which the jobs need in any case, is imported first, on this
    thread: call it from the main thread between steps, not while it imports. ``name`` goes
    into the client's id (as Dask's ``client-name`` does)."""
    import distributed.client  # noqa: F401

    read_versions_ahead()
    if address is not None:
        connect_ahead(address, name)


def connect_ahead(address: str, name: str | None = None) -> threading.Thread | None:
    """Begin connecting a client to the scheduler at ``address`` (no TLS) on a thread of
    its own, for :func:`take_ahead` to hand to the job that joins it: the connection is
    made while the jobs are checked. Returns the thread, or None where Dask's client is
    not imported yet (see :func:`read_versions_ahead`: call it as that is called).

    The client is not Dask's default client. One that no job takes is closed as the
    process ends.
    """
    if "distributed.client" not in sys.modules:
        return None
    pending = _ahead().pending
    if address not in pending:
        pending[address] = _Connection(address, name)
    return pending[address].thread


def forget_ahead(address: str) -> None:
    """Close the client :func:`connect_ahead` began connecting to ``address``, unused (a job
    that joins it then connects anew)."""
    connection = _ahead().pending.pop(address, None)
    if connection is not None:
        connection.close(_UNTAKEN_S)


def take_ahead(address: str) -> Client | None:
    """The client :func:`connect_ahead` began connecting to ``address``, once connected;
    None if none was begun (or it was taken already).

    Raises
    ------
    OSError, TimeoutError
        As ``distributed.Client(address)`` does, where the connection failed.
    """
    connection = _ahead().pending.pop(address, None)
    return None if connection is None else connection.take()


class _Connection:
    """A client connecting to the scheduler at one address on a thread of its own."""

    def __init__(self, address: str, name: str | None = None) -> None:
        # The event loop a first client starts needs this module: imported here, not there.
        import tornado.platform.asyncio  # noqa: F401
        from distributed import Client

        self.client: Client | None = None
        self.error: BaseException | None = None
        # Connecting takes many short steps on this thread and the client's event loop, each
        # waiting for the interpreter's lock while the first thread imports: taken from it
        # every 5 ms by default, connecting took ~50 ms, past when the job needed it.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(_SWITCH_S)

        def connect() -> None:
            try:
                self.client = Client(address, set_as_default=False, name=name)
            except BaseException as e:  # raised to the job that takes it, as connecting then would
                self.error = e
            finally:
                sys.setswitchinterval(switch)

        self.thread = threading.Thread(target=connect, name="mgpu-connect", daemon=True)
        self.thread.start()

    def take(self) -> Client:
        """The client, once connected (raising what connecting raised)."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.client is not None
        return self.client

    def close(self, timeout: float) -> None:
        """Close the client, once connected (waiting ``timeout`` at most for that)."""
        self.thread.join(timeout)
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close(timeout=timeout)


class _Ahead:
    """The connections this process began ahead that no job took yet, by address; those
    left as the process ends (its jobs failed their checks) are closed."""

    def __init__(self) -> None:
        self.pending: dict[str, _Connection] = {}
        atexit.register(self.close)

    def close(self) -> None:
        while self.pending:
            _, connection = self.pending.popitem()
            connection.close(_UNTAKEN_S)


@functools.cache
def _ahead() -> _Ahead:
    """This process's connections begun ahead: one record of them, made when first needed."""
    return _Ahead()


def send_promptly(client: Client) -> None:
    """Have ``client`` send each message to the scheduler within :data:`PROMPT_S`, the one
    held back now too (a Client batches its messages, tiles submitted included, and sends
    at most every 10 ms). A client that reconnects batches as Dask does again."""
    from distributed.metrics import time

    async def shorten() -> None:
        comm = client.scheduler_comm  # the BatchedSend to the scheduler; None once closed
        if comm is None:
            return
        comm.interval = min(comm.interval, PROMPT_S)
        if comm.next_deadline is not None:
            comm.next_deadline = min(comm.next_deadline, time() + PROMPT_S)
            comm.waker.set()  # a message waiting for the old deadline goes by the new one

    client.sync(shorten)
