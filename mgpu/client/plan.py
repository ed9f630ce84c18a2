"""Check jobs before anything starts and make each one's workload from the registry."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import JobInputError
from ..spec import Job
from ..tiling import Plan, check_tiling_keys
from ..worker.device import DeviceFacts
from ..workloads import get_workload_class
from ..workloads.base import Outputs, Workload

__all__ = ["Prepared", "check_outputs_distinct", "plan_job", "prepare"]


@dataclass
class Prepared:
    """A job checked and ready: its workload, tiling, and the outputs it will write."""

    job: Job
    workload: Workload
    tiling: dict[str, int]


def prepare(job: Job) -> Prepared:
    """Make ``job``'s workload, check its tiling keys and its outputs (raises JobInputError)."""
    workload_cls = get_workload_class(job.workload)
    workload = workload_cls(job.params, verify=job.verify)
    tiling = check_tiling_keys(job.tiling, workload_cls.axes, job.workload)
    if isinstance(workload, Outputs):
        workload.prepare(force=job.force)
    return Prepared(job, workload, tiling)


def check_outputs_distinct(prepared: list[Prepared]) -> None:
    """Raise JobInputError if two jobs of one run would write the same file."""
    # Each output is checked against the disk before anything runs; two jobs of one run
    # writing the same file would pass that check and the later would replace the earlier.
    seen: dict[str, str] = {}
    for p in prepared:
        for sink in p.workload.sinks.values():
            if sink.keep and sink.path in seen:
                raise JobInputError(
                    f"params.output: jobs {seen[sink.path]!r} and {p.job.name!r} both write "
                    f"{sink.path}; give each job its own output"
                )
            seen[sink.path] = p.job.name


def plan_job(p: Prepared, devices: dict[str, DeviceFacts], budget: int, *, slots: bool, spill: bool) -> Plan:
    """The job's plan for ``devices`` with ``budget`` bytes each; with ``slots`` the
    workload's concurrent tiles share a device's budget.

    Raises
    ------
    JobInputError
        If the job cannot be tiled for these devices.
    """
    sharing = p.workload.concurrency if slots else 1  # tiles on one device at once
    return p.workload.plan(devices, budget // sharing, p.tiling, spill=spill)
