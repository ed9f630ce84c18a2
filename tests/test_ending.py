"""A cluster mgpu started for its jobs ends at once once they are done: its worker processes
are killed (not wound down), none is restarted, and none is left; a run that fails or is
stopped closes its cluster the usual way."""

from __future__ import annotations

import os
import time
from typing import Any

import psutil
import pytest
from conftest import start_local_cluster, write_job

import mgpu
import mgpu.cluster
from mgpu.ending import end_workers


def worker_children() -> list[psutil.Process]:
    """This process's worker processes (multiprocessing's spawned children) still alive."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            pass
    return out


def test_end_workers_kills_each_worker_and_its_nanny_restarts_none():
    cluster = start_local_cluster()
    try:
        processes = {name: nanny.process.process for name, nanny in cluster.workers.items()}
        pids = [p.pid for p in processes.values()]
        assert all(psutil.pid_exists(pid) for pid in pids)
        end_workers(cluster, timeout=5.0)
        # Killed, not asked to wind down (a worker that closes itself exits 0).
        assert {name: p.exitcode for name, p in processes.items()} == {name: -9 for name in processes}
        assert all(n.status.name == "closed" for n in cluster.workers.values())
        time.sleep(0.5)  # a nanny that took the exit for a loss would be starting a new worker now
        assert worker_children() == []
    finally:
        cluster.close(timeout=10)


class _Watch(mgpu.Events):
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.pids: list[int] = []

    def cluster_ready(self, info: Any) -> None:
        self.pids = list(info.client.run(os.getpid).values())

    def job_done(self, result: Any) -> None:
        if self.fail:
            raise RuntimeError("the caller's own error after the job")


@pytest.fixture
def ended(monkeypatch):
    """The clusters open_cluster ended at once (mgpu.ending.end_workers)."""
    calls: list[Any] = []

    def spy(cluster: Any, timeout: float) -> None:
        calls.append(cluster)
        end_workers(cluster, timeout)

    monkeypatch.setattr(mgpu.cluster, "end_workers", spy)
    return calls


@pytest.mark.parametrize("fail", [False, True], ids=["done", "failed"])
def test_a_cluster_mgpu_started_is_gone_when_run_returns(tmp_path, ended, fail):
    job = write_job(
        tmp_path / "dot.yaml",
        {"workload": "dot", "params": {"n": 10_000}, "cluster": {"backend": "cpu", "devices": 1, "dashboard": None}},
    )
    watch = _Watch(fail=fail)
    if fail:
        with pytest.raises(RuntimeError, match="the caller's own error"):
            mgpu.run(job, events=watch)
    else:
        assert mgpu.run(job, events=watch).status == "ok"
    assert len(watch.pids) == 1
    # Ended at once after jobs that were done; closed the usual way after a failure.
    assert len(ended) == (0 if fail else 1)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in watch.pids)
    assert worker_children() == []
