"""mgpu's job figures on the scheduler's ``/metrics``, for Prometheus.

Distributed serves ``/metrics`` on the scheduler's HTTP server from prometheus-client's
default registry. A :class:`JobMetrics` scheduler plugin (registered once per cluster, by
the first job's report, see :func:`report`) keeps running totals per workload and registers a
collector there that turns them into metric families: jobs by status, tiles, seconds of
compute and wall, the last job's share of the roofline, bytes by path (file,
host→device, device→host, device→device), spilled bytes, failed checks and recovered
tiles. The client reports each job's figures after it ends (:func:`report`); they are
small numbers, taken from the Result.

prometheus-client is an extra (``pip install 'mgpu[metrics]'``): without it on the
client nothing is registered, and jobs run as before.
"""

from __future__ import annotations

import importlib.util
import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from distributed import SchedulerPlugin

if TYPE_CHECKING:
    from .results import Result

__all__ = ["JobMetrics", "figures", "report", "reporting"]

logger = logging.getLogger(__name__)

# (name, what it counts): each a counter per workload, summed over jobs.
_COUNTERS = (
    ("tiles", "Tiles computed"),
    ("compute_seconds", "Seconds from a job's first tile's start to its last tile's end"),
    ("wall_seconds", "Seconds from a job's start (its cluster's, for the first job) to its result"),
    ("spilled_bytes", "Bytes tiles allocated past the budget, in managed memory"),
    ("failed_checks", "Tiles whose check failed"),
    ("recovered_tiles", "Tiles recomputed on another worker after theirs was lost"),
)


def figures(result: Result) -> dict[str, Any]:
    """The figures of one job that :class:`JobMetrics` adds up, from its Result."""
    rows = result.per_device
    return {
        "workload": result.workload,
        "status": result.status,
        "tiles": sum(r.tiles for r in rows),
        "compute_seconds": result.compute_s,
        "wall_seconds": result.wall_s,
        "spilled_bytes": result.spill.bytes,
        "failed_checks": len(result.verify.failed_tiles),
        "recovered_tiles": len(result.recovery.recomputed_tiles),
        "roofline_fraction": result.roofline.fraction if result.roofline else None,
        "bytes": {
            "file": result.pcie.minimum_bytes if result.pcie else 0,
            "host_to_device": sum(r.bytes_h2d for r in rows),
            "device_to_host": sum(r.bytes_d2h for r in rows),
            "device_to_device": sum(r.bytes_d2d for r in rows),
        },
    }


class JobMetrics(SchedulerPlugin):
    """Running totals of mgpu's jobs on this scheduler, collected into its ``/metrics``."""

    name = "mgpu-metrics"
    idempotent = True  # registered again by a later run on the cluster: the totals are kept

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], int] = defaultdict(int)
        self.totals: dict[tuple[str, str], float] = defaultdict(float)  # (name, workload) -> sum
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)  # (workload, path) -> sum
        self.roofline: dict[str, float] = {}  # workload -> the last job's fraction
        self._collector: _JobCollector | None = None

    async def start(self, scheduler: Any) -> None:
        import prometheus_client

        self._collector = _JobCollector(self)
        prometheus_client.REGISTRY.register(self._collector)

    async def close(self) -> None:
        if self._collector is not None:
            import prometheus_client

            prometheus_client.REGISTRY.unregister(self._collector)
            self._collector = None

    def record(self, job: dict[str, Any]) -> None:
        """Add one job's :func:`figures` (a job that raised gives its workload and status only)."""
        workload = job["workload"]
        self.jobs[workload, job["status"]] += 1
        for name, _ in _COUNTERS:
            self.totals[name, workload] += job.get(name, 0) or 0
        for path, nbytes in job.get("bytes", {}).items():
            self.bytes[workload, path] += nbytes
        if job.get("roofline_fraction") is not None:
            self.roofline[workload] = job["roofline_fraction"]


class _JobCollector:
    """The plugin's totals as metric families, made as each scrape asks."""

    def __init__(self, plugin: JobMetrics) -> None:
        self.plugin = plugin

    def describe(self) -> list[Any]:
        return []  # names are not claimed: two schedulers in one process may both register

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self.plugin
        jobs = CounterMetricFamily(
            "mgpu_jobs", "mgpu jobs that ended, by workload and status", labels=["workload", "status"]
        )
        for (workload, status), n in sorted(p.jobs.items()):
            jobs.add_metric([workload, status], n)
        yield jobs
        for name, doc in _COUNTERS:
            family = CounterMetricFamily(f"mgpu_{name}", doc, labels=["workload"])
            for (metric, workload), value in sorted(p.totals.items()):
                if metric == name:
                    family.add_metric([workload], value)
            yield family
        moved = CounterMetricFamily(
            "mgpu_bytes",
            "Bytes mgpu's jobs moved, by path: file (inputs read and outputs written, each once), "
            "host_to_device, device_to_host, device_to_device",
            labels=["workload", "path"],
        )
        for (workload, path), nbytes in sorted(p.bytes.items()):
            moved.add_metric([workload, path], nbytes)
        yield moved
        share = GaugeMetricFamily(
            "mgpu_roofline_fraction", "The last job's throughput as a share of its roofline limit", labels=["workload"]
        )
        for workload, fraction in sorted(p.roofline.items()):
            share.add_metric([workload], fraction)
        yield share


def reporting() -> bool:
    """Whether this client reports its jobs' figures: prometheus-client is installed here
    (found, not imported: 15 ms a submit)."""
    return importlib.util.find_spec("prometheus_client") is not None


async def _record(job: dict[str, Any], dask_scheduler: Any = None) -> None:
    plugin = dask_scheduler.plugins.get(JobMetrics.name)
    if plugin is None:  # the first report to this scheduler: no round trip of its own
        await dask_scheduler.register_scheduler_plugin(JobMetrics(), idempotent=True)
        plugin = dask_scheduler.plugins[JobMetrics.name]
    plugin.record(job)


def report(client: Any, job: dict[str, Any]) -> bool:
    """Add one job's figures (:func:`figures`) to the scheduler's totals, registering
    :class:`JobMetrics` there first if it is not yet (after the job's result: its wall
    time has no round trip of this); returns whether they were added. A scheduler that
    cannot take them (one of a joined cluster without mgpu or prometheus-client, say)
    keeps running jobs without them."""
    try:
        client.run_on_scheduler(_record, job)
    except Exception as e:  # metrics never fail a job
        logger.info("mgpu's job metrics are not on this scheduler's /metrics: %s", e)
        return False
    return True
