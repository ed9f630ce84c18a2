"""What the streamed schedule runs beside its products: the threads that write each
finished piece of C into the output, and the summary of where a tile's time went.

The timeline (:func:`timeline`) splits a tile's span, on the worker's clock, into the
first load (from the task's start to its first product), the products (their device
time), the idle time between them (the device waiting for a load or for the task's
thread) and the write tail (from the last product's end to the last piece written): the
parts add up to the span, so the next gap shows in the record without a profiler.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

__all__ = ["Writers", "timeline"]


class Writers:
    """``count`` threads that run the write jobs given to them, in the order given.

    A failure in a job is appended to ``failed`` (shared with the task's other threads,
    whose waits it ends) and the later jobs are skipped. :meth:`drain` waits until every
    job given so far has ended; :meth:`close` stops the threads.
    """

    def __init__(self, count: int, failed: list[BaseException]) -> None:
        self.failed = failed
        self.pieces = 0  # jobs run
        self.busy_s = 0.0  # seconds while at least one job ran
        self.last_end = 0.0  # time.perf_counter() as the last job ended
        self._running = 0
        self._since = 0.0
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._pending = 0
        self._done = threading.Condition()
        self._threads = [
            threading.Thread(target=self._work, daemon=True, name=f"mgpu-stream-writer-{i}") for i in range(count)
        ]

    def start(self) -> None:
        for th in self._threads:
            th.start()

    def put(self, job: Callable[[], None]) -> None:
        with self._done:
            self._pending += 1
        self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._done:
                if not self._running:
                    self._since = time.perf_counter()
                self._running += 1
            try:
                if not self.failed:
                    job()
            except BaseException as e:  # raised again by the task's thread
                self.failed.append(e)
            finally:
                end = time.perf_counter()
                with self._done:
                    self._running -= 1
                    if not self._running:
                        self.busy_s += end - self._since
                    self._pending -= 1
                    self.pieces += 1
                    self.last_end = max(self.last_end, end)
                    self._done.notify_all()

    def drain(self) -> None:
        """Wait until every job given so far has ended; raise the first failure if any."""
        with self._done:
            while self._pending and not self.failed:
                self._done.wait(0.2)
        if self.failed:
            raise self.failed[0]

    def close(self, timeout: float | None = None) -> None:
        """Let the threads end once the jobs given have run (or been skipped), and wait."""
        for _ in self._threads:
            self._jobs.put(None)
        for th in self._threads:
            if th.is_alive() or th.ident is not None:
                th.join(timeout)


def timeline(
    start: float, first: float, products_end: float, end: float, products_s: float, writes: Writers | None = None
) -> dict[str, float]:
    """Where a streamed tile's time went, in seconds (``time.perf_counter()`` readings in).

    ``start``: the task began; ``first``: its first product was enqueued (its inputs
    were in); ``products_end``: the last product had run; ``end``: the last piece of C
    was written. ``products_s`` is the products' device time. ``first_load_s``,
    ``products_s``, ``idle_s`` and ``write_tail_s`` add up to ``span_s``; ``writes_s``
    (the time while at least one writer wrote) and ``pieces`` (the jobs the writers ran)
    say how much writing the products hid.
    """
    between = max(0.0, products_end - first)
    products = min(products_s, between)
    out = {
        "span_s": max(0.0, end - start),
        "first_load_s": max(0.0, first - start),
        "products_s": products,
        "idle_s": between - products,
        "write_tail_s": max(0.0, end - max(products_end, first)),
    }
    if writes is not None:
        out["writes_s"] = writes.busy_s
        out["pieces"] = float(writes.pieces)
    return out
