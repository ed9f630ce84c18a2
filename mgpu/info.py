"""What this machine and a cluster's workers have: GPUs, links, versions, allocators."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import platform
import threading
from typing import TYPE_CHECKING, Any

from . import gpus as gpus_
from .memory import AllocatorChoice

if TYPE_CHECKING:
    from collections.abc import Collection

    from .cluster import ClusterInfo

__all__ = ["machine_info", "read_versions", "read_versions_meanwhile", "runtime_env"]

_PACKAGES = (
    "mgpu",
    "numpy",
    "dask",
    "distributed",
    "pydantic",
    "cupy-cuda13x",
    "cupy-cuda12x",
    "rmm-cu13",
    "rmm-cu12",
    "dask-cuda",
    "distributed-ucxx-cu13",
    "distributed-ucxx-cu12",
)


def read_versions() -> None:
    """Read the client's package versions now (once a process: a process forked from it
    later keeps them)."""
    _found(False)


def read_versions_meanwhile() -> None:
    """Read the client's package versions (which a result records) on a thread of their
    own, while the command does other things: reading their metadata takes 15 ms and more."""
    threading.Thread(target=_found, args=(False,), name="mgpu-versions", daemon=True).start()


def _versions(*, load: bool = True) -> dict[str, str]:
    """Versions of the packages mgpu runs on, from their installed metadata; with ``load``,
    also those of CuPy, RMM and dask-cuda found on sys.path but not installed as a
    distribution (by importing them: never in a client, which needs none of them)."""
    return dict(_found(load))


@functools.cache
def _found(load: bool) -> dict[str, str]:
    # Asked once a process: reading the packages' metadata takes tens of milliseconds, and
    # a worker is asked at every job.
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if not load:
        return out
    for module in ("cupy", "rmm", "dask_cuda"):  # found on sys.path but not installed as a dist
        if module not in out and importlib.util.find_spec(module) is not None:
            try:
                out[module] = getattr(importlib.import_module(module), "__version__", "?")
            except Exception:
                pass
    return out


def _cuda_facts() -> dict[str, Any]:
    """Driver and runtime versions, GPUs, and which pairs can reach each other directly."""
    import cupy

    rt = cupy.cuda.runtime
    gpus = [
        {"id": g.index, "uuid": g.uuid, "name": g.name, "memory": g.memory, "compute_capability": g.compute_capability}
        for g in map(gpus_.cuda_gpu, range(gpus_.cuda_count()))
    ]
    return {
        "driver": rt.driverGetVersion(),
        "runtime": rt.runtimeGetVersion(),
        "gpus": gpus,
        "peer_access": gpus_.peer_pairs(),
        "nvlink": gpus_.nvlink_links(len(gpus)),
    }


def machine_info() -> dict[str, Any]:
    """``mgpu info``: devices, links, versions, allocators and transports of this machine."""
    info: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "versions": _versions()}
    if gpus_.visible_count() and importlib.util.find_spec("cupy") is not None:
        info["backend"] = "cuda"
        info.update(_cuda_facts())
    else:
        info["backend"] = "cpu"
        info["gpus"] = []
        info["note"] = (
            f"no GPU is visible; jobs run on {os.cpu_count()} CPU workers with NumPy (cluster.devices chooses how many)"
        )
    has_rmm = importlib.util.find_spec("rmm") is not None
    info["allocators"] = AllocatorChoice.names() if has_rmm else [AllocatorChoice.DEFAULT.value]
    info["ucx"] = importlib.util.find_spec("distributed_ucxx") is not None
    return info


def runtime_env(info: ClusterInfo, lost: Collection[str] = ()) -> dict[str, Any]:
    """The environment a result records: versions here and on a worker, GPUs, allocator,
    protocol. The worker asked is one still there (not in ``lost``): asking a lost one
    waits out a connect timeout."""
    env: dict[str, Any] = {
        "client": _versions(load=False),
        "allocator": info.resolved.allocator if info.backend == "cuda" else "numpy",
        "protocol": info.resolved.protocol,
        "gpus": sorted({f.name for f in info.devices.values()}),
        "hosts": sorted({f.host for f in info.devices.values()}),
    }
    if info.backend == "cuda":
        left = [w for w in info.devices if w not in lost]
        if not info.worker_env and left:  # asked once a cluster: the jobs after read it
            info.worker_env[left[0]] = info.client.run(_worker_env, workers=[left[0]])[left[0]]
        env["worker"] = next(iter(info.worker_env.values()), {})
    return env


def _worker_env() -> dict[str, Any]:
    import cupy

    rt = cupy.cuda.runtime
    return {
        "versions": _versions(),
        "driver": rt.driverGetVersion(),
        "runtime": rt.runtimeGetVersion(),
        "peer_access": gpus_.peer_pairs(),
    }
