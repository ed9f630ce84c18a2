"""Job.cluster -> a Dask client: LocalCUDACluster (one worker per GPU), LocalCluster (CPU
workers) or a running scheduler. A cluster mgpu starts is closed however the job ends."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import ipaddress
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import psutil
from distributed import Client, LocalCluster, SpecCluster

from . import config, mps
from .connection import send_promptly, take_ahead
from .ending import end_workers, kill_processes, worker_processes
from .errors import JobInputError
from .forkserver import forking
from .gpus import nvml_gpus, visible_count
from .lifetime import COLLECTOR_PRELOAD
from .memory import AllocatorChoice, rmm_options
from .sharing import shared_by
from .signals import WORKER_PRELOAD, deferred
from .sizes import format_bytes, resolve_size
from .spec import ClusterSpec
from .worker.device import DeviceFacts, address_space_room
from .worker.plugins import AllocatorStats, PoolMetrics, RuntimeSetup, SettingsSetup, SpillToManaged
from .worker.tasks import device_facts, open_job, take_turns

__all__ = [
    "ClusterInfo",
    "ResolvedCluster",
    "budget_basis",
    "Survey",
    "budget_for",
    "describe_workers",
    "expected_devices",
    "is_loopback",
    "open_cluster",
    "resolve_cluster",
    "scheduler_address",
    "survey",
    "worker_budget",
]

# The per-device budget when memory_limit is "auto": room for the allocator and CUDA.
AUTO_BUDGET = {"cuda": 0.8, "cpu": 0.5}

# How long closing a cluster may take before its workers are killed, after a job that
# ended well or not (stopped by Ctrl-C or SIGTERM, mgpu must end within a few seconds even
# with a worker stopped or hung).
CLOSE_S = {False: 10.0, True: 3.0}
# How long the workers of a cluster whose jobs are done may take to end, killed (see
# mgpu.ending), before the cluster's own close goes on.
END_S = 2.0

# Each worker mgpu starts offers one unit of this Dask resource: a tile task takes
# 1/concurrency of it, so a workload decides how many of its tiles share a device at once.
SLOT = "mgpu-slot"
# Task threads per GPU worker: enough for the most tiles a workload runs at once on one
# device (Mandelbrot's eight); the slot resource keeps exclusive tiles exclusive.
GPU_THREADS = 8


@dataclass(frozen=True)
class ResolvedCluster:
    """The cluster section checked against this machine, before anything starts."""

    backend: str  # "cuda" | "cpu" | "auto" (auto: each joined worker decides)
    devices: list[int]  # GPU ordinals, or CPU worker indices
    allocator: str
    protocol: str
    memory_limit: int | float | str  # "auto": AUTO_BUDGET of each worker's own kind
    scheduler: str | None
    dashboard: str | None
    why: str = ""  # why this backend, for the first line the user sees
    spill: str = "none"  # "managed" only where it can work: GPU workers mgpu starts
    workers_per_device: int = 1  # worker processes mgpu starts on each GPU
    mps: str | None = None  # the MPS control program whose daemon those workers share (mgpu.mps)
    mps_required: bool = False  # cluster.mps: true (else a daemon that does not start is done without)


@dataclass
class ClusterInfo:
    """A connected cluster and what its workers reported."""

    client: Client
    resolved: ResolvedCluster
    owned: bool
    devices: dict[str, DeviceFacts] = field(default_factory=dict)  # worker address -> facts
    spills: bool = False  # allocations past the budget go to managed memory
    slots: bool = False  # every worker offers the SLOT resource
    # Each worker's software versions and driver (mgpu.roofline.software), from the same
    # round trip as ``devices``: what keys its ceilings in the cache.
    software: dict[str, dict[str, str]] = field(default_factory=dict)
    # A GPU worker's environment for the results (mgpu.info.runtime_env), asked once.
    worker_env: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The keys of the warm-ups each worker has run, as the job found it (Survey.warmed).
    warmed: dict[str, frozenset[str]] = field(default_factory=dict)
    # The MPS control daemon of a cluster mgpu started whose workers share GPUs (mgpu.mps).
    mps: mps.MpsDaemon | None = None

    def tile_resources(self, concurrency: int) -> dict[str, float] | None:
        """The Dask resources a tile task asks for, when ``concurrency`` tiles may share a device."""
        return {SLOT: 1.0 / concurrency} if self.slots else None

    @property
    def backend(self) -> str:
        kinds = {f.backend for f in self.devices.values()}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @functools.cached_property
    def dashboard_link(self) -> str | None:
        # Asked once: Dask's client asks the scheduler each time.
        try:
            return self.client.dashboard_link if self.resolved.dashboard or not self.owned else None
        except Exception:
            return None

    @property
    def dashboard_address(self) -> tuple[str, str] | None:
        """Where the dashboard of a cluster mgpu started listens (``HOST:PORT`` as bound, the
        port the real one if the asked one was taken) and the link to open; None if off."""
        if not self.owned or not self.resolved.dashboard:
            return None
        link = self.dashboard_link
        if link is None:
            return None
        host = self.resolved.dashboard.rpartition(":")[0] or "127.0.0.1"
        port = urlsplit(link).port
        if host in ("0.0.0.0", "", "::", "[::]"):
            link = link.replace(urlsplit(link).netloc, f"{socket.gethostname()}:{port}", 1)
        else:
            link = link.replace(urlsplit(link).netloc, f"{host}:{port}", 1)
        return f"{host}:{port}", link

    def budget(self) -> int:
        """Bytes each task may hold on its device: the smallest worker's share."""
        return budget_for(self.resolved.memory_limit, self.devices)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a dashboard's bind address) is reachable from this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to an outside interface


