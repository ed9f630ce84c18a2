"""The GPUs this process can see, found in one place.

Two ways to ask, for two kinds of process. Without a CUDA context (the client, the
planner, ``mgpu info``'s count) NVML answers, with ``CUDA_VISIBLE_DEVICES`` applied by
hand since NVML ignores it. Inside a worker, which has its context already, the CUDA
runtime answers (through CuPy). Both name a device by its UUID: two workers on one GPU see
the same UUID whatever their ordinals, and a MIG slice has a UUID of its own.

GPU libraries are imported inside the functions, so this module imports anywhere.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Gpu",
    "can_access_peer",
    "cuda_count",
    "cuda_gpu",
    "cuda_name",
    "driver_version",
    "format_uuid",
    "nvlink_links",
    "nvml_gpus",
    "peer_pairs",
    "uuid_bytes",
    "visible_count",
    "visible_devices",
]


@dataclass(frozen=True)
class Gpu:
    """One GPU (or MIG slice) as this process sees it."""

    index: int  # the ordinal in this process (after CUDA_VISIBLE_DEVICES)
    uuid: str  # "GPU-…" (or "MIG-…" from NVML): the physical device, whatever the ordinal
    name: str
    memory: int  # bytes in total
    free: int  # bytes free when asked
    compute_capability: str | None = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def format_uuid(raw: bytes) -> str:
    """CUDA's 16 UUID bytes in NVML's form: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def visible_devices() -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (ordinals or UUIDs), or None where it is unset."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return [v.strip() for v in visible.split(",") if v.strip()]


# -- without a CUDA context: NVML ------------------------------------------------------------


@functools.cache
def _nvml() -> Any:
    """pynvml, initialised once in this process and left so: each init after a shutdown
    reads every GPU's state anew (tens of milliseconds, more with more GPUs), while an
    init of an initialised NVML (dask-cuda's and distributed's own) only counts one more.

    Raises
    ------
    Exception
        Whatever pynvml raises where it cannot start (no library, no driver); asked
        again, it tries again.
    """
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def visible_count() -> int:
    """How many CUDA devices this process can see, without creating a CUDA context.

    0 when NVML is not installed or no driver is loaded.
    """
    try:
        count = int(_nvml().nvmlDeviceGetCount())
    except Exception:
        return 0
    visible = visible_devices()
    return count if visible is None else min(count, len(visible))


def nvml_gpus(ordinals: list[int] | None = None) -> list[Gpu]:
    """The GPUs at ``ordinals`` (this process's, by default all it sees), described by NVML.

    Raises
    ------
    Exception
        Whatever NVML raises where it cannot answer (no library, no driver, no device).
    """
    pynvml = _nvml()
    visible = visible_devices()
    if ordinals is None:
        count = int(pynvml.nvmlDeviceGetCount())
        ordinals = list(range(count if visible is None else min(count, len(visible))))
    out = []
    for d in ordinals:
        which = visible[d] if visible is not None and d < len(visible) else str(d)
        if which.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(which))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(which)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        out.append(
            Gpu(
                index=d,
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                memory=int(mem.total),
                free=int(mem.free),
                compute_capability=f"{major}.{minor}",
            )
        )
    return out


def driver_version() -> str | None:
    """The driver's version as NVML gives it, or None where NVML cannot say."""
    try:
        return _text(_nvml().nvmlSystemGetDriverVersion())
    except Exception:
        return None


def nvlink_links(count: int) -> dict[str, int]:
    """Active NVLink links of each of the first ``count`` GPUs (by NVML index); empty when
    NVML cannot say."""
    try:
        pynvml = _nvml()
    except Exception:
        return {}
    out = {}
    for i in range(count):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        active = 0
        for link in range(18):
            try:
                active += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
            except pynvml.NVMLError:
                break
        out[str(i)] = active
    return out


# -- in a process with CUDA: the runtime, through CuPy ----------------------------------------


def cuda_count() -> int:
    """How many devices the CUDA runtime shows this process; 0 without CuPy or a driver."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


@functools.cache
def uuid_bytes(ordinal: int) -> bytes:
    """The 16 UUID bytes of this process's device ``ordinal`` (a MIG slice's own)."""
    import cupy

    return bytes(cupy.cuda.runtime.getDeviceProperties(ordinal)["uuid"])


def cuda_name(ordinal: int = 0) -> str:
    """The model name of this process's device ``ordinal``."""
    import cupy

    return _text(cupy.cuda.runtime.getDeviceProperties(ordinal)["name"])


def cuda_gpu(ordinal: int = 0) -> Gpu:
    """This process's device ``ordinal`` as the CUDA runtime describes it (its free memory
    asked on that device)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(ordinal)
    with cupy.cuda.Device(ordinal):
        free, total = cupy.cuda.runtime.memGetInfo()
    return Gpu(
        index=ordinal,
        uuid=format_uuid(uuid_bytes(ordinal)),
        name=_text(props["name"]),
        memory=int(total),
        free=int(free),
        compute_capability=f"{props['major']}.{props['minor']}",
    )


def can_access_peer(device: int, peer: int) -> bool:
    """Whether this process's ``device`` can reach its ``peer`` directly (another GPU only:
    a device is never its own peer)."""
    import cupy

    return device != peer and bool(cupy.cuda.runtime.deviceCanAccessPeer(device, peer))


def peer_pairs() -> list[list[int]]:
    """Every ordered pair of this process's devices that reach each other directly."""
    n = cuda_count()
    return [[i, j] for i in range(n) for j in range(n) if can_access_peer(i, j)]
