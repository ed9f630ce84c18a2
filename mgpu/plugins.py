"""Worker plugins: each worker's device, stream and allocator hooks, set up once at start.

GPU libraries are imported inside ``setup()`` only, so the client, the scheduler and
the planner import this module on machines without CUDA.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import dask.config
import psutil
from distributed import WorkerPlugin

from . import device as _device
from .config import Settings

__all__ = ["DeviceSetup", "SettingsSetup"]


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


class DeviceSetup(WorkerPlugin):
    """Give the worker its :class:`~mgpu.device.Device`.

    Parameters
    ----------
    backend
        ``"cuda"``, ``"cpu"``, or ``"auto"`` to decide on the worker (a worker of a
        cluster mgpu joined may or may not have a GPU).
    """

    name = "mgpu-device"
    idempotent = True

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend

    def setup(self, worker: Any = None) -> None:
        backend = self.backend
        if backend == "auto":
            backend = "cuda" if _has_cuda() else "cpu"
        dev = _cuda_device() if backend == "cuda" else _cpu_device(worker)
        _device.install(dev)


def _has_cuda() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _cuda_device() -> _device.Device:
    import cupy

    # LocalCUDACluster and `dask cuda worker` put the worker's own GPU first.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    ordinal = int(visible) if visible.isdigit() else 0
    cupy.cuda.Device(0).use()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    free, total = cupy.cuda.runtime.memGetInfo()
    name = props["name"]
    facts = _device.DeviceFacts(
        backend="cuda",
        id=ordinal,
        name=name.decode() if isinstance(name, bytes) else str(name),
        memory=int(total),
        free=int(free),
        host=socket.gethostname(),
        compute_capability=f"{props['major']}.{props['minor']}",
    )
    # Each task thread enqueues on a non-blocking stream of its own, never on the legacy
    # default stream that serialises everything. The threads' streams outrank the shared
    # in-order queue (Device.in_order): a band's check, a small kernel on its thread's
    # stream, gets the SMs as soon as its band's kernel ends instead of after every band
    # queued behind it (it waited 40-150 ms, and its thread with it).
    # Priority 0 is the least (every stream's default); -1 outranks it on any GPU with
    # stream priorities (their range runs from 0 up to -1 or beyond).
    return _device.Device(
        "cuda",
        cupy,
        facts,
        new_stream=lambda: cupy.cuda.Stream(non_blocking=True, priority=-1),
        new_queue=lambda: cupy.cuda.Stream(non_blocking=True, priority=0),
    )


def _cpu_device(worker: Any) -> _device.Device:
    import numpy

    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    total = int(limit) if limit else psutil.virtual_memory().total
    total = _device.address_space_room(total)
    name = str(getattr(worker, "name", 0))
    facts = _device.DeviceFacts(
        backend="cpu",
        id=int(name) if name.isdigit() else 0,
        name="cpu",
        memory=total,
        free=total,
        host=socket.gethostname(),
    )
    return _device.Device("cpu", numpy, facts)
