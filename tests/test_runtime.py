"""The worker runtime: one per worker (two workers in one process share nothing), reached
from tasks through their worker, and freed by the plugin's teardown."""

from __future__ import annotations

import copy
import logging
from typing import Any

import dask.config
import numpy as np
import pytest
from distributed import Client, LocalCluster

import mgpu
from mgpu.worker import tasks
from mgpu.worker.plugins import RuntimeSetup


@pytest.fixture(scope="module")
def one_process():
    """Two CPU workers in this process, each with mgpu's runtime plugin.

    Dask's configuration is this process's, so the settings a job hands its workers land
    in the tests' own: it is put back as it was afterwards."""
    saved = copy.deepcopy(dask.config.config)
    cluster = LocalCluster(
        n_workers=2,
        threads_per_worker=2,
        processes=False,
        dashboard_address=None,
        silence_logs=logging.WARNING,
    )
    with Client(cluster) as client:
        client.register_plugin(RuntimeSetup("cpu"))
        yield client
    cluster.close()
    dask.config.config.clear()
    dask.config.config.update(saved)


def _workers(client: Client) -> list[str]:
    return sorted(client.scheduler_info()["workers"])


def _keep_on_this_worker(token: str) -> tuple[int, int, int]:
    rt = tasks.current()
    rt.panels.keep(token, "a", np.ones(3))
    rt.device.cache.get("axes", token, lambda: np.arange(4))
    rt.device.staging.pool.submit(lambda: None).result()  # its host threads started
    return id(rt), id(rt.device), id(rt.device.staging)


def _held(token: str) -> tuple[int, Any]:
    rt = tasks.current()
    return rt.panels.held(), rt.device.cache.held("axes")


def test_two_workers_in_one_process_keep_separate_runtimes(one_process):
    a, b = _workers(one_process)
    ids_a = one_process.submit(_keep_on_this_worker, "job-a", workers=[a], pure=False).result()
    ids_b = one_process.submit(_held, "job-a", workers=[b], pure=False).result()
    # What one worker kept is not seen on the other, though both live in this process.
    assert ids_b == (0, None)
    held_a, axes_a = one_process.submit(_held, "job-a", workers=[a], pure=False).result()
    assert held_a == 1 and np.array_equal(axes_a, np.arange(4))
    ids_b = one_process.submit(_keep_on_this_worker, "job-b", workers=[b], pure=False).result()
    assert all(x != y for x, y in zip(ids_a, ids_b, strict=True))  # runtime, device and staging each their own


def test_functions_run_on_the_workers_reach_each_ones_runtime(one_process):
    # Client.run and plugin setup are not tasks: they name the worker they run on.
    facts = one_process.run(lambda dask_worker: tasks.device_facts(dask_worker).id)
    assert sorted(facts.values()) == [0, 1]


def test_outside_a_worker_the_runtime_is_not_found():
    with pytest.raises(RuntimeError, match="from a task on a Dask worker; this is not one"):
        tasks.current()


def test_a_job_runs_on_two_workers_of_one_process(one_process):
    result = mgpu.run({"workload": "mandelbrot", "params": {"width": 96, "height": 64, "max_iter": 50}}, one_process)
    assert result.status == "ok" and result.verify.passed is True
    assert sorted(d.id for d in result.per_device) == [0, 1]


def test_teardown_frees_the_runtime():
    cluster = LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None, silence_logs=logging.WARNING
    )
    with cluster, Client(cluster) as client:
        client.register_plugin(RuntimeSetup("cpu"))
        (addr,) = _workers(client)
        client.submit(_keep_on_this_worker, "job", pure=False).result()
        worker = next(iter(cluster.workers.values()))
        rt = worker.plugins[RuntimeSetup.name].runtime
        pool = rt.device.staging.pool
        rt.steps.keep("job", 0, object())  # a stepped tile's context, between its steps
        assert rt.panels.held() == 1 and len(rt.device.cache) == 1 and rt.steps.held() == 1

        client.unregister_worker_plugin(RuntimeSetup.name)
        # Its panels, stepped tiles, cached arrays and host threads are gone; nothing of it is
        # left to reach.
        assert rt.panels.held() == 0 and rt.steps.held() == 0 and len(rt.device.cache) == 0
        assert pool._shutdown and rt.device.staging.buffer_count == 0
        with pytest.raises(RuntimeError, match="has no mgpu runtime"):
            client.submit(tasks.current, pure=False).result()
        # Registered again, the worker gets a new, empty runtime.
        client.register_plugin(RuntimeSetup("cpu"))
        assert client.submit(_held, "job", pure=False).result() == (0, None)