def budget_for(memory_limit: int | float | str, devices: dict[str, DeviceFacts]) -> int:
    """Bytes each task may hold on its device under ``cluster.memory_limit``: the smallest
    worker's budget (see :func:`worker_budget`)."""
    shared = shared_by(devices)
    return min(worker_budget(memory_limit, f, shared[addr]) for addr, f in devices.items())


def worker_budget(memory_limit: int | float | str, facts: DeviceFacts, shared: int = 1) -> int:
    """One worker's budget, one of ``shared`` workers on its device.

    ``cluster.memory_limit`` is a GPU's budget, which the workers sharing it split; a
    worker whose allocator has a known size (an RMM pool's limit or size) gets no more
    than that. Under ``auto`` such a worker gets its pool; one without gets
    :data:`AUTO_BUDGET` of its device, its share of it (at most the memory free on the
    device) where several share one. A CPU worker's memory is its own already (its
    memory limit), so it is not split.
    """
    if facts.backend != "cuda":
        shared = 1
    if isinstance(memory_limit, str):  # "auto" is the only string a checked memory_limit holds
        if facts.budget is not None:
            return facts.budget
        device = resolve_size(AUTO_BUDGET[facts.backend], facts.memory)
        return device if shared == 1 else min(device // shared, facts.free)
    share = resolve_size(memory_limit, facts.memory) // shared
    return share if facts.budget is None else min(share, facts.budget)


def budget_basis(memory_limit: int | float | str, devices: dict[str, DeviceFacts]) -> str:
    """Where the budget :func:`budget_for` gives came from, for a message: the worker whose
    budget is the smallest and what set it."""
    shared = shared_by(devices)
    addr, facts = min(devices.items(), key=lambda kv: worker_budget(memory_limit, kv[1], shared[kv[0]]))
    budget = worker_budget(memory_limit, facts, shared[addr])
    auto = isinstance(memory_limit, str)
    if auto and facts.budget is not None:
        why = "the size of its RMM pool"
    elif facts.backend != "cuda":
        why = f"{AUTO_BUDGET['cpu'] if auto else 'cluster.memory_limit'} of its memory limit, {format_bytes(facts.memory)}"
    else:
        why = f"{AUTO_BUDGET['cuda'] if auto else 'cluster.memory_limit'} of its GPU's {format_bytes(facts.memory)}"
    if facts.backend == "cuda" and shared[addr] > 1:
        why += f", shared by {shared[addr]} workers"
    return f"the budget, {format_bytes(budget)} a worker, is worker {addr}'s: {why}"


def expected_devices(rc: ResolvedCluster) -> dict[str, DeviceFacts] | None:
    """The devices of the cluster mgpu would start for ``rc``, without starting it.

    CPU workers get the memory LocalCluster gives each (its share of the host's, as
    Dask computes it); GPUs are described by NVML, with no CUDA context in this process.
    None for a joined cluster (its workers are known once connected), or where NVML
    cannot say.
    """
    if rc.scheduler:
        return None
    host = socket.gethostname()
    if rc.backend == "cpu":
        from distributed.worker_memory import parse_memory_limit

        share = parse_memory_limit("auto", 1, max(1, len(rc.devices)), logger=logging.getLogger(__name__))
        memory = address_space_room(share or psutil.virtual_memory().total)
        return {f"cpu-{i}": DeviceFacts("cpu", i, "cpu", memory, memory, host) for i in range(len(rc.devices))}
    try:
        return _nvml_facts(rc.devices, host, rc.workers_per_device)
    except Exception:
        return None


def _nvml_facts(ordinals: list[int], host: str, per_device: int = 1) -> dict[str, DeviceFacts]:
    out = {}
    for gpu in nvml_gpus(ordinals):
        for k in range(per_device):
            out[f"cuda-{gpu.index}" + (f"-{k}" if per_device > 1 else "")] = DeviceFacts(
                "cuda", gpu.index, gpu.name, gpu.memory, gpu.free, host, gpu.compute_capability, uuid=gpu.uuid
            )
    return out


def _cuda_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("cupy", "dask_cuda")) and visible_count() > 0


