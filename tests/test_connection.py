"""A client mgpu makes sends what it submits at once, not after Dask's batching interval;
the connection to a running cluster, and the versions a client reports on connecting, are
made ahead, on threads of their own, and a connection made ahead that no job takes is
closed as the process ends."""

from __future__ import annotations

import operator
import subprocess
import sys
import time
from typing import Any

import dask.config
import distributed.versions
import pytest
from distributed import Client

from mgpu import cluster as cluster_module
from mgpu import connection
from mgpu.cluster import open_cluster, resolve_cluster
from mgpu.connection import PROMPT_S, connect_ahead, read_versions_ahead, send_promptly, take_ahead
from mgpu.errors import JobInputError
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


def test_what_joining_takes_is_begun_ahead_though_no_job_imported_dask_yet(cluster):
    # (A dot job's workload imports nothing of Dask's client.)
    code = (
        "import sys, mgpu.connection as c\n"
        "assert 'distributed' not in sys.modules\n"
        f"c.ahead({cluster.scheduler_address!r})\n"
        f"client = c.take_ahead({cluster.scheduler_address!r})\n"
        "print(client.status)\n"
        "client.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "running"


def test_the_job_joins_with_the_connection_begun_ahead(cluster, monkeypatch):
    address = cluster.scheduler_address
    assert connect_ahead(address) is not None

    def second_connection(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the job connected again")

    monkeypatch.setattr(cluster_module, "Client", second_connection)
    with open_cluster(resolve_cluster(ClusterSpec(scheduler=address))) as info:
        assert len(info.devices) == 2
        client = info.client
        assert Client.current() is client  # what Dask's own calls (distributed.wait) use
    assert client.status == "closed"  # the job's, closed with it as a client it made
    assert take_ahead(address) is None  # taken once


def test_a_connection_that_failed_ahead_fails_the_job_as_connecting_then_would():
    address = "tcp://127.0.0.1:9"  # nothing listens there
    with dask.config.set({"distributed.comm.timeouts.connect": "0.5s"}):
        connect_ahead(address)
        with (
            pytest.raises(JobInputError, match=r"cluster.scheduler: could not connect to tcp://127.0.0.1:9"),
            open_cluster(resolve_cluster(ClusterSpec(scheduler=address))),
        ):
            pass
    assert take_ahead(address) is None


def test_a_connection_made_ahead_that_no_job_took_is_closed(cluster):
    thread = connect_ahead(cluster.scheduler_address)
    assert thread is not None
    thread.join(timeout=30)
    client = connection._ahead().pending[cluster.scheduler_address].client
    assert client is not None and client.status == "running"
    connection._ahead().close()  # as the process ends
    assert client.status == "closed" and not connection._ahead().pending


def test_a_process_that_connected_ahead_and_ran_no_job_ends_quietly(cluster):
    code = (
        "import sys, distributed\n"
        "from mgpu.connection import connect_ahead\n"
        f"connect_ahead({cluster.scheduler_address!r}).join()\n"
        "print('connected')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "connected"
    assert out.stderr == ""
