"""A client's connection to the scheduler, without the waits Dask's defaults put in a
short job's way: the version report a new client sends is read ahead, on a thread of its
own, and what the client sends goes out as it comes rather than in 10 ms batches."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["PROMPT_S", "read_versions_ahead", "send_promptly"]

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
