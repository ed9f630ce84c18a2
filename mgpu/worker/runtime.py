"""The worker runtime: what one worker keeps for its tasks, made when it starts, freed when it stops.

A :class:`Runtime` holds the worker's :class:`~mgpu.worker.device.Device` (array module,
the task threads' streams, the host threads and pinned buffers of staged copies, arrays
kept between tiles, references to what the memory plugins set up), its
:class:`~mgpu.worker.panels.PanelStore`, and what its stepped tiles keep between steps
(:class:`~mgpu.worker.tile.StepStore`, :class:`~mgpu.worker.exchange.PeerBuffers`), and its
turns at a GPU other workers share (:class:`~mgpu.worker.turns.DeviceTurns`). The
:class:`~mgpu.worker.plugins.RuntimeSetup` worker plugin makes one per worker
(:func:`make_runtime`; two workers in one process have one each) and frees it at its
teardown. The task entry points (:mod:`mgpu.worker.tasks`) find it and hand its parts
down: nothing below them looks it up.

GPU libraries are imported inside :func:`make_runtime` only, so the client, the scheduler
and the planner import this module on machines without CUDA.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import psutil

from .. import gpus
from ..memory.stats import describe_chain, resource_chain
from ..mps import under_mps
from .device import Device, DeviceFacts, address_space_room
from .exchange import PeerBuffers
from .panels import PanelStore
from .tile import StepStore
from .turns import DeviceTurns

__all__ = ["Runtime", "make_runtime"]


class Warmed:
    """The keys of the warm-ups a worker ran (:meth:`mgpu.workloads.base.Workload.warm_key`),
    the ``limit`` most recent: what a long-lived worker tells each client stays small."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def add(self, key: str) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self.limit:
                self._keys.popitem(last=False)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._keys)


@dataclass
class Runtime:
    """What one worker keeps for its tasks (see the module's docstring)."""

    device: Device
    panels: PanelStore = field(default_factory=PanelStore)
    steps: StepStore = field(default_factory=StepStore)
    exchange: PeerBuffers = field(default_factory=PeerBuffers)
    # The keys of the warm-ups run on this worker (see mgpu.worker.tasks.warmup), most
    # recent last: a job like one before finds its kernels compiled and its handles made,
    # and the client, told of them as it finds the workers, sends it no warm-up.
    warmed: Warmed = field(default_factory=Warmed)
    turns: DeviceTurns = field(init=False)

    def __post_init__(self) -> None:
        dev = self.device
        drain = dev.xp.cuda.runtime.deviceSynchronize if dev.is_gpu else (lambda: None)
        self.turns = DeviceTurns(dev.facts.physical, drain)

    def close_opened(self, token: str) -> None:
        """The first half of a job's end, once every tile has ended: drop its stepped tiles
        and close what this worker opened of the other workers' (their exchange buffers,
        their panels)."""
        self.steps.release(token)
        self.exchange.release(token)
        self.panels.close_remotes(token)

    def free_own(self, token: str) -> None:
        """The second half, once every worker has closed what it opened: free this worker's
        own exchange buffers and panels of the job."""
        self.exchange.free(token)
        self.panels.release(token)

    def close(self) -> None:
        """Drop the stepped tiles, free the exchange's buffers and the panels (peers' closed
        first), then what the device holds."""
        self.steps.close()
        self.exchange.close()
        self.panels.close()
        self.turns.close()
        self.device.close()


def make_runtime(backend: str, worker: Any = None) -> Runtime:
    """A runtime for ``worker`` on ``backend``: ``"cuda"``, ``"cpu"``, or ``"auto"`` (a GPU
    where CuPy sees one: a worker of a cluster mgpu joined may or may not have one)."""
    if backend == "auto":
        backend = "cuda" if _has_cuda() else "cpu"
    return Runtime(_cuda_device(worker) if backend == "cuda" else _cpu_device(worker))


def _has_cuda() -> bool:
    return gpus.cuda_count() > 0


def _cuda_device(worker: Any = None) -> Device:
    import cupy

    # LocalCUDACluster and `dask cuda worker` put the worker's own GPU first.
    visible = (gpus.visible_devices() or ["0"])[0]
    cupy.cuda.Device(0).use()
    gpu = gpus.cuda_gpu(0)
    facts = DeviceFacts(
        backend="cuda",
        id=int(visible) if visible.isdigit() else 0,
        name=gpu.name,
        memory=gpu.memory,
        free=gpu.free,
        host=socket.gethostname(),
        compute_capability=gpu.compute_capability,
        uuid=gpu.uuid,
        budget=_rmm_budget(worker),
        pid=os.getpid(),
        mps=under_mps(),
    )
    # Each task thread enqueues on a non-blocking stream of its own, never on the legacy
    # default stream that serialises everything. The threads' streams outrank the shared
    # in-order queue (Device.in_order): a band's check, a small kernel on its thread's
    # stream, gets the SMs as soon as its band's kernel ends instead of after every band
    # queued behind it (it waited 40-150 ms, and its thread with it).
    # Priority 0 is the least (every stream's default); -1 outranks it on any GPU with
    # stream priorities (their range runs from 0 up to -1 or beyond).
    return Device(
        "cuda",
        cupy,
        facts,
        new_stream=lambda: cupy.cuda.Stream(non_blocking=True, priority=-1),
        new_queue=lambda: cupy.cuda.Stream(non_blocking=True, priority=0),
    )


def _cpu_device(worker: Any) -> Device:
    import numpy

    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    total = int(limit) if limit else psutil.virtual_memory().total
    total = address_space_room(total)
    name = str(getattr(worker, "name", 0))
    host = socket.gethostname()
    facts = DeviceFacts(
        backend="cpu",
        id=int(name) if name.isdigit() else 0,
        name="cpu",
        memory=total,
        free=total,
        host=host,
        # Each CPU worker (one core) is a device of its own.
        uuid=f"{host}/cpu-{name}",
        pid=os.getpid(),
    )
    return Device("cpu", numpy, facts)


def _rmm_budget(worker: Any) -> int | None:
    """The bytes the worker's RMM pool may hold: as dask-cuda set it up (its maximum, else
    its initial size, in bytes once set up), else as RMM's current resource says (a
    limiting adaptor's limit, a pool's size); None without a pool of known size."""
    for plugin in (getattr(worker, "plugins", None) or {}).values():
        if type(plugin).__name__ == "RMMSetup":  # dask_cuda.plugins.RMMSetup, LocalCUDACluster's or the CLI's
            for size in (getattr(plugin, "maximum_pool_size", None), getattr(plugin, "initial_pool_size", None)):
                if isinstance(size, int) and size > 0:
                    return size
    try:
        import rmm
    except ImportError:
        return None
    _, pool, limit = describe_chain(resource_chain(rmm.mr.get_current_device_resource()), rmm.mr)
    if limit:
        return limit
    return int(pool.pool_size()) if pool is not None else None
