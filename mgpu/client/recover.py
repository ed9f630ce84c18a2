"""Tiles in flight, and what happens to them when a worker is lost.

Static placement restricts each tile to one worker. If that worker dies, Dask keeps its
tasks waiting for it forever, so the tracker asks the scheduler which workers remain and
resubmits the lost worker's tiles to them. Inputs are deterministic (a pure function of
seed and position), so a tile recomputed elsewhere gives the same answer, and it writes
the same block of any output again.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from distributed import CancelledError
from distributed import TimeoutError as DaskTimeoutError

from .. import config
from ..errors import JobFailed, JobInputError
from ..tiling import Tile

__all__ = ["TileTracker"]

# How often the scheduler is asked which workers remain, and how long the client waits for
# one record before asking again (its data may have gone with its worker).
_CHECK_S = 1.0
_FETCH_S = 5.0


def task_failure(key: str, worker: str | None, error: BaseException) -> str:
    """The one message for a task that raised: its cause first where mgpu knows it."""
    where = worker or "a worker"
    name = type(error).__name__
    if name == "InputChanged":
        return f"{error} (seen by {key} on {where})"
    if isinstance(error, MemoryError) or name == "OutOfMemoryError" or "out_of_memory" in str(error):
        return (
            f"{key} ran out of memory on {where} ({name}: {error}); with cluster.spill: none nothing takes "
            "a tile's excess: make tiles smaller (tiling), lower cluster.memory_limit to leave the device "
            "more room, or use spill: managed (on a CPU worker: raise the process's memory limit)"
        )
    return f"{key} failed on {where}: {name}: {error}"


@dataclass
class _InFlight:
    tile: Tile
    worker: str | None
    future: Any


@dataclass
class TileTracker:
    """Submit tiles, yield their records as they finish, and resubmit those of lost workers.

    Parameters
    ----------
    client
        The connected ``distributed.Client``.
    submit
        ``submit(tile, worker, attempt)`` -> a future of the tile's record, restricted to
        ``worker`` (``attempt`` makes the key of a resubmitted tile new).
    on_lost
        Called with a lost worker's address and the indices of the tiles resubmitted.
    """

    client: Any
    submit_task: Callable[[Tile, str | None, int], Any]
    on_lost: Callable[[str, list[int]], None] = lambda worker, tiles: None
    lost_workers: list[str] = field(default_factory=list)
    recomputed_tiles: list[int] = field(default_factory=list)
    _in_flight: dict[str, _InFlight] = field(default_factory=dict)
    _done: queue.Queue = field(default_factory=queue.Queue)
    _known: set[str] = field(default_factory=set)
    _last_check: float = field(default_factory=time.monotonic)
    _no_workers_since: float | None = None

    def __post_init__(self) -> None:
        self._known = set(self._workers())
        # A worker that is restarted (by its nanny) or replaced takes a few seconds to join.
        self._patience = config.load().recovery.wait_for_workers

    def submit(self, tile: Tile, worker: str | None, attempt: int = 0) -> None:
        fut = self.submit_task(tile, worker, attempt)
        self._in_flight[fut.key] = _InFlight(tile, worker, fut)
        fut.add_done_callback(self._done.put)

    def results(self) -> Iterator[tuple[Tile, str | None, Any]]:
        """Yield ``(tile, worker, record)`` as tiles finish, until none is in flight.

        Raises
        ------
        JobFailed
            If a tile's task raised, or no worker has been left for ``mgpu.recovery.wait-for-workers``.
        """
        while self._in_flight:
            try:
                fut = self._done.get(timeout=_CHECK_S)
            except queue.Empty:
                fut = None
            entry = self._in_flight.get(fut.key) if fut is not None else None
            if entry is not None and entry.future is fut:
                record = self._record(entry)
                if record is not None:
                    del self._in_flight[fut.key]
                    yield entry.tile, entry.worker, record
            if time.monotonic() - self._last_check >= _CHECK_S:
                self.check_workers()

    def cancel(self) -> None:
        """Cancel every tile still in flight (on failure, or when mgpu is interrupted)."""
        futures = [e.future for e in self._in_flight.values()]
        self._in_flight.clear()
        if futures:
            self.client.cancel(futures)

    def _record(self, entry: _InFlight) -> Any:
        try:
            return entry.future.result(timeout=_FETCH_S)
        except DaskTimeoutError:
            # Finished, but its record is not reachable: its worker may just have died.
            # Look again after the next check (which resubmits it if so).
            self._done.put(entry.future)
            return None
        except CancelledError as e:
            raise JobFailed(f"{entry.future.key} was cancelled (was the scheduler lost?): {e}") from e
        except Exception as e:
            if type(e).__name__ == "StoreUnreadable":  # a bad input, found only as it is read
                raise JobInputError(f"{e}; nothing was kept") from e
            raise JobFailed(task_failure(entry.future.key, entry.worker, e)) from e

    def _workers(self) -> list[str]:
        try:
            # Asked of the scheduler each time: Client.scheduler_info returns a cache that its
            # periodic refresh (totals only, "workers" empty) may have just replaced, and in
            # a job of more than a few seconds every worker then looked lost.
            return sorted(self.client.sync(self.client.scheduler.identity, n_workers=-1)["workers"])
        except Exception as e:
            raise JobFailed(f"lost the scheduler: {type(e).__name__}: {e}") from e

    def check_workers(self) -> None:
        """Ask the scheduler which workers remain; resubmit tiles placed on any that left."""
        self._last_check = time.monotonic()
        live = self._workers()
        for worker in sorted(self._known - set(live)):
            self.lost_workers.append(worker)
        self._known = set(live)
        if not live and self._in_flight:
            since = self._no_workers_since = self._no_workers_since or self._last_check
            if self._last_check - since >= self._patience:
                raise JobFailed(
                    f"every worker was lost ({', '.join(self.lost_workers) or 'none left'}) and none joined "
                    f"within {self._patience:g} s; {len(self._in_flight)} tile(s) unfinished"
                )
            return
        self._no_workers_since = None
        stranded = [e for e in self._in_flight.values() if e.worker is not None and e.worker not in self._known]
        if not stranded:
            return
        self.client.cancel([e.future for e in stranded])
        by_worker: dict[str, list[int]] = {}
        for i, e in enumerate(stranded):
            del self._in_flight[e.future.key]
            by_worker.setdefault(e.worker, []).append(e.tile.index)  # type: ignore[arg-type]
            self.recomputed_tiles.append(e.tile.index)
            # Spread the stranded tiles over the survivors, keeping each restricted to one.
            self.submit(e.tile, live[i % len(live)], attempt=self.recomputed_tiles.count(e.tile.index))
        for worker, tiles in by_worker.items():
            self.on_lost(worker, sorted(tiles))
