"""``mgpu.run``: a job as a path, a mapping or a Job, on a Dask client given or on a cluster of its own."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from conftest import start_local_cluster, write_job
from distributed import Client

import mgpu
import mgpu.client.run
from mgpu.worker import kernels


def _dot_want(n: int, seed: int, dtype: str = "float32") -> float:
    x, y = (
        kernels.random_block(np, seed=seed, operand=op, rows=(0, 1), cols=(0, n), total_cols=n, dtype=dtype)
        .ravel()
        .astype(np.float64)
        for op in (0, 1)
    )
    return math.fsum(x * y)


class _Watch(mgpu.Events):
    def __init__(self) -> None:
        self.info: Any = None
        self.tiles: list[Any] = []

    def cluster_ready(self, info: Any) -> None:
        self.info = info

    def tile_done(self, record: Any) -> None:
        self.tiles.append(record)


@pytest.fixture(scope="module")
def client():
    cluster = start_local_cluster()
    with Client(cluster) as c:
        yield c
    cluster.close()


def test_the_public_api_is_narrow_and_sorted():
    assert mgpu.__all__ == sorted(mgpu.__all__)
    assert "run" in mgpu.__all__ and "run_job" not in mgpu.__all__
    assert all(hasattr(mgpu, name) for name in mgpu.__all__)


def test_run_on_a_client_given_returns_the_typed_result_and_leaves_the_client_open(client):
    watch = _Watch()
    doc = {"workload": "dot", "params": {"n": 30_011, "seed": 4}, "tiling": {"n": 7000}}
    result = mgpu.run(doc, client, events=watch)
    assert isinstance(result, mgpu.Result)
    assert result.status == "ok" and result.verify.passed is True and result.backend == "cpu"
    assert abs(result.value - _dot_want(30_011, 4)) <= 1e-12 * abs(_dot_want(30_011, 4))
    # It ran on the given client's two workers, every tile once, and said so as it went.
    assert watch.info.client is client and not watch.info.owned
    workers = set(client.scheduler_info()["workers"])
    assert {d.worker for d in result.per_device} == workers
    assert len(watch.tiles) == result.plan["tiles"] == 5
    assert result.job["cluster"]["scheduler"] is None
    # The client and its cluster are the caller's: still up, and ready for the next job.
    assert client.status == "running"
    again = mgpu.run(doc, client)
    assert again.value == result.value


def test_run_with_no_client_starts_cpu_workers_and_closes_them(tmp_path):
    job = write_job(
        tmp_path / "dot.yaml",
        {"workload": "dot", "params": {"n": 20_000, "seed": 1}, "cluster": {"backend": "cpu", "devices": 2}},
    )
    watch = _Watch()
    result = mgpu.run(job, events=watch, overrides=["params.n=20011"])
    assert result.status == "ok" and result.job["name"] == "dot"  # the file's stem
    assert result.job["params"]["n"] == 20_011  # the override, not the file's 20000
    assert abs(result.value - _dot_want(20_011, 1)) <= 1e-12 * abs(_dot_want(20_011, 1))
    assert len(result.per_device) == 2 and watch.info.owned
    # The cluster mgpu started for the job is gone once it returns.
    assert watch.info.client.status == "closed"


def test_run_takes_a_job_model_and_applies_overrides_to_a_copy(client, tmp_path):
    job = mgpu.load_job(write_job(tmp_path / "j.yaml", {"workload": "dot", "params": {"n": 1000}}))
    result = mgpu.run(job, client, overrides=["params.seed=3", "verify=false"])
    assert result.job["params"]["seed"] == 3 and result.job["verify"] is False
    assert result.verify.passed is None
    assert abs(result.value - _dot_want(1000, 3)) <= 1e-12 * abs(_dot_want(1000, 3))
    assert job.params.seed == 0 and job.verify is True  # the caller's model is unchanged


@pytest.mark.parametrize(
    ("job", "needle"),
    [
        ({"workload": "dot", "params": {"n": 10}, "cluster": {"scheduler": "tcp://127.0.0.1:1"}}, "cluster.scheduler:"),
        ({"workload": "nope"}, "workload: unknown workload 'nope'"),
        ({"workload": "dot", "params": {"n": -1}}, "params.n"),
        (42, "job: expected a Job, a mapping of a job's keys or the path of a job file, got int"),
        ("/no/such/job.yaml", "job file '/no/such/job.yaml' does not exist"),
    ],
)
def test_bad_jobs_are_refused_before_the_cluster_is_touched(client, monkeypatch, job, needle):
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the cluster was set up for a job that should have been refused")

    monkeypatch.setattr(mgpu.client.run, "open_cluster", refuse)
    with pytest.raises(mgpu.JobInputError) as err:
        mgpu.run(job, client)
    assert needle in str(err.value)
    assert client.status == "running"
