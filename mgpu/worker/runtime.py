"""The worker runtime: what one worker keeps for its tasks, made when it starts, freed when it stops.

One :class:`RuntimeSetup` worker plugin makes a :class:`Runtime` per worker: its
:class:`~mgpu.worker.device.Device` (array module, the task threads' streams, the host threads
and pinned buffers of staged copies, arrays kept between tiles, references to what the
memory plugins set up), its :class:`~mgpu.worker.panels.PanelStore`, and what its stepped tiles
keep between steps (:class:`~mgpu.worker.tile.StepStore`, :class:`~mgpu.worker.exchange.PeerBuffers`).
Tasks, and functions run by ``Client.run``, reach it through the worker they run on
(:func:`current`); two workers in one process have one each. The plugin's teardown (the
worker closing, or the plugin removed) frees it.

GPU libraries are imported inside ``setup()`` only, so the client, the scheduler and the
planner import this module on machines without CUDA.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import psutil
from distributed import WorkerPlugin, get_worker

from .device import Device, DeviceFacts, address_space_room
from .exchange import PeerBuffers
from .panels import PanelStore
from .tile import StepStore

__all__ = ["Runtime", "RuntimeSetup", "current"]


@dataclass
class Runtime:
    """What one worker keeps for its tasks (see the module's docstring)."""

    device: Device
    panels: PanelStore = field(default_factory=PanelStore)
    steps: StepStore = field(default_factory=StepStore)
    exchange: PeerBuffers = field(default_factory=PeerBuffers)

    def close(self) -> None:
        """Drop the stepped tiles, free the exchange's buffers and the panels (peers' closed
        first), then what the device holds."""
        self.steps.close()
        self.exchange.close()
        self.panels.close()
        self.device.close()


class RuntimeSetup(WorkerPlugin):
    """Make each worker's :class:`Runtime` at setup and free it at teardown.

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
        backend = self.backend
        if backend == "auto":
            backend = "cuda" if _has_cuda() else "cpu"
        self.runtime = Runtime(_cuda_device() if backend == "cuda" else _cpu_device(worker))

    def teardown(self, worker: Any = None) -> None:
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            runtime.close()


def current(worker: Any = None) -> Runtime:
    """The runtime of the worker this task runs on, or of ``worker`` where given (in a worker
    plugin's setup, or a function run by ``Client.run``: neither runs as a task).

    Raises
    ------
    RuntimeError
        Outside a worker, or on a worker without the :class:`RuntimeSetup` plugin.
    """
    if worker is None:
        try:
            worker = get_worker()
        except ValueError:
            raise RuntimeError(
                "mgpu's worker runtime is reached from a task on a Dask worker; this is not one"
            ) from None
    plugin = getattr(worker, "plugins", {}).get(RuntimeSetup.name)
    runtime = getattr(plugin, "runtime", None)
    if runtime is None:
        raise RuntimeError(
            f"worker {getattr(worker, 'address', worker)} has no mgpu runtime; tasks must run on a cluster "
            "started by mgpu, or one whose workers have the RuntimeSetup plugin (mgpu.run registers it)"
        )
    return runtime


def _has_cuda() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _cuda_device() -> Device:
    import cupy

    # LocalCUDACluster and `dask cuda worker` put the worker's own GPU first.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    ordinal = int(visible) if visible.isdigit() else 0
    cupy.cuda.Device(0).use()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    free, total = cupy.cuda.runtime.memGetInfo()
    name = props["name"]
    facts = DeviceFacts(
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
    facts = DeviceFacts(
        backend="cpu",
        id=int(name) if name.isdigit() else 0,
        name="cpu",
        memory=total,
        free=total,
        host=socket.gethostname(),
    )
    return Device("cpu", numpy, facts)
