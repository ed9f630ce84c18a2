"""On a running cluster, and between the jobs of one submit, workers that said (as the job
found them) they ran a warm-up of the job's key get no warm-up task: the tiles start at
once. A job of another key (a new tile shape) sends its warm-up to every worker, and the
seconds a result gives of its start-up, tiles and finish add up to its ``wall_s``."""

from __future__ import annotations

import time
from typing import Any

import pytest
from dask.utils import key_split
from distributed import Client

import mgpu
from mgpu.api import run_all
from mgpu.results import Result


def _warmups(client: Client, since: float) -> list[str]:
    """The warm-up tasks the scheduler ran since ``since`` (its task stream, which mgpu opens)."""
    return [t["key"] for t in client.get_task_stream(start=since) if key_split(t["key"]).endswith("-warmup")]


def _run(client: Client, job: dict[str, Any]) -> tuple[Result, list[str]]:
    since = time.time()
    result = mgpu.run(job, client=client)
    assert result.status == "ok" and result.verify.passed is True
    return result, _warmups(client, since)


def _adds_up(result: Result) -> None:
    st = result.startup
    assert st is not None
    parts = [st.cluster_s, st.ceilings_s, st.plan_s, st.warmup_s, st.first_tile_s, st.later_tiles_s, st.finish_s]
    assert all(p is not None and p >= 0 for p in parts), st
    assert sum(parts) == pytest.approx(result.wall_s, rel=1e-9, abs=1e-9)  # type: ignore[arg-type]


def test_a_warm_worker_gets_no_warm_up_and_a_new_shape_does(cluster, monkeypatch):
    matmul = {"workload": "matmul", "params": {"m": 64, "n": 48, "k": 32}, "tiling": {"m": 32}}
    with Client(cluster) as client:
        first, sent = _run(client, matmul)
        assert len(sent) == first.startup.warmups == 2  # both workers were cold
        # The same job, and one of other operands but the same product: no warm-up task,
        # and no round trip to the workers but the one that found them (on CPU workers
        # the allocator's figures need none).
        ran: list[str] = []
        real_run = Client.run

        def run(self: Client, fn: Any, *args: Any, **kwargs: Any) -> Any:
            ran.append(fn.__name__)
            return real_run(self, fn, *args, **kwargs)

        monkeypatch.setattr(Client, "run", run)
        again, sent = _run(client, matmul)
        assert sent == [] and again.startup.warmups == 0
        assert ran == ["_describe"]
        assert {row.allocator.kind for row in again.per_worker} == {"numpy"}
        other = {**matmul, "params": {"m": 64, "n": 48, "k": 32, "seed": 7}}
        _, sent = _run(client, other)
        assert sent == []
        # Tiles of another shape: another product, warmed up on every worker.
        wider, sent = _run(client, {**matmul, "params": {"m": 64, "n": 96, "k": 32}})
        assert len(sent) == wider.startup.warmups == 2
        for result in (first, again, wider):
            _adds_up(result)


def test_the_jobs_of_one_submit_warm_up_once_for_their_key(cluster):
    image = {"workload": "mandelbrot", "params": {"width": 64, "height": 48, "max_iter": 20}}
    deeper = {"workload": "mandelbrot", "params": {"width": 64, "height": 40, "max_iter": 60, "xmin": -1.5}}
    with Client(cluster) as client:
        since = time.time()
        results = run_all([image, deeper, image], client=client)
        sent = _warmups(client, since)
    assert [r.status for r in results] == ["ok"] * 3
    # The first job warms every worker up for the band's kernels; the other window and
    # steps are the same kernels' arguments.
    assert [r.startup.warmups for r in results] == [2, 0, 0] and len(sent) == 2
    for result in results:
        _adds_up(result)
        assert result.startup.cluster_s > 0  # a later job's: the round trip that found the workers
