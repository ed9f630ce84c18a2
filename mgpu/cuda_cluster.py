"""A local cluster of GPU workers, several per GPU where asked (``cluster.workers_per_device``).

dask-cuda's ``LocalCUDACluster`` starts one worker per entry of ``CUDA_VISIBLE_DEVICES``
and names each worker by its device, so a device listed twice is refused. This subclass
names its workers ``DEVICE-K`` (K from 0 to N-1) and lets ``LocalCUDACluster`` make each
one's spec as for its device alone: the same ``CUDA_VISIBLE_DEVICES`` (its GPU first), RMM
set-up, preloads and plugins, so N workers share the GPU, each with its own context and
pool (the RMM options given are each worker's). Given NVIDIA's MPS control program, the
cluster runs a control daemon of its own that its workers connect to, stopped when the
cluster closes (see :mod:`mgpu.mps`).

dask-cuda is imported when a cluster starts, so this module imports without it.
"""

from __future__ import annotations

import atexit
from typing import Any

from .mps import MpsDaemon

__all__ = ["start_cuda_cluster", "worker_names"]


def worker_names(devices: list[Any], per_device: int) -> list[tuple[str, Any]]:
    """(worker name, device) of every worker, each device's ``per_device`` in turn."""
    return [(f"{d}-{k}", d) for d in devices for k in range(per_device)]


def start_cuda_cluster(devices: list[int], per_device: int, daemon: MpsDaemon | None = None, **kwargs: Any) -> Any:
    """A ``LocalCUDACluster`` of ``per_device`` workers on each GPU of ``devices`` (ordinals);
    ``kwargs`` are its keywords, the RMM options each worker's. ``daemon``: an MPS control
    daemon the workers sharing a GPU connect to (with ``per_device`` > 1), stopped when the
    cluster closes."""
    from dask_cuda import LocalCUDACluster

    visible = ",".join(str(d) for d in devices)
    if per_device == 1:
        return LocalCUDACluster(CUDA_VISIBLE_DEVICES=visible, **kwargs)
    if daemon is not None:
        atexit.register(daemon.stop)  # a cluster never closed (its closing cut short) too

    class SharedCUDACluster(LocalCUDACluster):
        mps: MpsDaemon | None = daemon

        async def _close(self) -> None:
            try:
                await super()._close()
            finally:
                if self.mps is not None:
                    self.mps.stop()  # once its workers, its clients, are gone

        def new_worker_spec(self) -> dict[str, Any]:
            taken = set(self.worker_spec)  # type: ignore[has-type]
            for name, device in worker_names(list(self.cuda_visible_devices), per_device):
                if name in taken:
                    continue
                # LocalCUDACluster makes the spec of the first device that has no worker:
                # shown every device but this one as taken, it makes this device's.
                held = self.worker_spec  # type: ignore[has-type]
                self.worker_spec = {d: None for d in self.cuda_visible_devices if d != device}
                try:
                    ((_, spec),) = super().new_worker_spec().items()
                finally:
                    self.worker_spec = held
                if self.mps is not None:
                    spec["options"]["env"] = {**spec["options"].get("env", {}), **self.mps.env}
                return {name: spec}
            raise ValueError(
                f"cannot start more than {per_device} workers on each of the GPUs {self.cuda_visible_devices}"
            )

    try:
        return SharedCUDACluster(CUDA_VISIBLE_DEVICES=visible, n_workers=len(devices) * per_device, **kwargs)
    except BaseException:
        if daemon is not None:
            daemon.stop()
        raise
