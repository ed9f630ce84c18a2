"""Workers hand what they hold after the warm-up to gc.freeze (a full collection during
the tiles stops every task thread), unless ``mgpu.worker.gc-freeze`` is false."""

from __future__ import annotations

import gc

import dask.config
import pytest
from distributed import Client

from conftest import start_local_cluster, submit_json, write_job


@pytest.mark.parametrize("freeze", [True, False])
def test_workers_freeze_their_objects_after_the_warm_up_unless_told_not_to(tmp_path, freeze):
    with dask.config.set({"mgpu.worker.gc-freeze": freeze}):
        cluster = start_local_cluster()  # its workers start with this config
    try:
        with Client(cluster) as client:
            before = client.run(gc.get_freeze_count)
        doc = {"workload": "dot", "params": {"n": 5000}}
        res, data = submit_json(write_job(tmp_path / "job.yaml", doc), tmp_path / "r.json",
                                "--scheduler", cluster.scheduler_address)
        assert res.code == 0 and data["verify"]["passed"], res.output
        with Client(cluster) as client:
            after = client.run(gc.get_freeze_count)
        assert set(after) == set(before) and len(after) == 2
        for worker in after:
            assert (after[worker] > before[worker]) if freeze else (after[worker] == before[worker] == 0)
    finally:
        cluster.close()
