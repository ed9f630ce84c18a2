"""A local cluster of GPU workers, several per GPU where asked (``cluster.workers_per_device``).

dask-cuda's ``LocalCUDACluster`` starts one worker per entry of ``CUDA_VISIBLE_DEVICES``
and names each worker by its device, so a device listed twice is refused. This subclass
names its workers ``DEVICE-K`` (K from 0 to N-1) and lets ``LocalCUDACluster`` make each
one's spec as for its device alone: the same ``CUDA_VISIBLE_DEVICES`` (its GPU first), RMM
set-up, preloads and plugins, so N workers share the GPU, each with its own context and
pool (the RMM options given are each worker's).

dask-cuda is imported when a cluster starts, so this module imports without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["start_cuda_cluster", "worker_names"]


def worker_names(devices: list[Any], per_device: int) -> list[tuple[str, Any]]:
    """(worker name, device) of every worker, each device's ``per_device`` in turn."""
    return [(f"{d}-{k}", d) for d in devices for k in range(per_device)]


def start_cuda_cluster(devices: list[int], per_device: int, **kwargs: Any) -> Any:
    """A ``LocalCUDACluster`` of ``per_device`` workers on each GPU of ``devices`` (ordinals);
    ``kwargs`` are its keywords, the RMM options each worker's."""
    from dask_cuda import LocalCUDACluster

    visible = ",".join(str(d) for d in devices)
    if per_device == 1:
        return LocalCUDACluster(CUDA_VISIBLE_DEVICES=visible, **kwargs)

    class SharedCUDACluster(LocalCUDACluster):
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
                return {name: spec}
            raise ValueError(
                f"cannot start more than {per_device} workers on each of the GPUs {self.cuda_visible_devices}"
            )

    return SharedCUDACluster(CUDA_VISIBLE_DEVICES=visible, n_workers=len(devices) * per_device, **kwargs)
