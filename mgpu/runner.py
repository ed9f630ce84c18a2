"""Run a validated Job: resolve the cluster, plan, place every tile, collect, check, report.

Only small records come back to the client; inputs are made or read by the workers and
outputs written by them.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
import contextlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterator

from distributed import as_completed

from . import alloc_stats
from . import device as _device
from .cluster import ClusterInfo, open_cluster, resolve_cluster
from .errors import JobFailed
from .panels import PanelRef
from .panels import release as release_panels
from .planner import Panel, Plan, Tile, check_tiling_keys
from .results import Result, build_result
from .roofline import ceilings_for
from .spec import Job
from .workloads import get_workload_class
from .workloads.base import TileRecord, Workload

__all__ = ["run_job", "run_plan"]

# Tiles queued on each worker under dynamic placement, beyond those running at once: two,
# so a worker never waits for the client's round trip between short tiles.
_DYNAMIC_AHEAD = 2


class Events:
    """What the runner tells whoever watches (the CLI's messages and progress bar)."""

    def cluster_ready(self, info: ClusterInfo) -> None: ...

    def planned(self, plan: Plan) -> None: ...

    def tile_done(self, record: TileRecord) -> None: ...

    def finished(self, info: ClusterInfo, result: Result) -> None:
        """The job is done and its cluster still up (``submit --keep-open`` waits here)."""


def _make_panel(workload: Workload, panel: Panel, token: str) -> PanelRef:
    return workload.make_panel(_device.current(), panel, token)


def _run_tile(workload: Workload, tile: Tile, panels: dict[str, PanelRef] | None = None) -> TileRecord:
    dev = _device.current()
    h2d, d2h, (events, spilled) = dev.bytes_h2d, dev.bytes_d2h, dev.spill_counts()
    record = workload.run_tile(dev, tile, panels) if panels else workload.run_tile(dev, tile)
    record.bytes_h2d, record.bytes_d2h = dev.bytes_h2d - h2d, dev.bytes_d2h - d2h
    now_events, now_spilled = dev.spill_counts()
    record.spill_events, record.spill_bytes = now_events - events, now_spilled - spilled
    return record


def _warmup(workload: Workload) -> None:
    workload.warmup(_device.current())


def warm_up(client: Any, workload: Workload, workers: list[str], resources: dict[str, float] | None = None) -> None:
    """Run each worker's warm-up once before the timed tiles (compiles kernels, makes handles)."""
    futures = [client.submit(_warmup, workload, key=f"{workload.name}-warmup-{i}-{uuid.uuid4().hex[:6]}",
                             workers=[w], allow_other_workers=False, pure=False, resources=resources)
               for i, w in enumerate(workers)]
    client.gather(futures)


def run_plan(
    client: Any, workload: Workload, plan: Plan, on_done: Callable[[TileRecord], None] = lambda r: None,
    resources: dict[str, float] | None = None,
) -> list[TileRecord]:
    """Submit every tile where the plan places it and gather the records.

    Static tiles go to their worker; dynamic ones are fed to whichever worker has room,
    as many as run at once plus ``_DYNAMIC_AHEAD``, so fast workers take more.
    ``resources`` is what each tile task asks of its worker (see ClusterInfo.tile_resources).

    Raises
    ------
    JobFailed
        If a tile's task raised; the other tiles are cancelled.
    """
    token = uuid.uuid4().hex[:6]
    prefix = f"{workload.name}-tile"
    # Panels first, each on its worker; a tile waits for the panels it reads.
    panel_futures = {
        p.name: client.submit(_make_panel, workload, p, token, key=f"{workload.name}-panel-{p.name}-{token}",
                              workers=[p.worker], allow_other_workers=False, pure=False, resources=resources)
        for p in plan.panels
    }

    def submit(tile: Tile, worker: str | None) -> Any:
        needs = {name: panel_futures[name] for name in tile.needs}
        fut = client.submit(
            _run_tile, workload, tile, needs or None, key=f"{prefix}-{tile.index}-{token}",
            workers=[worker] if worker else None, allow_other_workers=False, pure=False, resources=resources,
        )
        fut.mgpu_worker = worker
        return fut

    records: list[TileRecord] = []
    pending: deque[Tile] = deque()
    if plan.placement == "static":
        futures = [submit(t, t.worker) for t in plan.tiles]
    else:
        pending.extend(plan.tiles)
        workers = list(client.scheduler_info(n_workers=-1)["workers"])
        depth = workload.concurrency + _DYNAMIC_AHEAD
        futures = [submit(pending.popleft(), w) for _ in range(depth) for w in workers if pending]
    stream = as_completed(futures)
    try:
        for fut in stream:
            try:
                record = fut.result()
            except Exception as e:
                raise JobFailed(f"{fut.key} failed on {fut.mgpu_worker or 'a worker'}: {type(e).__name__}: {e}") from e
            records.append(record)
            on_done(record)
            if pending:
                stream.add(submit(pending.popleft(), fut.mgpu_worker))
    finally:
        client.cancel([f for f in futures if not f.done()])
        stream.clear()
        if panel_futures:
            client.cancel(list(panel_futures.values()))
            client.run(release_panels, token)  # every tile has ended: no peer still reads them
    return records


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


def run_job(job: Job, events: Events | None = None) -> Result:
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
    events = events or Events()
    workload_cls = get_workload_class(job.workload)
    workload = workload_cls(job.params, verify=job.verify)
    tiling = check_tiling_keys(job.tiling, workload_cls.axes, job.workload)
    resolved = resolve_cluster(job.cluster)
    workload.prepare(force=job.force)
    t0 = time.perf_counter()
    sinks = list(workload.sinks.values())
    try:
        with open_cluster(resolved) as info:
            events.cluster_ready(info)
            ceilings = ceilings_for(info.client, info.devices)
            sharing = workload.concurrency if info.slots else 1  # tiles on one device at once
            plan = workload.plan(info.devices, info.budget() // sharing, tiling, spill=info.spills)
            events.planned(plan)
            for sink in sinks:
                sink.create()
            resources = info.tile_resources(workload.concurrency)
            alloc_stats.begin_job(info.client, list(info.devices))
            warm_up(info.client, workload, list(info.devices), resources)
            with _reference_beside(workload, plan, job.verify) as reference:
                records = run_plan(info.client, workload, plan, events.tile_done, resources)
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
            result = build_result(job, workload, info, plan, records, wall_s=wall, outputs=outputs,
                                  ceilings=ceilings, allocators=allocators)
            events.finished(info, result)
            return result
    finally:
        for sink in sinks:
            sink.discard()