_HOST_PORT = re.compile(r"^[\w.\-]+:\d+$|^\[[0-9a-fA-F:]+\]:\d+$")


def scheduler_address(value: str) -> str:
    """The address in ``cluster.scheduler``: an address as given, or read from a scheduler file.

    Raises
    ------
    JobInputError
        If it is neither an address (``tcp://host:8786``, ``host:8786``) nor a readable
        scheduler file.
    """
    if "://" in value or (_HOST_PORT.match(value) and not os.path.exists(value)):
        return value
    if not os.path.isfile(value):
        raise JobInputError(
            f"cluster.scheduler: {value!r} is neither an address (tcp://HOST:8786) nor an "
            "existing scheduler file (dask scheduler --scheduler-file PATH)"
        )
    try:
        with open(value) as f:
            return str(json.load(f)["address"])
    except (OSError, ValueError, KeyError, TypeError):
        raise JobInputError(
            f"cluster.scheduler: {value!r} is not a scheduler file (JSON with an 'address', as "
            "dask scheduler --scheduler-file writes)"
        ) from None


def resolve_cluster(spec: ClusterSpec, *, given_client: bool = False) -> ResolvedCluster:
    """Check the cluster section against this machine; raise JobInputError if it cannot be.

    With ``given_client`` the job runs on a client the caller made (``mgpu.run(job,
    client)``): as on a joined scheduler, its workers are taken as they are.

    Raises
    ------
    JobInputError
        If CUDA was asked for without a GPU, a device does not exist, or UCX is missing;
        or a scheduler is named beside a given client.
    """
    if given_client and spec.scheduler:
        raise JobInputError(
            f"cluster.scheduler: {spec.scheduler!r} names a scheduler, but a Dask client was given to run "
            "the job on; give one or the other (cluster.scheduler: null)"
        )
    if spec.scheduler or given_client:
        if spec.scheduler:
            scheduler_address(spec.scheduler)
        backend = "auto" if spec.backend == "auto" else spec.backend
        return ResolvedCluster(
            backend,
            [],
            spec.allocator,
            spec.protocol,
            spec.memory_limit,
            spec.scheduler,
            spec.dashboard,
            "the client given" if given_client else "joined cluster",
        )

    backend = spec.backend
    why = f"backend: {backend}"
    if backend == "auto":
        backend = "cuda" if _cuda_available() else "cpu"
        why = "GPUs found" if backend == "cuda" else "no GPU visible, so CPU workers"
    elif backend == "cuda" and not _cuda_available():
        raise JobInputError(
            "cluster.backend: cuda was asked for, but no GPU is visible or CuPy/dask-cuda is not "
            "installed (pip install 'mgpu[cuda13]'); use backend: cpu or auto"
        )
    available = visible_count() if backend == "cuda" else (os.cpu_count() or 1)
    devices = spec.devices
    if backend == "cpu":
        _check_cpu_devices(devices, available, chosen=spec.backend == "cpu")
    if devices == "all":
        ids = list(range(available))
    elif isinstance(devices, int):
        if backend == "cuda" and devices > available:
            raise JobInputError(f"cluster.devices: {devices} GPUs asked for, this machine has {available}")
        ids = list(range(devices))
    else:
        missing = [d for d in devices if backend == "cuda" and d >= available]
        if missing:
            raise JobInputError(
                f"cluster.devices: device {missing[0]} does not exist; this machine has "
                f"{available} GPU(s), ids 0-{available - 1}"
            )
        ids = list(devices)

    protocol = spec.protocol
    if protocol == "auto":
        protocol = "tcp"
    if protocol == "ucx":
        if backend != "cuda":
            raise JobInputError("cluster.protocol: ucx is for GPU workers; use tcp or auto with backend: cpu")
        if importlib.util.find_spec("distributed_ucxx") is None:
            raise JobInputError(
                "cluster.protocol: ucx needs distributed-ucxx (pip install 'mgpu[cuda13]'); use tcp or auto"
            )
    # Spilling needs an RMM resource to wrap: GPU workers with a pool or async allocator.
    spill = spec.spill if backend == "cuda" and AllocatorChoice(spec.allocator).can_spill else "none"
    # CPU workers are one per core already: several per device is for GPUs.
    per_device = spec.workers_per_device if backend == "cuda" else 1
    return ResolvedCluster(
        backend,
        ids,
        spec.allocator,
        protocol,
        spec.memory_limit,
        None,
        spec.dashboard,
        why,
        spill,
        per_device,
        _mps_program(spec.mps) if per_device > 1 else None,
        spec.mps is True,
    )


