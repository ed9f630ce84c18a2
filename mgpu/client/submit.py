"""Place a plan's panels and tiles on the workers and collect the tiles' records.

Placement is the plan's: static tiles go to their worker, dynamic ones to whichever worker
has room; the steps of a stepped plan go to their tile's worker (:mod:`mgpu.client.steps`).
Only small records come back; inputs are made or read by the workers.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from typing import Any

from distributed import wait

from .. import config
from ..errors import JobFailed
from ..results import Recovery
from ..tiling import Plan, Tile
from ..worker.tasks import end_job, make_panel, run_tile, warmup
from ..workloads.base import TileRecord, Workload
from .recover import TileTracker, silent_workers
from .steps import SteppedRun

__all__ = ["panel_priorities", "run_plan", "tile_places", "warm_up"]

# Tiles queued on each worker under dynamic placement, beyond those running at once: two,
# so a worker never waits for the client's round trip between short tiles.
_DYNAMIC_AHEAD = 2


def warm_up(
    client: Any,
    workload: Workload,
    tile: Tile,
    workers: list[str],
    resources: dict[str, float] | None = None,
    *,
    deadline_s: float | None = None,
    retire: Callable[[str], None] = lambda worker: None,
) -> None:
    """Run each worker's warm-up once before the timed tiles (compiles kernels, makes handles);
    ``tile`` is one of the plan's, whose size and args the warm-up follows. A worker whose
    warm-up has not ended within ``deadline_s`` and that the scheduler no longer hears
    from is stuck: ``retire`` takes it out (its tiles then go to the others, as a lost
    worker's do). One still heard from is given up to ``mgpu.recovery.tile-deadline-heard``.

    Raises
    ------
    JobFailed
        If the warm-ups have not ended within ``deadline_s`` of the stuck workers' retiring.
    """
    # Loosely placed: a worker lost meanwhile must not leave its warm-up waiting forever.
    futures = [
        client.submit(
            warmup,
            workload,
            tile,
            key=f"{workload.name}-warmup-{i}-{uuid.uuid4().hex[:6]}",
            workers=[w],
            allow_other_workers=True,
            pure=False,
            resources=resources,
        )
        for i, w in enumerate(workers)
    ]
    patience = max(deadline_s or 0.0, config.load().recovery.tile_deadline_heard)
    waited = 0.0
    while not _ended(futures, deadline_s):
        waited += deadline_s or 0.0
        pending = [w for w, f in zip(workers, futures, strict=True) if not f.done()]
        stuck = silent_workers(client, pending) if waited < patience else set(pending)
        if not stuck:
            continue  # slow, not stuck: heard from
        for worker in sorted(stuck):
            retire(worker)
        # Loosely placed: the retired workers' warm-ups run on the others.
        if not _ended(futures, deadline_s):
            left = [w for w, f in zip(workers, futures, strict=True) if not f.done()]
            raise JobFailed(f"the warm-up did not end within {waited + (deadline_s or 0):.0f} s on {', '.join(left)}")
        break
    client.gather(futures)


def _ended(futures: list[Any], timeout: float | None) -> bool:
    """Whether every future ended (done, failed or cancelled) within ``timeout`` seconds."""
    try:
        wait(futures, timeout=timeout)
    except TimeoutError:
        return False
    return True


def tile_places(plan: Plan) -> dict[int, int]:
    """Each tile's place in its worker's order (for tiles placed dynamically, in the plan's)."""
    places: dict[int, int] = {}
    counts: dict[str | None, int] = defaultdict(int)
    for t in plan.tiles:
        worker = t.worker if plan.placement == "static" else None
        places[t.index] = counts[worker]
        counts[worker] += 1
    return places


def panel_priorities(plan: Plan) -> dict[str, int]:
    """Each panel's Dask priority (higher runs first): minus the earliest place (see
    :func:`tile_places`) of a tile that reads it, as each tile's own is minus its place.
    A panel that another worker reads early is not put ahead of what its own worker's
    first tiles need."""
    places = tile_places(plan)
    first: dict[str, int] = {}
    for t in plan.tiles:
        for name in t.needs:
            first[name] = min(first.get(name, places[t.index]), places[t.index])
    return {p.name: -first.get(p.name, len(plan.tiles)) for p in plan.panels}


# How long releasing a job's buffers on every worker may take (after Ctrl-C: the user waits):
# a stuck worker (one that never answers) must not keep a job from ending.
_RELEASE_S = {False: 10.0, True: 1.0}


def _on_every_worker(client: Any, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` on every worker the scheduler has; one that does not answer in time is left be."""
    interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
    with contextlib.suppress(Exception):
        client.run(fn, *args, on_error="ignore", callback_timeout=_RELEASE_S[interrupted])


def run_plan(
    client: Any,
    workload: Workload,
    plan: Plan,
    on_done: Callable[[TileRecord], None] = lambda r: None,
    recovery: Recovery | None = None,
    on_lost: Callable[..., None] = lambda w, t, step=None: None,
    resources: dict[str, float] | None = None,
    panel_records: list[TileRecord] | None = None,
    devices: Mapping[str, str] | None = None,
    deadline_s: float | None = None,
    retire: Callable[[str], None] = lambda worker: None,
) -> list[TileRecord]:
    """Submit every tile where the plan places it and gather the records.

    The plan's panels are made first, each on its worker; a tile waits for the panels it
    reads. Static tiles go to their worker; dynamic ones are fed to whichever worker has
    room, as many as run at once plus ``_DYNAMIC_AHEAD``, so fast workers take more.
    ``resources`` is what each tile task asks of its worker (ClusterInfo.tile_resources).
    Tiles of a worker that is lost go to the workers that remain (see
    :class:`~mgpu.client.recover.TileTracker`; a stepped plan's tiles all step again from a
    checkpoint, see :class:`~mgpu.client.steps.SteppedRun`), and ``on_lost`` is called with
    the worker, its tiles and that step; ``recovery``, if given, receives the lost workers,
    the recomputed tiles and the steps resumed from; ``panel_records``, if
    given, the records of the panels' making (their time and bytes belong to the job);
    ``devices`` (worker address -> its physical device) tells which workers share a GPU.
    A worker that finishes no tile for ``deadline_s`` is stuck: ``retire`` takes it out and
    its tiles go to the others (see :class:`~mgpu.client.recover.TileTracker`).

    Raises
    ------
    JobFailed
        If a tile's task raised, or every worker was lost; the other tiles are cancelled.
    """
    token = uuid.uuid4().hex[:6]
    prefix = f"{workload.name}-tile"
    # Loosely placed like the warm-up: a panel whose worker is lost is made again elsewhere.
    # Dask gives tasks submitted within 100 ms one priority, and a worker runs those in the
    # order they become ready: the priorities make it run its tiles in plan order, each as
    # soon as its panels are there. The panels take no tile slot and go one after another on
    # their worker (each depends on the one before), in the order the tiles read them: the
    # next tiles' panels are read while the first tiles multiply, and each read has the
    # worker's host threads to itself.
    priorities, places = panel_priorities(plan), tile_places(plan)
    panel_futures: dict[str, Any] = {}
    last_on: dict[str, Any] = {}
    for p in sorted(plan.panels, key=lambda p: -priorities[p.name]):
        panel_futures[p.name] = last_on[p.worker] = client.submit(
            make_panel,
            workload,
            p,
            token,
            last_on.get(p.worker),
            key=f"{workload.name}-panel-{p.name}-{token}",
            workers=[p.worker],
            allow_other_workers=True,
            pure=False,
            priority=priorities[p.name],
        )

    steps = None
    if plan.steps > 1:
        every = config.load().recovery.checkpoint_steps
        steps = SteppedRun(client, workload, plan, token, resources, devices or {}, every)
        steps.start()

    def submit(tile: Tile, worker: str | None, attempt: int) -> Any:
        again = f"-r{attempt}" if attempt else ""
        needs = {name: panel_futures[name] for name in tile.needs}
        return client.submit(
            run_tile,
            workload,
            tile,
            needs or None,
            steps.token if steps else token,  # a stepped tile's context is under its steps' token
            steps.last.get(tile.index) if steps else None,
            key=f"{prefix}-{tile.index}-{token}{again}",
            workers=[worker] if worker else None,
            allow_other_workers=False,
            pure=False,
            resources=resources,
            priority=-places[tile.index],
        )

    records: list[TileRecord] = []
    pending: deque[Tile] = deque()

    def lost(worker: str, tiles: list[int]) -> None:
        if steps is not None and steps.resumed_from:
            on_lost(worker, tiles, steps.resumed_from[-1])
        else:
            on_lost(worker, tiles)

    regroup = steps.regroup if steps else None
    # The workers the job found (``devices``), or else the scheduler's.
    workers = list(devices) if devices else list(client.scheduler_info(n_workers=-1)["workers"])
    tracker = TileTracker(client, submit, lost, deadline_s=deadline_s, retire=retire, regroup=regroup, workers=workers)
    try:
        if plan.placement == "static":
            for t in plan.tiles:
                tracker.submit(t, t.worker)
        else:
            pending.extend(plan.tiles)
            for _ in range(workload.concurrency + _DYNAMIC_AHEAD):
                for w in workers:
                    if pending:
                        tracker.submit(pending.popleft(), w)
        for _tile, worker, record in tracker.results():
            records.append(record)
            on_done(record)
            if pending:
                tracker.submit(pending.popleft(), worker)
        if panel_records is not None and panel_futures:
            panel_records.extend(ref.record for ref in client.gather(list(panel_futures.values())) if ref.record)
    finally:
        tracker.cancel()
        if steps:
            steps.cancel()
        if panel_futures:
            client.cancel(list(panel_futures.values()))
        if steps or panel_futures:
            # Every tile has ended: each worker closes what it opened of the others' (panels,
            # exchange buffers) and drops its stepped tiles, then (once all have) frees its own.
            tokens = steps.tokens if steps else [token]
            for stage in ("close", "free"):
                for each in tokens:
                    _on_every_worker(client, end_job, each, stage)
        if recovery is not None:
            recovery.lost_workers = tracker.lost_workers
            recovery.recomputed_tiles = sorted(tracker.recomputed_tiles)
            recovery.resumed_from_steps = list(steps.resumed_from) if steps else []
            recovery.processes = dict(tracker.processes)
    return records
