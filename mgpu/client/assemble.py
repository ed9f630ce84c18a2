"""After the tiles: judge the answer, keep the outputs only if it passed, build the Result."""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from ..cluster import ClusterInfo
from ..errors import JobFailed
from ..results import Recovery, Result, Startup
from ..spec import Job
from ..tiling import Plan
from ..worker.tasks import close_allocator_window
from ..workloads.base import Outputs, TileRecord, Workload
from .result import build_result

__all__ = ["assemble", "reference_beside"]


@contextlib.contextmanager
def reference_beside(workload: Workload, plan: Plan, verify: bool) -> Iterator[Any]:
    """The workload's reference (see Workload.reference) computing beside the run, or None.

    A process, not a thread: a NumPy loop in the client would hold the GIL that the
    client's event loop needs to feed tiles to the workers.
    """
    if not (verify and type(workload).reference is not Workload.reference):
        yield None
        return
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool.submit(workload.reference, plan)


def assemble(
    info: ClusterInfo,
    job: Job,
    workload: Workload,
    plan: Plan,
    records: list[TileRecord],
    *,
    t0: float,
    ceilings: Any,
    recovery: Recovery,
    startup: Startup,
    panel_records: list[TileRecord],
    tiles_done: float | None = None,
) -> Result:
    """Commit the outputs if every tile passed its check, close the job's allocator window,
    and build the Result (the workers' statistics are fetched for it); the job's wall time
    runs from ``t0`` (``time.perf_counter``) until the outputs are committed, and
    ``startup.finish_s`` from ``tiles_done`` (the last tile's record came) until then."""
    passed = all(r.verify_ok for r in records) if job.verify else None
    outputs: list[str] = []
    sinks = list(workload.sinks.values())
    if passed is not False:
        try:
            outputs = workload.finish(info.client) if isinstance(workload, Outputs) else []
        except OSError as e:  # a write on a worker: its message names the key and the file
            raise JobFailed(e.strerror or str(e)) from None
        for sink in sinks:
            try:
                sink.commit()
            except OSError as e:  # the folder removed, the disk full since the check
                raise JobFailed(f"{sink.key}: could not write {sink.path}: {e.strerror or e}") from None
        outputs = [s.path for s in sinks if s.keep] + outputs
    # Only the workers left, and within a bound: a broadcast to a lost worker's address waits
    # out Dask's connect timeout, and a stuck one never answers. A worker that cannot answer
    # is left out: its row says n/a rather than failing a finished job.
    live = [w for w in info.devices if w not in recovery.lost_workers]
    if info.backend == "cpu":  # NumPy's allocations are counted by no one: no round trip
        allocators: dict[str, dict[str, Any]] = {w: {"kind": "numpy"} for w in live}
    else:
        try:
            allocators = info.client.run(close_allocator_window, workers=live, on_error="ignore", callback_timeout=10)
        except TimeoutError:
            allocators = {}
    end = time.perf_counter()
    wall_s = end - t0
    if tiles_done is not None:
        startup = startup.model_copy(update={"finish_s": end - tiles_done})
    return build_result(
        job,
        workload,
        info,
        plan,
        records,
        wall_s=wall_s,
        outputs=outputs,
        ceilings=ceilings,
        allocators=allocators,
        recovery=recovery,
        startup=startup,
        panel_records=panel_records,
    )