def _mps_program(choice: str | bool) -> str | None:
    """The MPS control program the workers sharing a GPU use: where installed, unless
    ``cluster.mps`` is false.

    Raises
    ------
    JobInputError
        If ``cluster.mps`` is true and the program is not installed.
    """
    program = mps.control_program() if choice is not False else None
    if choice is True and program is None:
        raise JobInputError(
            f"cluster.mps: true needs NVIDIA's {mps.CONTROL} on PATH, and it is not there; "
            "use auto (MPS where installed) or false (the workers take turns at the GPU)"
        )
    return program


def _check_cpu_devices(devices: str | int | list[int], cores: int, *, chosen: bool) -> None:
    """CPU workers are one a core: refuse more than the cores, and GPU ids without a GPU.

    Raises
    ------
    JobInputError
        Naming what was asked for and what this machine has.
    """
    have = f"this machine has {cores} CPU core{'s' * (cores != 1)} (one CPU worker each)"
    if isinstance(devices, int) and devices > cores:
        raise JobInputError(f"cluster.devices: {devices} CPU workers asked for, but {have}; give at most {cores}")
    if isinstance(devices, list):
        if not chosen:
            raise JobInputError(
                f"cluster.devices: {devices} names GPU ids, but no GPU is visible, so the job would run on "
                f"CPU workers; give a count of CPU workers (--devices {min(len(devices), cores)}), or "
                "backend: cpu with worker ids"
            )
        if max(devices) >= cores:
            raise JobInputError(f"cluster.devices: CPU worker {max(devices)} does not exist; {have}, ids 0-{cores - 1}")


def _start_cuda(rc: ResolvedCluster) -> Any:
    from .cuda_cluster import start_cuda_cluster

    budget = AUTO_BUDGET["cuda"] if rc.memory_limit == "auto" else rc.memory_limit
    per_device = rc.workers_per_device
    # Each worker's pool is its share of the device's budget.
    share = budget / per_device if isinstance(budget, float) else int(budget) // per_device
    return start_cuda_cluster(
        rc.devices,
        per_device,
        _start_mps(rc),
        host="127.0.0.1",  # nothing outside this machine needs to reach a cluster mgpu starts
        protocol=rc.protocol,
        dashboard_address=rc.dashboard,
        threads_per_worker=GPU_THREADS,
        resources={SLOT: 1},
        silence_logs=logging.WARNING,
        preload=[WORKER_PRELOAD, COLLECTOR_PRELOAD],
        **rmm_options(rc.allocator, share, rc.spill),
    )


