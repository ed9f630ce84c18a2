"""Run validated Jobs on one cluster: plan, submit, watch, recover, assemble, for each in turn.

Only small records come back to the client; inputs are made or read by the workers and
outputs written by them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

from distributed import Client

from .. import config, metrics
from ..cluster import (
    ClusterInfo,
    ResolvedCluster,
    budget_basis,
    open_cluster,
    survey,
)
from ..errors import JobFailed, JobInputError
from ..paths import OutputClaims
from ..results import Recovery, Result, Startup
from ..roofline import ceiling_units, ceilings_at_once, ceilings_for, job_groups
from ..sharing import share_rates
from ..spec import Job
from ..tiling import Tile
from ..workloads.base import TileRecord, Workload
from .assemble import assemble, reference_beside
from .estimate import estimate
from .plan import Prepared, plan_job
from .preflight import outputs_of, preflight
from .recover import retire_worker
from .submit import run_plan, warm_up
from .watch import Events

__all__ = ["cold_workers", "run_job", "run_jobs"]


def run_jobs(
    jobs: Sequence[Job], events: Events | None = None, *, security: Any = None, client: Client | None = None
) -> list[Result]:
    """Run ``jobs`` one after another on one cluster and return their Results.

    The cluster is ``client``'s, if given (left open), else the one every job's
    ``cluster:`` section describes (they must agree), started (or joined) once. Every job
    is checked before anything starts. A job that fails its check ends the run: later
    jobs are not run, and the list is shorter.

    Parameters
    ----------
    security
        A ``distributed.security.Security`` for joining a scheduler over TLS.
    client
        A connected ``distributed.Client`` to run on instead of the cluster the jobs name.

    Raises
    ------
    JobInputError
        A job cannot run as written (before any worker starts, except a tile that cannot
        fit the workers' memory, raised before any task of that job runs).
    JobFailed
        A task failed, or every worker was lost.
    """
    events = events or Events()
    settings = config.load()  # the mgpu.* settings, checked once; the workers get these
    checked = preflight(jobs, given_client=client is not None, security=security)
    resolved, prepared = checked.resolved, checked.prepared
    claims = OutputClaims()
    claims.take(out for p in prepared for out in outputs_of(p))
    try:
        return _run_checked(resolved, prepared, events, security, settings, client)
    finally:
        claims.release()


def _run_checked(
    resolved: ResolvedCluster,
    prepared: list[Prepared],
    events: Events,
    security: Any,
    settings: config.Settings,
    client: Client | None,
) -> list[Result]:
    t0 = time.perf_counter()
    results: list[Result] = []
    reporting = metrics.reporting()
    with open_cluster(resolved, security, settings, client) as info:
        events.cluster_ready(info)
        for i, p in enumerate(prepared):
            if i:
                t0 = time.perf_counter()
                # Plan for the workers there are now (one may have been lost in an earlier
                # job), and learn which are warm for it: one round trip.
                found = survey(info.client)
                info.devices, info.software, info.warmed = found.devices, found.software, found.warmed
                if not info.devices:
                    raise JobFailed(f"no workers are left to run job {p.job.name!r}")
            events.job_started(i, p.job)
            try:
                result = _run_prepared(info, p, events, t0)
            except (JobFailed, JobInputError):
                if reporting:
                    metrics.report(info.client, {"workload": p.job.workload, "status": "failed"})
                raise
            if reporting:  # a scheduler that cannot keep them is not asked again
                reporting = metrics.report(info.client, metrics.figures(result))
            events.job_done(result)
            results.append(result)
            if result.status != "ok":
                break
        events.finished(info, results[-1])
    return results


def run_job(job: Job, events: Events | None = None, *, security: Any = None, client: Client | None = None) -> Result:
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
    return run_jobs([job], events, security=security, client=client)[0]


def tile_deadline(expected: Any, plan: Any, workers: int, concurrency: int) -> float:
    """How long a worker with tiles in flight may go without finishing one before it is
    taken as stuck if the scheduler no longer hears from it: ``mgpu.recovery``'s slack
    times a tile's share of the estimate (its worker runs ``concurrency`` at once), never
    below the floor; without an estimate, the floor. (A worker still heard from is slow,
    not stuck, and waits up to the setting for jobs without an estimate.)"""
    settings = config.load().recovery
    if expected is None or not plan.tiles:
        return settings.tile_deadline_floor
    tile_s = expected.seconds * workers * concurrency / len(plan.tiles)
    return max(settings.tile_deadline_floor, settings.tile_deadline_slack * tile_s)


def cold_workers(workload: Workload, tile: Tile, info: ClusterInfo) -> list[str]:
    """The workers that have run no warm-up of the key of ``workload``'s tiles like
    ``tile`` (:meth:`~mgpu.workloads.base.Workload.warm_key`), as they said when the job
    found them, in the cluster's order."""
    key = workload.warm_key(tile)
    return [w for w in info.devices if key not in info.warmed.get(w, ())]


def _run_prepared(info: ClusterInfo, p: Prepared, events: Events, t0: float) -> Result:
    """Plan, run, check and commit one job on a connected cluster; outputs are kept only if
    it passed. ``t0`` (``time.perf_counter``) is the job's start: the cluster's start or
    joining for the first job, the round trip that found the workers for a later one."""
    job, workload = p.job, p.workload
    sinks = list(workload.sinks.values())
    marks = [t0, time.perf_counter()]  # start, cluster, ceilings, plan, warm-up, first tile
    try:
        wanted = job_groups(workload)  # its bound alone: a first run measures what it reads
        ceilings = ceilings_for(info.client, info.devices, wanted, software=info.software)
        busy = ceilings_at_once(info.client, info.devices, ceilings, wanted, software=info.software)
        marks.append(time.perf_counter())
        try:
            plan = plan_job(p, info.devices, info.budget(), slots=info.slots, spill=info.spills)
        except JobInputError as e:
            raise JobInputError(f"{e} ({budget_basis(info.resolved.memory_limit, info.devices)})") from None
        # Workers that share a GPU each count on their share of its rates.
        shares = share_rates(busy, info.devices, ceiling_units(type(workload)))
        expected = estimate(workload, plan, shares, at_once=busy is not ceilings)
        if expected is not None:
            plan.notes["estimate"] = {"seconds": expected.seconds, "basis": expected.basis}
        marks.append(time.perf_counter())
        events.planned(plan)
        for sink in sinks:
            try:
                sink.create()
            except OSError as e:  # the folder removed or made read-only since the check
                raise JobFailed(f"{sink.key}: could not create {sink.partial}: {e.strerror or e}") from None
        resources = info.tile_resources(workload.concurrency)
        deadline_s = tile_deadline(expected, plan, len(info.devices), workload.concurrency)
        retire = functools.partial(retire_worker, info.client, ours=info.owned)
        # Only workers that have not run a warm-up of this key get one: a warm cluster, as
        # the round trip that found its workers said, starts the tiles at once.
        cold = cold_workers(workload, plan.tiles[0], info)
        if cold:
            warm_up(info.client, workload, plan.tiles[0], cold, resources, deadline_s=deadline_s, retire=retire)
        marks.append(time.perf_counter())

        def tile_done(record: TileRecord) -> None:
            if len(marks) == 5:
                marks.append(time.perf_counter())
            events.tile_done(record)

        recovery = Recovery()
        panel_records: list[TileRecord] = []
        with reference_beside(workload, plan, job.verify) as reference:
            records = run_plan(
                info.client,
                workload,
                plan,
                tile_done,
                recovery,
                events.worker_lost,
                resources,
                panel_records,
                {addr: f.physical for addr, f in info.devices.items()},
                deadline_s=deadline_s,
                retire=retire,
            )
            tiles_done = time.perf_counter()
            events.panels_made(panel_records)
            if reference is not None:
                workload.judge(records, reference.result())
        steps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
        startup = Startup(
            cluster_s=steps[0],
            ceilings_s=steps[1],
            plan_s=steps[2],
            warmup_s=steps[3],
            first_tile_s=steps[4] if len(steps) > 4 else None,
            later_tiles_s=tiles_done - marks[5] if len(marks) > 5 else None,
            warmups=len(cold),
        )
        return assemble(
            info,
            job,
            workload,
            plan,
            records,
            t0=t0,
            ceilings=ceilings,
            recovery=recovery,
            startup=startup,
            panel_records=panel_records,
            tiles_done=tiles_done,
        )
    finally:
        for sink in sinks:
            sink.discard()
