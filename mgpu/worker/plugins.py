"""mgpu's worker plugins, in the order the client registers them, and the one lookup of a
worker's runtime.

:class:`SettingsSetup` hands the client's ``mgpu.*`` settings to each worker;
:class:`RuntimeSetup` makes each worker's :class:`~mgpu.worker.runtime.Runtime` and frees
it at teardown; :class:`SpillToManaged` (``cluster.spill: managed``) puts the managed-memory
fallback of :mod:`mgpu.memory.spill` under the worker's RMM resource; :class:`AllocatorStats`
puts RMM's statistics adaptor on top (:mod:`mgpu.memory.stats`); :class:`PoolMetrics`, where
prometheus-client is installed, shows what that adaptor sees on the worker's ``/metrics``
(:mod:`mgpu.memory.metrics`). :func:`runtime_of` finds
the runtime a worker's :class:`RuntimeSetup` made: the task entry points
(:mod:`mgpu.worker.tasks`) and the plugins here are its only callers.

GPU libraries are imported inside ``setup()`` only, so the client imports this module on
machines without CUDA.
"""

from __future__ import annotations

from typing import Any

import dask.config
from distributed import WorkerPlugin

from ..config import Settings
from ..lifetime import resume_in_worker
from ..memory.metrics import PoolCollector
from ..memory.spill import ManagedFallback
from ..memory.stats import CupyPoolTracker, RmmTracker, cupy_uses_rmm, describe_chain, resource_chain
from .runtime import Runtime, make_runtime

__all__ = ["AllocatorStats", "PoolMetrics", "RuntimeSetup", "SettingsSetup", "SpillToManaged", "runtime_of"]


class SettingsSetup(WorkerPlugin):
    """Give the worker the client's ``mgpu.*`` settings, checked on the client.

    A cluster mgpu starts would inherit them from the client's Dask configuration, but the
    workers of a cluster it joins were started with their own.

    Parameters
    ----------
    settings
        What :func:`mgpu.config.load` returned on the client.
    """

    name = "mgpu-settings"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def setup(self, worker: Any = None) -> None:
        dask.config.update(dask.config.config, self.settings.as_dask_config(), priority="new")


class RuntimeSetup(WorkerPlugin):
    """Make each worker's :class:`~mgpu.worker.runtime.Runtime` at setup and free it at teardown.

    Parameters
    ----------
    backend
        ``"cuda"``, ``"cpu"``, or ``"auto"`` to decide on the worker (a worker of a
        cluster mgpu joined may or may not have a GPU).
    """

    name = "mgpu-runtime"
    idempotent = True  # registered again (a second job on a cluster), the runtime is kept

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend
        self.runtime: Runtime | None = None

    def setup(self, worker: Any = None) -> None:
        self.runtime = make_runtime(self.backend, worker)
        resume_in_worker(worker)  # the worker's start is done: collect again

    def teardown(self, worker: Any = None) -> None:
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            runtime.close()


def runtime_of(worker: Any) -> Runtime:
    """The runtime :class:`RuntimeSetup` made on ``worker`` (a ``distributed.Worker``).

    Raises
    ------
    RuntimeError
        On a worker without the :class:`RuntimeSetup` plugin.
    """
    plugin = getattr(worker, "plugins", {}).get(RuntimeSetup.name)
    runtime = getattr(plugin, "runtime", None)
    if runtime is None:
        raise RuntimeError(
            f"worker {getattr(worker, 'address', worker)} has no mgpu runtime; tasks must run on a cluster "
            "started by mgpu, or one whose workers have the RuntimeSetup plugin (mgpu.run registers it)"
        )
    return runtime


class SpillToManaged(WorkerPlugin):
    """Install :class:`~mgpu.memory.spill.ManagedFallback` over the worker's current RMM resource.

    Registered after dask-cuda's RMM setup, so it wraps the pool (or async) resource
    that setup made, capped at the planner's budget.
    """

    name = "mgpu-spill"
    idempotent = True

    def setup(self, worker: Any = None) -> None:
        import rmm

        fallback = ManagedFallback(rmm.mr.get_current_device_resource())
        rmm.mr.set_current_device_resource(fallback.resource)
        runtime_of(worker).device.extra["spill"] = fallback


class AllocatorStats(WorkerPlugin):
    """Put a ``StatisticsResourceAdaptor`` on top of each GPU worker's RMM resource.

    Registered after the spill plugin, so the adaptor sees every allocation, spilled or
    not. CuPy's RMM allocator asks RMM for the current resource on each call, so setting
    the adaptor as current is all it takes. A no-op on CPU workers.
    """

    name = "mgpu-allocator-stats"
    idempotent = True

    def setup(self, worker: Any = None) -> None:
        dev = runtime_of(worker).device
        if not dev.is_gpu or "allocator" in dev.extra:
            return
        if not cupy_uses_rmm():
            dev.extra["allocator"] = CupyPoolTracker()
            return
        import rmm

        mr = rmm.mr.get_current_device_resource()
        if not isinstance(mr, rmm.mr.StatisticsResourceAdaptor):
            mr = rmm.mr.StatisticsResourceAdaptor(mr)
            rmm.mr.set_current_device_resource(mr)
        chain = resource_chain(mr, dev.extra.get("spill"))
        dev.extra["allocator"] = RmmTracker(mr, *describe_chain(chain, rmm.mr))


class PoolMetrics(WorkerPlugin):
    """Register the GPU's pool figures on the worker's ``/metrics``, labelled by the GPU's
    UUID (after :class:`AllocatorStats`, whose tracker they read). A no-op on CPU workers
    and where prometheus-client is missing."""

    name = "mgpu-pool-metrics"
    idempotent = True

    def __init__(self) -> None:
        self._collector: PoolCollector | None = None

    def setup(self, worker: Any = None) -> None:
        dev = runtime_of(worker).device
        tracker = dev.extra.get("allocator")
        if not dev.is_gpu or tracker is None:
            return
        try:
            import prometheus_client
        except ImportError:
            return
        self._collector = PoolCollector(tracker, dev.facts.uuid)
        prometheus_client.REGISTRY.register(self._collector)

    def teardown(self, worker: Any = None) -> None:
        if self._collector is not None:
            import prometheus_client

            prometheus_client.REGISTRY.unregister(self._collector)
            self._collector = None