def _start_mps(rc: ResolvedCluster) -> mps.MpsDaemon | None:
    """The MPS control daemon of a cluster whose workers share GPUs, where it has one.

    Raises
    ------
    JobInputError
        If ``cluster.mps`` is true and the daemon does not start; with ``auto`` the
        workers take turns instead, and a warning says why.
    """
    if rc.mps is None:
        return None
    try:
        return mps.start_daemon(rc.mps)
    except RuntimeError as e:
        if rc.mps_required:
            raise JobInputError(f"cluster.mps: true, but {e}; use auto or false") from None
        warnings.warn(f"{e}: the workers sharing a GPU take turns at it instead", RuntimeWarning, stacklevel=2)
        return None


def _start_cpu(rc: ResolvedCluster) -> LocalCluster:
    return LocalCluster(
        n_workers=len(rc.devices),
        threads_per_worker=1,
        resources={SLOT: 1},
        processes=True,
        host="127.0.0.1",
        dashboard_address=rc.dashboard,
        silence_logs=logging.WARNING,
        preload=[WORKER_PRELOAD, COLLECTOR_PRELOAD],
    )


def _describe(
    settings: dict[str, Any] | None = None, dask_worker: Any = None
) -> tuple[DeviceFacts, dict[str, str], bool, list[str]] | None:
    """This worker's :class:`Survey` entries; None, asking nothing, where ``settings`` are
    given and the worker lacks mgpu's setup with them."""
    from .roofline import software

    if settings is not None and not _set_up(settings, dask_worker):
        return None
    state = getattr(dask_worker, "state", None)
    slot = SLOT in (getattr(state, "total_resources", None) or {})
    return device_facts(dask_worker), software(), slot, open_job(dask_worker)


@dataclass(frozen=True)
class Survey:
    """What one round trip to the workers tells: each one's device facts (address ->
    facts, in the order tiles are placed), software (address -> :func:`mgpu.roofline.software`),
    whether every worker offers the SLOT resource, and the keys of the warm-ups each has
    run (address -> keys, see :func:`mgpu.worker.tasks.open_job`, which also opens the
    job's window of allocator statistics)."""

    devices: dict[str, DeviceFacts]
    software: dict[str, dict[str, str]]
    slots: bool
    warmed: dict[str, frozenset[str]] = field(default_factory=dict)


def survey(client: Client) -> Survey:
    """Ask every worker for its :class:`Survey` entries, in one round trip; where workers
    share a GPU, a second tells them to take turns at it (:mod:`mgpu.worker.turns`)."""
    found = _survey(client)
    assert found is not None  # asked without settings: every worker answers
    return found


def _survey(client: Client, settings: config.Settings | None = None, stream: float | None = None) -> Survey | None:
    """:func:`survey`; with ``settings``, None (the workers asked nothing else) unless
    every worker has mgpu's setup with them. With ``stream`` (a time), the scheduler's
    task stream is opened from then in the same round trip (see :func:`open_cluster`)."""
    wanted = settings.as_dask_config() if settings is not None else None
    on_error: Literal["return", "raise"] = "return" if settings is not None else "raise"

    async def ask() -> Any:
        asks = [client.run(_describe, wanted, on_error=on_error, asynchronous=True)]
        if stream is not None:
            asks.append(client.scheduler.get_task_stream(start=stream))
        return (await asyncio.gather(*asks))[0]

    answers = client.sync(ask)
    if settings is not None and not (answers and all(isinstance(a, tuple) for a in answers.values())):
        return None
    facts = {addr: f for addr, (f, _, _, _) in answers.items()}
    ordered = dict(sorted(facts.items(), key=lambda kv: (kv[1].host, kv[1].id, kv[0])))
    shared = turn_takers(ordered)
    if shared:
        client.run(take_turns, shared, workers=list(shared))
    return Survey(
        ordered,
        {addr: versions for addr, (_, versions, _, _) in answers.items()},
        bool(answers) and all(slot for _, _, slot, _ in answers.values()),
        {addr: frozenset(keys) for addr, (_, _, _, keys) in answers.items()},
    )


