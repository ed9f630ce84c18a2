"""Run a validated Job: resolve the cluster, plan, place every tile, collect, check, report.

Only small records come back to the client; inputs are made or read by the workers and
outputs written by them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from . import alloc_stats, transfer
from . import device as _device
from .cluster import ClusterInfo, describe_workers, open_cluster, resolve_cluster, scheduler_address
from .errors import JobFailed, JobInputError
from .panels import PanelRef, close_remotes
from .panels import release as release_panels
from .planner import Panel, Plan, Tile, check_tiling_keys
from .recovery import TileTracker
from .results import Recovery, Result, Startup, build_result
from .roofline import ceilings_for
from .security import check_tls
from .spec import Job, check_one_cluster
from .workloads import get_workload_class
from .workloads.base import TileRecord, Workload, injected_delay

__all__ = ["run_job", "run_jobs", "run_plan"]

# Tiles queued on each worker under dynamic placement, beyond those running at once: two,
# so a worker never waits for the client's round trip between short tiles.
_DYNAMIC_AHEAD = 2


class Events:
    """What the runner tells whoever watches (the CLI's messages and progress bar)."""

    def cluster_ready(self, info: ClusterInfo) -> None: ...

    def planned(self, plan: Plan) -> None: ...

    def tile_done(self, record: TileRecord) -> None: ...

    def panels_made(self, records: list[TileRecord]) -> None:
        """Every tile has ended; ``records`` are the makings of the plan's panels (if any)."""

    def worker_lost(self, worker: str, tiles: list[int]) -> None: ...

    def job_started(self, index: int, job: Job) -> None: ...

    def job_done(self, result: Result) -> None: ...

    def finished(self, info: ClusterInfo, result: Result) -> None:
        """The last job is done and its cluster still up (``submit --keep-open`` waits here)."""


def _counter(dev: _device.Device) -> Callable[[TileRecord], None]:
    """Start counting what a task moves and spills; the function returned fills a record
    with what was counted since."""
    h2d, d2h, (events, spilled) = dev.bytes_h2d, dev.bytes_d2h, dev.spill_counts()
    if dev.is_gpu:
        dev.copy_seconds()  # forget copies from before this task (a warm-up's)

    def fill(record: TileRecord) -> None:
        record.bytes_h2d, record.bytes_d2h = dev.bytes_h2d - h2d, dev.bytes_d2h - d2h
        now_events, now_spilled = dev.spill_counts()
        record.spill_events, record.spill_bytes = now_events - events, now_spilled - spilled
        if dev.is_gpu:
            seconds = dev.copy_seconds()
            record.h2d_s, record.d2h_s = seconds["h2d"], seconds["d2h"]

    return fill


def _make_panel(workload: Workload, panel: Panel, token: str, after: PanelRef | None = None) -> PanelRef:
    """Make ``panel`` on this worker; ``after``, the worker's panel before it, only orders them."""
    dev = _device.current()
    start = time.time()
    fill = _counter(dev)
    ref = workload.make_panel(dev, panel, token)
    record = Workload.new_record(dev, Tile(-1, panel.bounds), start, busy_s=0.0, work=0.0, kind="panel")
    record.extra["panel"] = panel.name
    fill(record)
    return dataclasses.replace(ref, record=record)


def _run_tile(workload: Workload, tile: Tile, panels: dict[str, PanelRef] | None = None) -> TileRecord:
    dev = _device.current()
    delay = injected_delay()
    if delay:
        time.sleep(delay)
    fill = _counter(dev)
    record = workload.run_tile(dev, tile, panels) if panels else workload.run_tile(dev, tile)
    fill(record)
    return record


def _warmup(workload: Workload) -> None:
    workload.warmup(_device.current())


def warm_up(client: Any, workload: Workload, workers: list[str], resources: dict[str, float] | None = None) -> None:
    """Run each worker's warm-up once before the timed tiles (compiles kernels, makes handles)."""
    # Loosely placed: a worker lost meanwhile must not leave its warm-up waiting forever.
    futures = [
        client.submit(
            _warmup,
            workload,
            key=f"{workload.name}-warmup-{i}-{uuid.uuid4().hex[:6]}",
            workers=[w],
            allow_other_workers=True,
            pure=False,
            resources=resources,
        )
        for i, w in enumerate(workers)
    ]
    client.gather(futures)


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


def run_plan(
    client: Any,
    workload: Workload,
    plan: Plan,
    on_done: Callable[[TileRecord], None] = lambda r: None,
    recovery: Recovery | None = None,
    on_lost: Callable[[str, list[int]], None] = lambda w, t: None,
    resources: dict[str, float] | None = None,
    panel_records: list[TileRecord] | None = None,
) -> list[TileRecord]:
    """Submit every tile where the plan places it and gather the records.

    The plan's panels are made first, each on its worker; a tile waits for the panels it
    reads. Static tiles go to their worker; dynamic ones are fed to whichever worker has
    room, as many as run at once plus ``_DYNAMIC_AHEAD``, so fast workers take more.
    ``resources`` is what each tile task asks of its worker (ClusterInfo.tile_resources).
    Tiles of a worker that is lost
    go to the workers that remain (see :class:`~mgpu.recovery.TileTracker`); ``recovery``,
    if given, receives the lost workers and the recomputed tiles; ``panel_records``, if
    given, the records of the panels' making (their time and bytes belong to the job).

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
            _make_panel,
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

    def submit(tile: Tile, worker: str | None, attempt: int) -> Any:
        again = f"-r{attempt}" if attempt else ""
        needs = {name: panel_futures[name] for name in tile.needs}
        return client.submit(
            _run_tile,
            workload,
            tile,
            needs or None,
            key=f"{prefix}-{tile.index}-{token}{again}",
            workers=[worker] if worker else None,
            allow_other_workers=False,
            pure=False,
            resources=resources,
            priority=-places[tile.index],
        )

    records: list[TileRecord] = []
    pending: deque[Tile] = deque()
    tracker = TileTracker(client, submit, on_lost)
    try:
        if plan.placement == "static":
            for t in plan.tiles:
                tracker.submit(t, t.worker)
        else:
            pending.extend(plan.tiles)
            workers = list(client.scheduler_info(n_workers=-1)["workers"])
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
        if panel_futures:
            client.cancel(list(panel_futures.values()))
            # Every tile has ended: each process closes the peers' panels it opened, then
            # (once all have) the owners free theirs.
            client.run(close_remotes, token)
            client.run(release_panels, token)
        if recovery is not None:
            recovery.lost_workers = tracker.lost_workers
            recovery.recomputed_tiles = sorted(tracker.recomputed_tiles)
    return records


@dataclass
class _Prepared:
    """A job checked and ready: its workload, tiling, and the outputs it will write."""

    job: Job
    workload: Workload
    tiling: dict[str, int]


def _prepare(job: Job) -> _Prepared:
    workload_cls = get_workload_class(job.workload)
    workload = workload_cls(job.params, verify=job.verify)
    tiling = check_tiling_keys(job.tiling, workload_cls.axes, job.workload)
    workload.prepare(force=job.force)
    return _Prepared(job, workload, tiling)


def _check_outputs_distinct(prepared: list[_Prepared]) -> None:
    # Each output is checked against the disk before anything runs; two jobs of one run
    # writing the same file would pass that check and the later would replace the earlier.
    seen: dict[str, str] = {}
    for p in prepared:
        for sink in p.workload.sinks.values():
            if sink.keep and sink.path in seen:
                raise JobInputError(
                    f"params.output: jobs {seen[sink.path]!r} and {p.job.name!r} both write "
                    f"{sink.path}; give each job its own output"
                )
            seen[sink.path] = p.job.name


def run_jobs(jobs: Sequence[Job], events: Events | None = None, *, security: Any = None) -> list[Result]:
    """Run ``jobs`` one after another on one cluster and return their Results.

    The cluster is the one every job's ``cluster:`` section describes (they must agree);
    it is started (or joined) once. Every job is checked before anything starts. A job
    that fails its check ends the run: later jobs are not run, and the list is shorter.

    Parameters
    ----------
    security
        A ``distributed.security.Security`` for joining a scheduler over TLS.

    Raises
    ------
    JobInputError
        A job cannot run as written (before any worker starts, except a tile that cannot
        fit the workers' memory, raised before any task of that job runs).
    JobFailed
        A task failed, or every worker was lost.
    """
    events = events or Events()
    try:
        transfer.check_config()
    except ValueError as e:
        raise JobInputError(str(e)) from None
    check_one_cluster(jobs)
    resolved = resolve_cluster(jobs[0].cluster)
    check_tls(scheduler_address(resolved.scheduler) if resolved.scheduler else None, security)
    prepared = [_prepare(job) for job in jobs]
    _check_outputs_distinct(prepared)
    t0 = time.perf_counter()
    results: list[Result] = []
    with open_cluster(resolved, security) as info:
        cluster_s = time.perf_counter() - t0
        events.cluster_ready(info)
        for i, p in enumerate(prepared):
            if i:
                t0 = time.perf_counter()
                # Plan for the workers there are now: one may have been lost in an earlier job.
                info.devices = describe_workers(info.client)
                if not info.devices:
                    raise JobFailed(f"no workers are left to run job {p.job.name!r}")
            events.job_started(i, p.job)
            result = _run_prepared(info, p, events, t0, cluster_s if i == 0 else 0.0)
            events.job_done(result)
            results.append(result)
            if result.status != "ok":
                break
        events.finished(info, results[-1])
    return results


def run_job(job: Job, events: Events | None = None, *, security: Any = None) -> Result:
    """Run ``job`` to completion and return its :class:`~mgpu.results.Result`.

    Input problems (JobInputError) are raised before any worker starts, except those that
    depend on the workers' memory (a tile that cannot fit), raised before any task runs.

    Raises
    ------
    JobInputError
        The job cannot run as written.
    JobFailed
        A task failed. A failed check does not raise: the result's status says "failed".
    """
    return run_jobs([job], events, security=security)[0]


@contextlib.contextmanager
def _reference_beside(workload: Workload, plan: Plan, verify: bool) -> Iterator[Any]:
    """The workload's reference (see Workload.reference) computing beside the run, or None.

    A process, not a thread: a NumPy loop in the client would hold the GIL that the
    client's event loop needs to feed tiles to the workers.
    """
    if not (verify and type(workload).reference is not Workload.reference):
        yield None
        return
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool.submit(workload.reference, plan)


def _run_prepared(info: ClusterInfo, p: _Prepared, events: Events, t0: float, cluster_s: float) -> Result:
    """Plan, run, check and commit one job on a connected cluster; outputs are kept only if it passed."""
    job, workload = p.job, p.workload
    sinks = list(workload.sinks.values())
    marks = [time.perf_counter()]  # start, ceilings, plan, warm-up, first tile
    try:
        ceilings = ceilings_for(info.client, info.devices)
        marks.append(time.perf_counter())
        sharing = workload.concurrency if info.slots else 1  # tiles on one device at once
        plan = workload.plan(info.devices, info.budget() // sharing, p.tiling, spill=info.spills)
        marks.append(time.perf_counter())
        events.planned(plan)
        for sink in sinks:
            sink.create()
        resources = info.tile_resources(workload.concurrency)
        alloc_stats.begin_job(info.client, list(info.devices))
        warm_up(info.client, workload, list(info.devices), resources)
        marks.append(time.perf_counter())

        def tile_done(record: TileRecord) -> None:
            if len(marks) == 4:
                marks.append(time.perf_counter())
            events.tile_done(record)

        recovery = Recovery()
        panel_records: list[TileRecord] = []
        with _reference_beside(workload, plan, job.verify) as reference:
            records = run_plan(
                info.client, workload, plan, tile_done, recovery, events.worker_lost, resources, panel_records
            )
            events.panels_made(panel_records)
            if reference is not None:
                workload.judge(records, reference.result())
        passed = all(r.verify_ok for r in records) if job.verify else None
        outputs: list[str] = []
        if passed is not False:
            outputs = workload.finish(info.client)
            for sink in sinks:
                sink.commit()
            outputs = [s.path for s in sinks if s.keep] + outputs
        allocators = alloc_stats.end_job(info.client, list(info.devices))
        wall = time.perf_counter() - t0
        steps = [b - a for a, b in zip(marks, marks[1:])]
        startup = Startup(
            cluster_s=cluster_s,
            ceilings_s=steps[0],
            plan_s=steps[1],
            warmup_s=steps[2],
            first_tile_s=steps[3] if len(steps) > 3 else None,
        )
        return build_result(
            job,
            workload,
            info,
            plan,
            records,
            wall_s=wall,
            outputs=outputs,
            ceilings=ceilings,
            allocators=allocators,
            recovery=recovery,
            startup=startup,
            panel_records=panel_records,
        )
    finally:
        for sink in sinks:
            sink.discard()
