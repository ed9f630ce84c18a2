"""Every check of a run before anything starts, for ``submit`` and ``submit --dry-run`` alike.

The job files and their keys are checked as they are read (:mod:`mgpu.spec`); here the
jobs are checked together against this machine and the files they touch: the cluster
section against the devices and cores there are (:func:`mgpu.cluster.resolve_cluster`),
the memory budget against what the workers will have, each workload's tiling and
outputs, no output written twice or over an input, the outputs' room on disk, any other
file mgpu writes (``--json``), and every job planned for the devices it would get.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..cluster import ResolvedCluster, budget_for, expected_devices, resolve_cluster, scheduler_address
from ..errors import JobInputError
from ..paths import check_writable, claim_path, holder_of
from ..security import check_tls
from ..sizes import format_bytes
from ..spec import Job, check_one_cluster
from ..tiling import Plan
from ..worker.device import DeviceFacts
from ..worker.sources import check_output_room
from .plan import Prepared, check_outputs_distinct, plan_job, prepare

__all__ = ["Checked", "check_written", "inputs_of", "outputs_of", "preflight"]


@dataclass
class Checked:
    """Jobs that passed every check: their cluster, workloads, and (for a cluster mgpu
    starts) the devices it will have and each job's plan for them."""

    resolved: ResolvedCluster
    prepared: list[Prepared]
    devices: dict[str, DeviceFacts] | None  # None: a joined cluster, known once connected
    plans: list[Plan] | None


def preflight(
    jobs: Sequence[Job], *, given_client: bool = False, security: Any = None, need_devices: bool = False
) -> Checked:
    """Check ``jobs`` as one run; start nothing and write nothing.

    Parameters
    ----------
    given_client
        The jobs run on a client the caller made (its workers are taken as they are).
    security
        For a TLS scheduler (checked against its address).
    need_devices
        Refuse a cluster whose devices cannot be known before it starts (``--dry-run``).

    Raises
    ------
    JobInputError
        Naming the key (or flag) and what is allowed.
    """
    check_one_cluster(jobs)
    resolved = resolve_cluster(jobs[0].cluster, given_client=given_client)
    if need_devices and resolved.scheduler:
        raise JobInputError(
            "--dry-run: plans for the cluster mgpu would start; the workers of "
            f"{scheduler_address(resolved.scheduler)} are known only once connected "
            "(leave out cluster.scheduler / --scheduler to see a plan for this machine)"
        )
    check_tls(scheduler_address(resolved.scheduler) if resolved.scheduler else None, security)
    prepared = [prepare(job) for job in jobs]
    check_outputs_distinct(prepared)
    _check_not_inputs(prepared)
    _check_unclaimed(prepared)
    check_output_room([sink for p in prepared for sink in p.workload.sinks.values()])
    # Every job is planned against the devices the cluster will have before it starts, so
    # a job too large for them is refused with nothing started (a joined cluster's
    # workers are known only once connected: its jobs are planned then, as every job is).
    devices = None if given_client else expected_devices(resolved)
    if need_devices and not devices:
        raise JobInputError("cluster.devices: NVML could not describe the GPUs asked for; is the driver loaded?")
    plans = None
    if devices:
        _check_budget(resolved.memory_limit, devices)
        budget = budget_for(resolved.memory_limit, devices)
        plans = [plan_job(p, devices, budget, slots=True, spill=resolved.spill == "managed") for p in prepared]
    return Checked(resolved, prepared, devices, plans)


def inputs_of(p: Prepared) -> dict[str, str]:
    """The files a job reads (absolute path -> its key)."""
    given = getattr(p.job.params, "input", None)
    if not isinstance(given, dict):
        return {}
    return {str(Path(path).resolve()): f"params.input.{name}" for name, path in given.items()}


def outputs_of(p: Prepared) -> list[tuple[str, str, str]]:
    """``(path, key, job name)`` of each file the job writes: its outputs, and the scratch
    files that stand for an image drawn from them."""
    return [(sink.path, sink.key, p.job.name) for sink in p.workload.sinks.values()]


def _check_not_inputs(prepared: list[Prepared]) -> None:
    read = {path: (key, p.job.name) for p in prepared for path, key in inputs_of(p).items()}
    for p in prepared:
        for sink in p.workload.sinks.values():
            if sink.keep and sink.path in read:
                key, job = read[sink.path]
                whose = "its own" if job == p.job.name else f"job {job!r}'s"
                raise JobInputError(
                    f"{sink.key}: {sink.path} is {whose} input ({key}); an output never replaces an input, "
                    "--force or not: give the output another name"
                )


def _check_unclaimed(prepared: list[Prepared]) -> None:
    """Refuse now an output another job is writing (its claim is taken when the run starts)."""
    for p in prepared:
        for path, key, _ in outputs_of(p):
            holder = holder_of(claim_path(path))
            if holder is not None:
                raise JobInputError(
                    f"{key}: {path} is being written by job {holder.get('job')!r} (pid {holder.get('pid')} on "
                    f"{holder.get('host')}); wait for it to end or give this job another output"
                )


def _check_budget(memory_limit: int | float | str, devices: dict[str, DeviceFacts]) -> None:
    """A budget in bytes cannot exceed what each worker has."""
    if isinstance(memory_limit, int):
        smallest = min(devices.values(), key=lambda f: f.memory)
        if memory_limit > smallest.memory:
            what = "GPU" if smallest.backend == "cuda" else "CPU worker"
            raise JobInputError(
                f"cluster.memory_limit: {format_bytes(memory_limit)} a worker, but each {what} has "
                f"{format_bytes(smallest.memory)}; give at most that, a fraction (0.8) or auto"
            )


def check_written(path: str | None, *, key: str, jobs: Sequence[Job], read: Sequence[str | os.PathLike[str]]) -> None:
    """Check a file mgpu writes beside the jobs' outputs (``--json``), before anything starts.

    It must be a file that can be written (see :func:`mgpu.paths.check_writable`), and
    neither a file the run reads (``read``: the job files; each job's inputs) nor an
    output of a job. ``-`` (stdout) and None pass.

    Raises
    ------
    JobInputError
        Naming ``key`` and the path.
    """
    if not path or path == "-":
        return
    target = check_writable(path, key=key)
    for f in read:
        if Path(f).exists() and Path(f).resolve() == Path(target):
            raise JobInputError(f"{key}: {path!r} is the job file {str(f)!r}; give another path")
    for job in jobs:
        given = getattr(job.params, "input", None)
        for name, f in given.items() if isinstance(given, dict) else ():
            if str(Path(f).resolve()) == target:
                raise JobInputError(f"{key}: {path!r} is job {job.name!r}'s input (params.input.{name})")
        output = getattr(job.params, "output", None)
        named = [output] if isinstance(output, str) else []
        if isinstance(output, BaseModel):
            named = list(output.model_dump().values())
        if any(isinstance(o, str) and str(Path(o).expanduser().resolve()) == target for o in named):
            raise JobInputError(f"{key}: {path!r} is an output of job {job.name!r}; give another path")