def turn_takers(devices: dict[str, DeviceFacts]) -> dict[str, int]:
    """The workers that take turns at their GPU (address -> how many share it): those that
    share one, unless their work goes to an MPS server (:mod:`mgpu.mps`), where it runs
    side by side with no switch between contexts to save."""
    return {addr: n for addr, n in shared_by(devices).items() if n > 1 and not devices[addr].mps}


def _set_up(settings: dict[str, Any], dask_worker: Any = None) -> bool:
    """Whether this worker has mgpu's setup, with these settings (a cluster that ``mgpu
    cluster up`` holds has, from the submits before)."""
    plugins = dask_worker.plugins
    held = plugins.get(SettingsSetup.name)
    return (
        held is not None
        and held.settings.as_dask_config() == settings
        and all(name in plugins for name in (RuntimeSetup.name, AllocatorStats.name))
    )


def describe_workers(client: Client) -> dict[str, DeviceFacts]:
    """Each worker's device facts (address -> facts), in the order tiles are placed."""
    return survey(client).devices


def _join(rc: ResolvedCluster, security: Any) -> Client:
    try:
        # The connection the command began while it checked the jobs (plain TCP only).
        client = take_ahead(rc.scheduler) if security is None else None  # type: ignore[arg-type]
        if client is not None:
            return client
        if os.path.isfile(rc.scheduler):  # type: ignore[arg-type]
            return Client(scheduler_file=rc.scheduler, security=security)
        return Client(rc.scheduler, security=security)
    except (OSError, TimeoutError) as e:
        raise JobInputError(
            f"cluster.scheduler: could not connect to {scheduler_address(rc.scheduler)} "  # type: ignore[arg-type]
            f"({type(e).__name__}: {e}); is the scheduler running, and is the address right?"
        ) from None


def _silence_distributed_logs() -> None:
    logging.getLogger("distributed").setLevel(logging.CRITICAL)


def _silence_task_errors() -> None:
    # A task that raises reaches the user as mgpu's one message (its key and exception);
    # the worker's own log of it, and of the tasks cancelled after, would print tracebacks.
    logging.getLogger("distributed.worker").setLevel(logging.CRITICAL)


def _quiet_teardown(client: Client) -> None:
    """Before closing a cluster mgpu started, stopped or failed mid-job: its workers, closed
    with tiles still running, would print Dask's teardown (cancelled tasks, a heartbeat to
    a closed scheduler, with tracebacks) under mgpu's own message."""
    with contextlib.suppress(Exception):
        client.run(_silence_distributed_logs, callback_timeout=1)
        client.run(_silence_distributed_logs, nanny=True, callback_timeout=1)


def _start(rc: ResolvedCluster) -> Any:
    with warnings.catch_warnings():
        # A taken dashboard port moves to a free one; the address printed is the real one.
        warnings.filterwarnings("ignore", message="Port .* is already in use", category=UserWarning)
        with forking():  # from the command's fork server, where it started one
            return _start_cuda(rc) if rc.backend == "cuda" else _start_cpu(rc)


def _close_within(seconds: float, client: Client | None, cluster: Any, *, quiet: bool, done: bool = False) -> None:
    """Close the client and the cluster; a cluster not closed within ``seconds`` (a worker
    stopped or hung never answers its nanny) has its worker processes killed. ``done``:
    the jobs ended and their results are committed, so the workers are ended at once
    (:func:`mgpu.ending.end_workers`) rather than wound down."""

    def close() -> None:
        if client is not None:
            if quiet and cluster is not None:
                _quiet_teardown(client)
            with contextlib.suppress(Exception):
                client.close(timeout=seconds)
        if cluster is not None:
            logs = logging.getLogger("distributed")
            level = logs.level
            if done:
                # Each killed worker's comm closes under the scheduler here, which would
                # log it with a traceback; the jobs are done and said all there is to say.
                logs.setLevel(logging.CRITICAL)
                with contextlib.suppress(Exception):
                    end_workers(cluster, END_S)
            with contextlib.suppress(Exception):
                cluster.close(timeout=seconds)
            logs.setLevel(level)  # a process that goes on (the Python API's) logs as it did

    closer = threading.Thread(target=close, name="mgpu-close", daemon=True)
    closer.start()
    closer.join(seconds)
    if closer.is_alive() and cluster is not None:
        _kill_workers(cluster)
        closer.join(1.0)
    if cluster is not None:
        # Closed or its workers killed: distributed's own close at exit would wait on it again.
        SpecCluster._instances.discard(cluster)


