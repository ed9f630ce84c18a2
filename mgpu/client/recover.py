"""Tiles in flight, and what happens to them when a worker is lost.

Static placement restricts each tile to one worker. If that worker dies, Dask keeps its
tasks waiting for it forever, so the tracker asks the scheduler which workers remain and
resubmits the lost worker's tiles to them. Inputs are deterministic (a pure function of
seed and position), so a tile recomputed elsewhere gives the same answer, and it writes
the same block of any output again.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
from distributed import CancelledError
from distributed import TimeoutError as DaskTimeoutError

from .. import config
from ..errors import JobFailed, JobInputError
from ..tiling import Tile

__all__ = ["TileTracker", "retire_worker", "silent_workers"]

# How often the scheduler is asked which workers remain, and how long the client waits for
# one record before asking again (its data may have gone with its worker).
_CHECK_S = 1.0
_FETCH_S = 5.0
# A worker heard from (its heartbeat) within this many of its heartbeat intervals, plus
# _HEARD_S, is alive: a tile past its deadline there is slow (its estimate left something
# out, such as decompressing its inputs), not stuck, and keeps running up to
# mgpu.recovery.tile-deadline-heard. The window (7 s for up to 10 workers) is shorter than
# the deadline's floor, so a stopped worker is found as the floor passes.
_HEARTBEATS, _HEARD_S = 10, 2.0


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


def _remove(address: str, dask_scheduler: Any = None) -> int | None:
    """On the scheduler: forget a stuck worker (its tasks go back to waiting); its pid."""
    ws = dask_scheduler.workers.get(address)
    if ws is None:
        return None
    pid = ws.pid
    dask_scheduler.loop.add_callback(dask_scheduler.remove_worker, address, stimulus_id="mgpu-stuck", close=True)
    return int(pid) if pid else None


def _heard_from(addresses: list[str], dask_scheduler: Any = None) -> list[str]:
    """Of ``addresses``, the workers whose last heartbeat reached the scheduler within
    ``_HEARTBEATS`` of their intervals (run on the scheduler). A stopped process sends none."""
    from distributed.metrics import time as now
    from distributed.scheduler import heartbeat_interval

    window = _HEARTBEATS * heartbeat_interval(len(dask_scheduler.workers)) + _HEARD_S
    workers = dask_scheduler.workers
    return [a for a in addresses if a in workers and now() - workers[a].last_seen < window]


def silent_workers(client: Any, addresses: list[str]) -> set[str]:
    """Of ``addresses``, the workers the scheduler has not heard from lately (stopped or
    frozen, or gone); all of them where the scheduler cannot say."""
    if not addresses:
        return set()
    try:
        heard = client.run_on_scheduler(_heard_from, addresses, callback_timeout=_FETCH_S)
    except Exception:
        return set(addresses)
    return set(addresses) - set(heard)


def retire_worker(client: Any, address: str, *, ours: bool) -> None:
    """Take a stuck worker out of the cluster: the scheduler forgets it, and a worker
    process of a cluster mgpu started (a child of this process) is killed, so that closing
    the cluster does not wait on it. Never raises: a worker already gone is retired."""
    try:
        pid = client.run_on_scheduler(_remove, address, callback_timeout=10)
    except Exception:
        return
    if ours and pid:
        # Its nanny starts another in its place, with a warning meant for Dask's own users.
        logging.getLogger("distributed.nanny").setLevel(logging.ERROR)
        try:
            children = {p.pid for p in psutil.Process().children(recursive=True)}
            if pid in children:
                os.kill(pid, signal.SIGKILL)
        except (OSError, psutil.Error):
            pass


@dataclass
class _InFlight:
    tile: Tile
    worker: str | None
    future: Any
    since: float = field(default_factory=time.monotonic)  # when it was submitted


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
    deadline_s
        How long a worker with tiles in flight may go without finishing one (from its last
        finished tile, or its first tile's submission) before it is taken as stuck; None: never.
        A worker whose heartbeats still come is given up to ``alive_deadline_s`` instead.
    alive_deadline_s
        The same for a worker still heard from (by default
        ``mgpu.recovery.tile-deadline-heard``).
    retire
        Called with a stuck worker's address to take it out of the cluster (it is then lost).
    regroup
        For tiles that wait on one another (a stepped plan's): called with the workers left
        once one is lost, it submits what the tiles wait on again and returns each tile's
        worker; every tile in flight is then resubmitted there, not the lost worker's alone.
    workers
        The workers there are as the tiles start, where the client knows them already (the
        job found them); by default the scheduler is asked.
    """

    client: Any
    submit_task: Callable[[Tile, str | None, int], Any]
    on_lost: Callable[[str, list[int]], None] = lambda worker, tiles: None
    deadline_s: float | None = None
    alive_deadline_s: float = field(default_factory=lambda: config.load().recovery.tile_deadline_heard)
    retire: Callable[[str], None] = lambda worker: None
    regroup: Callable[[list[str]], dict[int, str] | None] | None = None
    workers: Collection[str] | None = None
    lost_workers: list[str] = field(default_factory=list)
    stuck_workers: list[str] = field(default_factory=list)
    # The process ("host:pid", as tile records name it) of each worker that finished a tile -> its address.
    processes: dict[str, str] = field(default_factory=dict)
    recomputed_tiles: list[int] = field(default_factory=list)
    _in_flight: dict[str, _InFlight] = field(default_factory=dict)
    _done: queue.Queue = field(default_factory=queue.Queue)
    _known: set[str] = field(default_factory=set)
    _last_check: float = field(default_factory=time.monotonic)
    _no_workers_since: float | None = None
    _progress: dict[str, float] = field(default_factory=dict)  # worker -> when it last finished a tile
    _rounds: int = 0  # how many times the tiles were regrouped

    def __post_init__(self) -> None:
        self._known = set(self._workers() if self.workers is None else self.workers)
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
                    if entry.worker is not None:
                        self._progress[entry.worker] = time.monotonic()
                        self.processes[getattr(record, "worker", "")] = entry.worker
                    yield entry.tile, entry.worker, record
            if time.monotonic() - self._last_check >= _CHECK_S:
                self.check_workers()
                self.check_deadlines()

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

    def check_deadlines(self) -> None:
        """Retire a worker that has finished none of its tiles within the deadline; its
        tiles go to the others as a lost worker's do.

        Raises
        ------
        JobFailed
            If no other worker is left to take its tiles.
        """
        if self.deadline_s is None:
            return
        now = time.monotonic()
        waiting: dict[str, float] = {}
        for e in self._in_flight.values():
            if e.worker is not None:
                waiting[e.worker] = min(waiting.get(e.worker, e.since), e.since)
        quiet = {w: now - max(first, self._progress.get(w, first)) for w, first in waiting.items()}
        overdue = sorted(w for w, q in quiet.items() if q >= self.deadline_s)
        if not overdue:
            return
        alive = set(overdue) - silent_workers(self.client, overdue)
        for worker in overdue:
            if worker in alive and quiet[worker] < max(self.alive_deadline_s, self.deadline_s):
                continue  # slow, not stuck: it still answers
            others = [w for w in self._known if w != worker and w not in self.stuck_workers]
            if not others:
                raise JobFailed(
                    f"worker {worker} finished no tile for {quiet[worker]:.0f} s, past its tiles' deadline of "
                    f"{self.deadline_s if worker not in alive else self.alive_deadline_s:.0f} s "
                    "(it may be hung or stopped), and no other worker is left to take them"
                )
            self.stuck_workers.append(worker)
            self.retire(worker)
            self.check_workers(gone={worker})

    def check_workers(self, gone: set[str] | None = None) -> None:
        """Ask the scheduler which workers remain (less ``gone``, retired here); resubmit
        tiles placed on any that left (with ``regroup``: every tile in flight, once a
        worker of theirs left)."""
        self._last_check = time.monotonic()
        live = [w for w in self._workers() if w not in (gone or set()) and w not in self.stuck_workers]
        left = self._known - set(live)
        self.lost_workers.extend(sorted(left))
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
        placement = self.regroup(live) if self.regroup is not None and self._in_flight and (left or stranded) else None
        if not stranded and placement is None:
            return
        by_worker: dict[str, list[int]] = {}
        for e in stranded:
            by_worker.setdefault(e.worker, []).append(e.tile.index)  # type: ignore[arg-type]
            self.recomputed_tiles.append(e.tile.index)
        if placement is not None:  # the tiles wait on one another: all go again
            moved = list(self._in_flight.values())
            self.client.cancel([e.future for e in moved])
            self._in_flight.clear()
            self._rounds += 1
            for e in moved:
                self.submit(e.tile, placement[e.tile.index], attempt=self._rounds)
        else:
            self.client.cancel([e.future for e in stranded])
            for i, e in enumerate(stranded):
                del self._in_flight[e.future.key]
                # Spread the stranded tiles over the survivors, keeping each restricted to one.
                self.submit(e.tile, live[i % len(live)], attempt=self.recomputed_tiles.count(e.tile.index))
        for worker, tiles in by_worker.items():
            self.on_lost(worker, sorted(tiles))
