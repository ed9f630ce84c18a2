"""A client mgpu makes sends what it submits at once, not after Dask's batching interval,
and reads the versions it reports on connecting ahead of time, on a thread of its own."""

from __future__ import annotations

import operator
import subprocess
import sys
import time
from typing import Any

import distributed.versions
from distributed import Client

from mgpu.cluster import open_cluster, resolve_cluster
from mgpu.connection import PROMPT_S, read_versions_ahead, send_promptly
from mgpu.spec import ClusterSpec


def _hold_back(client: Client, seconds: float) -> None:
    """Make ``client`` batch what it sends for ``seconds``, starting now (Dask's client
    does so for 10 ms after each message it sends)."""
    from distributed.metrics import time as now

    time.sleep(0.05)  # the messages of its connecting sent: nothing is waiting to go

    async def hold() -> None:
        comm = client.scheduler_comm
        comm.interval = seconds
        comm.next_deadline = now() + seconds

    client.sync(hold)


def test_a_task_held_back_by_the_batching_goes_once_the_client_sends_promptly(cluster):
    with Client(cluster.scheduler_address) as client:
        _hold_back(client, 600.0)
        send_promptly(client)
        # Held back, the task would reach the scheduler in 600 s.
        assert client.submit(operator.add, 1, 2, pure=False).result(timeout=60) == 3
        assert client.scheduler_comm.interval == PROMPT_S


def test_the_client_of_a_joined_cluster_sends_promptly(cluster):
    with open_cluster(resolve_cluster(ClusterSpec(scheduler=cluster.scheduler_address))) as info:
        assert info.client.scheduler_comm.interval == PROMPT_S


def test_a_client_given_is_left_as_it_batches(cluster):
    with Client(cluster.scheduler_address) as client:
        batching = client.scheduler_comm.interval
        with open_cluster(resolve_cluster(ClusterSpec(), given_client=True), client=client):
            assert client.scheduler_comm.interval == batching > PROMPT_S


def test_the_versions_a_client_reports_are_read_ahead_once_dask_is_imported(monkeypatch):
    read: list[str] = []

    def get_versions(packages: Any = None) -> dict[str, Any]:
        read.append("versions")
        return {}

    monkeypatch.setattr(distributed.versions, "get_versions", get_versions)
    reader = read_versions_ahead()
    assert reader is not None
    reader.join(timeout=30)
    assert read == ["versions"]


def test_nothing_is_read_ahead_before_dask_is_imported():
    # A second thread importing Dask while the first imports could find a module half made.
    code = (
        "import sys, mgpu.connection as c; "
        "assert c.read_versions_ahead() is None; "
        "assert 'distributed' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