def _kill_workers(cluster: Any) -> None:
    """SIGKILL the worker processes of a cluster mgpu started (children of this process)."""
    kill_processes(worker_processes(cluster))


@contextlib.contextmanager
def open_cluster(
    rc: ResolvedCluster, security: Any = None, settings: config.Settings | None = None, client: Client | None = None
) -> Iterator[ClusterInfo]:
    """Start (or join) the cluster, set each worker's settings and device up, and close what
    was started.

    The cluster is closed on success, failure and Ctrl-C alike; a joined cluster, or the
    one of a ``client`` given, is left running. ``security`` (a
    ``distributed.security.Security``) is for joining over TLS; ``settings`` are the
    ``mgpu.*`` settings the workers get (by default :func:`mgpu.config.load`'s, checked
    before anything starts).
    """
    settings = settings or config.load()
    cluster = None
    half_started: list[Any] = []
    given = client is not None
    try:
        if client is None and rc.scheduler:
            client = _join(rc, security)
        elif client is None:
            before = set(SpecCluster._instances)
            try:
                cluster = _start(rc)
            except BaseException:
                # Stopped (Ctrl-C) or failed while it started: the cluster exists but was
                # never returned; it is closed below like any other.
                half_started = [c for c in SpecCluster._instances if c not in before]
                raise
            # mgpu says which worker it lost and what it does about it; the nanny's restart
            # warning beside that says it again, for Dask's own users.
            logging.getLogger("distributed.nanny").setLevel(logging.ERROR)
            client = Client(cluster)
        if not given:
            send_promptly(client)
        # The task stream records only once its scheduler plugin exists, which opening a
        # dashboard page does; asking for it here keeps every task for a later look.
        stream = time.time() if rc.dashboard or rc.scheduler or given else None
        # A joined cluster whose every worker has mgpu's setup with these settings (one that
        # mgpu cluster up holds) keeps it: the one round trip that finds its workers tells.
        found = None
        if cluster is None and rc.spill != "managed":
            found = _survey(client, settings, stream)
        if found is None:
            client.register_plugin(SettingsSetup(settings))
            if cluster is not None:
                client.run(_silence_task_errors)
            client.register_plugin(RuntimeSetup(rc.backend))
            if rc.spill == "managed":
                client.register_plugin(SpillToManaged())
            # Last, so its statistics adaptor sits on top of whatever the plugins above installed.
            client.register_plugin(AllocatorStats())
            if importlib.util.find_spec("prometheus_client") is not None:
                client.register_plugin(PoolMetrics())  # reads the statistics adaptor above
            found = _survey(client, stream=stream)
            assert found is not None  # asked without settings: every worker answers
        if not found.devices:
            where = f"the scheduler at {rc.scheduler}" if rc.scheduler else "the cluster of the client given"
            raise JobInputError(f"cluster.scheduler: {where} has no workers")
        # The client Dask's own calls find (distributed.wait): one connected ahead is no default.
        with contextlib.nullcontext() if given else client.as_current():
            # Workers started without the resource (a joined cluster's) run tiles one per thread.
            yield ClusterInfo(
                client,
                rc,
                owned=cluster is not None,
                devices=found.devices,
                spills=rc.spill == "managed",
                slots=found.slots,
                software=found.software,
                warmed=found.warmed,
                mps=getattr(cluster, "mps", None),
            )
    finally:
        # Stopped (Ctrl-C, SIGTERM: signals.Interrupted) or failed: tiles may still be running.
        stopped = sys.exc_info()[1] is not None
        with deferred():  # a signal now would leave worker processes behind
            _close_within(CLOSE_S[stopped], client if not given else None, cluster, quiet=stopped, done=not stopped)
            for stray in half_started:
                _close_within(CLOSE_S[stopped], None, stray, quiet=False)
            if half_started:
                # Its nannies' start, cut short, would be reported at exit as tasks never awaited.
                logging.getLogger("asyncio").setLevel(logging.CRITICAL)
                logging.getLogger("distributed").setLevel(logging.CRITICAL)
