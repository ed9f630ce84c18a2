"""mgpu's figures on /metrics: the scheduler's totals of the jobs that ran, scraped from a
running cluster; each GPU worker's pool figures, labelled by the GPU's UUID."""

from __future__ import annotations

import logging
import urllib.request
import warnings
from dataclasses import dataclass

import numpy as np
import pytest

import mgpu
from mgpu.errors import JobInputError
from mgpu.gpus import format_uuid
from mgpu.memory.metrics import PoolCollector
from mgpu.memory.stats import Counts, RmmTracker

prometheus_client = pytest.importorskip("prometheus_client")
zarr = pytest.importorskip("zarr")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def _scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return samples


def test_the_schedulers_metrics_carry_each_jobs_tiles_bytes_and_status(tmp_path):
    from distributed import Client, LocalCluster

    rng = np.random.default_rng(0)
    np.save(tmp_path / "a.npy", rng.standard_normal((48, 20)))
    np.save(tmp_path / "b.npy", rng.standard_normal((20, 30)))
    job = {
        "workload": "matmul",
        "params": {
            "input": {"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy")},
            "output": str(tmp_path / "c.zarr"),
        },
        "tiling": {"m": 16},
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Port .* is already in use", category=UserWarning)
        cluster = LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            silence_logs=logging.WARNING,
        )
    with cluster, Client(cluster) as client:
        url = f"http://127.0.0.1:{cluster.scheduler.http_server.port}/metrics"
        result = mgpu.run(job, client=client)
        # A job that fails: a chunk of its input store cannot be decoded.
        zarr.create_array(str(tmp_path / "x.zarr"), shape=(100,), chunks=(50,), dtype="float64")[...] = 1.0
        zarr.create_array(str(tmp_path / "y.zarr"), shape=(100,), chunks=(50,), dtype="float64")[...] = 1.0
        (tmp_path / "x.zarr" / "c" / "1").write_bytes(b"not zstd")
        with pytest.raises(JobInputError):
            mgpu.run(
                {
                    "workload": "dot",
                    "params": {"input": {"x": str(tmp_path / "x.zarr"), "y": str(tmp_path / "y.zarr")}},
                },
                client=client,
            )
        got = _scrape(url)

    def value(name, **labels):
        return got.get((name, tuple(sorted(labels.items()))))

    assert value("mgpu_jobs_total", workload="matmul", status="ok") == 1
    assert value("mgpu_jobs_total", workload="dot", status="failed") == 1
    assert value("mgpu_tiles_total", workload="matmul") == sum(r.tiles for r in result.per_device) == 3
    # A and B read once and C written once: 8 bytes each of 48*20 + 20*30 + 48*30 elements.
    assert value("mgpu_bytes_total", workload="matmul", path="file") == 8 * (48 * 20 + 20 * 30 + 48 * 30)
    assert value("mgpu_compute_seconds_total", workload="matmul") == pytest.approx(result.compute_s)
    assert value("mgpu_wall_seconds_total", workload="matmul") == pytest.approx(result.wall_s)
    assert value("mgpu_roofline_fraction", workload="matmul") == pytest.approx(result.roofline.fraction)
    assert value("mgpu_failed_checks_total", workload="matmul") == 0
    assert value("mgpu_recovered_tiles_total", workload="matmul") == 0
    assert value("mgpu_spilled_bytes_total", workload="matmul") == 0


@dataclass
class _FakeTracker:
    figures: dict

    def now(self):
        return self.figures


def test_a_workers_pool_gauges_are_labelled_by_its_gpus_uuid():
    registry = prometheus_client.CollectorRegistry()
    uuid = format_uuid(bytes(range(16)))
    assert uuid == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    registry.register(PoolCollector(_FakeTracker({"kind": "pool", "in_use": 5, "peak": 9, "size": 64}), uuid))
    labels = {"gpu_uuid": uuid, "kind": "pool"}
    assert registry.get_sample_value("mgpu_gpu_pool_in_use_bytes", labels) == 5
    assert registry.get_sample_value("mgpu_gpu_pool_peak_bytes", labels) == 9
    assert registry.get_sample_value("mgpu_gpu_pool_size_bytes", labels) == 64
    # An allocator without a pool (async) has no size to show, rather than a zero.
    registry = prometheus_client.CollectorRegistry()
    registry.register(PoolCollector(_FakeTracker({"kind": "async", "in_use": 5, "peak": 9, "size": None}), uuid))
    assert registry.get_sample_value("mgpu_gpu_pool_size_bytes", {"gpu_uuid": uuid, "kind": "async"}) is None
    assert registry.get_sample_value("mgpu_gpu_pool_in_use_bytes", {"gpu_uuid": uuid, "kind": "async"}) == 5


class _Adaptor:
    """RMM's statistics adaptor's counter stack, as far as the tracker reads it."""

    def __init__(self, current, peak):
        self.stack = [Counts(current_bytes=current, peak_bytes=peak)]

    @property
    def allocation_counts(self):
        return self.stack[-1]

    def push_counters(self):
        self.stack.append(Counts())
        return self.stack[-2]

    def allocate(self, nbytes):
        top = self.stack[-1]
        self.stack[-1] = Counts(
            current_bytes=top.current_bytes + nbytes, peak_bytes=max(top.peak_bytes, top.current_bytes + nbytes)
        )


def test_the_pool_figures_are_the_workers_whatever_window_a_job_opened():
    class Pool:
        def pool_size(self):
            return 1 << 20

    adaptor = _Adaptor(current=100, peak=700)
    tracker = RmmTracker(adaptor, "pool", Pool())
    assert tracker.now() == {"kind": "pool", "in_use": 100, "peak": 700, "size": 1 << 20}
    tracker.begin()  # a job's window: its counters start at zero
    adaptor.allocate(50)
    assert tracker.now() == {"kind": "pool", "in_use": 150, "peak": 700, "size": 1 << 20}
    adaptor.allocate(900)
    assert tracker.now()["in_use"] == 1050 and tracker.now()["peak"] == 1050
