"""Each GPU worker's RMM pool on its ``/metrics``, for Prometheus, labelled by the GPU's UUID.

Distributed serves ``/metrics`` on each worker's HTTP server from prometheus-client's
default registry. The :class:`~mgpu.worker.plugins.PoolMetrics` worker plugin registers a
:class:`PoolCollector` there, which reads, at each scrape, what the worker's allocator
statistics (:mod:`mgpu.memory.stats`) see now: bytes in use, the most in use at once, and
the pool's size. A CPU worker, or a worker without prometheus-client, shows none of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["PoolCollector"]


class PoolCollector:
    """The worker's pool figures as gauges, read as each scrape asks."""

    def __init__(self, tracker: Any, uuid: str) -> None:
        self.tracker, self.uuid = tracker, uuid

    def describe(self) -> list[Any]:
        return []  # names are not claimed: two workers in one process may both register

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        now = self.tracker.now()
        for name, key, doc in (
            ("mgpu_gpu_pool_in_use_bytes", "in_use", "Bytes allocated through the GPU's RMM resource now"),
            ("mgpu_gpu_pool_peak_bytes", "peak", "Most bytes allocated through the GPU's RMM resource at once"),
            ("mgpu_gpu_pool_size_bytes", "size", "Bytes the GPU's RMM pool holds (allocated or not)"),
        ):
            if now.get(key) is None:
                continue  # not measured by this allocator (no pool: no size)
            family = GaugeMetricFamily(name, doc, labels=["gpu_uuid", "kind"])
            family.add_metric([self.uuid, now["kind"]], now[key])
            yield family
