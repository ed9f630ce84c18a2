"""Ending the worker processes of a cluster mgpu started, at once, once its jobs are done.

Closed the usual way, each worker winds down (its threads joined, its plugins torn down,
its interpreter finalized, on GPUs its pool and context released one by one) while the
command waits. Once the jobs' results and outputs are committed nothing of a worker's is
needed: each nanny is told to close (so it restarts nothing), its worker process is
killed, and the operating system (the driver, for a GPU) frees what it held. A run that
was stopped or failed closes the usual way instead (:func:`mgpu.cluster.open_cluster`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import psutil

__all__ = ["end_workers", "kill_processes", "worker_processes"]


def worker_processes(cluster: Any) -> list[psutil.Process]:
    """The worker processes of a cluster this process started (its nannies' children),
    each with its own children first."""
    ours = {p.pid: p for p in psutil.Process().children(recursive=True)}
    out: list[psutil.Process] = []
    for nanny in list(getattr(cluster, "workers", {}).values()):
        pid = getattr(getattr(nanny, "process", None), "pid", None)
        if pid in ours:
            with contextlib.suppress(psutil.Error):
                out += [*ours[pid].children(recursive=True), ours[pid]]
    return out


def kill_processes(processes: list[psutil.Process]) -> None:
    """SIGKILL ``processes`` (one already gone is skipped)."""
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def end_workers(cluster: Any, timeout: float) -> None:
    """Close every nanny of ``cluster`` (a ``distributed`` SpecCluster this process started)
    with its worker process killed; within ``timeout`` seconds, after which the caller's
    own close goes on."""
    processes = worker_processes(cluster)

    async def end() -> None:
        nannies = list(cluster.workers.values())
        closing = [asyncio.ensure_future(n.close(timeout=timeout, reason="mgpu-jobs-done")) for n in nannies]
        # Each nanny is closing once its close has begun: a worker's exit is then not
        # a loss to restart from.
        await asyncio.sleep(0)
        kill_processes(processes)
        await asyncio.wait(closing, timeout=timeout)

    cluster.sync(end)
