"""How long a plan should take, from its workload's bound and the devices' measured ceilings;
and ``submit --dry-run``: every job planned and estimated with nothing started.

Each workload models a tile's time from the ceilings (:meth:`~mgpu.workloads.base.Workload.
expected_seconds`: by default its work at the rate of the ceiling that bounds it); where
its data crosses PCIe and that is slower, the host bytes at the summed pinned rate bound it
instead. Start-up (the cluster, the warm-up) is not in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dask.config

from .. import config, roofline
from ..sharing import share_rates
from ..sizes import format_bytes
from ..spec import Job
from ..tiling import Plan
from ..worker.device import DeviceFacts
from ..workloads import get_workload_class
from ..workloads.base import Estimates, HostBytes, Workload
from .preflight import preflight

__all__ = ["DryRun", "Estimate", "as_json", "describe", "dry_run", "estimate", "local_ceilings"]


@dataclass(frozen=True)
class Estimate:
    """The tiles' expected time, and what it rests on.

    The time a Result's ``compute_s`` measures: from the first tile's start to the last
    one's end. The cluster's start-up, the ceilings and the warm-up (a Result's
    ``startup``), and the outputs' commit, which ``wall_s`` adds, are not in it.
    """

    seconds: float
    basis: str

    def describe(self) -> str:
        return f"expected {_duration(self.seconds)} of tiles, start-up not included ({self.basis})"


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.3g} s"
    if s < 2 * 3600:
        return f"{s / 60:.3g} min"
    if s < 2 * 86400:
        return f"{s / 3600:.3g} h"
    return f"{s / 86400:.3g} days"


def estimate(
    workload: Workload, plan: Plan, ceilings: dict[str, dict[str, float]], *, at_once: bool = False
) -> Estimate | None:
    """The plan's expected time on devices with these ceilings (address -> {name: rate}).

    Every device at the slowest one's rates (static tiles wait for the slowest). None
    where the workload cannot say its work or a device has no figure for its ceiling.
    ``at_once``: the rates were measured with every worker of a host busy, as the tiles
    run (see :func:`mgpu.roofline.ceilings_at_once`); the basis says so.
    """
    if not ceilings:
        return None
    key = workload.ceiling()
    names = set.intersection(*(set(c) for c in ceilings.values()))
    rates = {name: min(c[name] for c in ceilings.values()) for name in names}
    if not isinstance(workload, Estimates):
        return None
    seconds = workload.expected_seconds(plan, rates, len(ceilings))
    if seconds is None:
        return None
    work = workload.expected_work(plan)
    amount = f"{work / workload.unit_scale:.4g} {workload.unit.split('/')[0]} " if work else ""
    measured = ", measured on every worker at once" if at_once else ""
    basis = f"{amount}at {len(ceilings)} x {rates[key]:.4g} {workload.unit} ({key}{measured})"
    host = workload.host_bytes() if isinstance(workload, HostBytes) else None
    pcie = [c.get("h2d_pinned") for c in ceilings.values()]
    if host and all(pcie):
        pcie_s = host / 1e9 / sum(pcie)  # type: ignore[arg-type]
        if pcie_s > seconds:
            seconds, basis = pcie_s, f"{format_bytes(host)} over {len(pcie)} x h2d_pinned"
    return Estimate(seconds, basis)


@dataclass
class DryRun:
    """One job as ``submit`` would run it: its plan for the devices it would get, and the estimate."""

    job: Job
    devices: dict[str, DeviceFacts]
    plan: Plan
    estimate: Estimate | None
    ceilings_from: str


def dry_run(jobs: Sequence[Job]) -> list[DryRun]:
    """Check, plan and estimate ``jobs`` against the devices a run would get; start nothing.

    CPU workers are described as LocalCluster would make them, GPUs through NVML (no CUDA
    context here); ceilings come from the cache, or on CPUs from a short calibration in a
    process set up as a worker is.

    Raises
    ------
    JobInputError
        Anything ``submit`` would refuse, or a joined cluster (``cluster.scheduler``),
        whose workers are known only once connected.
    """
    config.load()  # the mgpu.* settings, checked as submit checks them
    checked = preflight(jobs, need_devices=True)
    prepared, devices, plans = checked.prepared, checked.devices, checked.plans
    assert devices is not None and plans is not None  # need_devices: known, and every job planned
    ceilings, source = local_ceilings(devices)
    at_once = bool(roofline.cpu_hosts(devices))
    shares = share_rates(ceilings, devices, roofline.ceiling_units())  # workers sharing a GPU split its rates
    return [
        DryRun(p.job, devices, plan, estimate(p.workload, plan, shares, at_once=at_once), source)
        for p, plan in zip(prepared, plans, strict=True)
    ]


def local_ceilings(devices: dict[str, DeviceFacts]) -> tuple[dict[str, dict[str, float]], str]:
    """Each device's ceilings as its tiles would run (see :func:`mgpu.roofline.ceilings_at_once`),
    from the cache, or on CPUs measured now; and where they came from.

    The cache is keyed as the workers key it (:mod:`mgpu.roofline`), with this process's
    software versions standing for theirs.
    """
    cache = roofline.read_cache()
    here = roofline.software(driver=any(f.backend == "cuda" for f in devices.values()))
    # A workload with no ceilings of its own (dot's is the device's copy) has none to measure.
    groups = [g for g in roofline.all_groups() if g == "device" or get_workload_class(g).ceiling_units]
    keys = roofline.cache_keys(devices, dict.fromkeys(devices, here), at_once=True)
    at_once = dict.fromkeys(keys.values(), 1)  # each key's figures: measured by this many at once
    for addrs in roofline.cpu_hosts(devices).values():
        at_once[keys[addrs[0]]] = len(addrs)
    missing = {k: roofline.groups_missing(cache.get(k, {}), groups) for k in set(keys.values())}
    if not any(missing.values()):
        return {addr: cache[k] for addr, k in keys.items()}, "cached"
    if all(f.backend == "cpu" for f in devices.values()):
        for key, todo in missing.items():
            if todo:
                cache[key] = {**cache.get(key, {}), **_calibrate_cpu(todo, at_once[key])}
        roofline.write_cache(cache)
        return {addr: cache[k] for addr, k in keys.items()}, "measured now"
    return {addr: cache[k] for addr, k in keys.items() if k in cache}, "not measured yet (mgpu info --calibrate)"


# Each process reports when imported and measures when told to, so all measure at once.
_CALIBRATE = """
import json, sys
from mgpu.worker.runtime import _cpu_device
from mgpu.roofline import measure_ceilings
dev = _cpu_device(None)
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps(measure_ceilings(sys.argv[1:], dev)), flush=True)
"""


def _calibrate_cpu(groups: list[str], workers: int = 1) -> dict[str, float]:
    """A CPU worker's ceilings, measured in ``workers`` processes at once, each with a
    worker's environment (BLAS on one thread, Dask's malloc settings, as its nanny sets
    them), so the figures are a worker's among that many (the slowest's)."""
    env = {**os.environ, **{k: str(v) for k, v in dask.config.get("distributed.nanny.pre-spawn-environ").items()}}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CALIBRATE, *groups],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(workers)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the ceilings' calibration did not start: {proc.communicate()[1].strip()}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outs = [proc.communicate() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_, err) in zip(procs, outs, strict=True):
        if proc.returncode:
            raise RuntimeError(f"the ceilings' calibration failed: {err.strip()}")
    return roofline.combine_at_once([json.loads(out.strip().splitlines()[-1]) for out, _ in outs])


def describe(run: DryRun) -> list[str]:
    """Lines a person reads: the devices, the plan, the estimate."""
    facts = list(run.devices.values())
    kinds = ", ".join(sorted({f.name for f in facts}))
    memory = format_bytes(min(f.memory for f in facts))
    physical = len({f.physical for f in facts})
    workers = f", {len(facts)} workers" if physical != len(facts) else ""
    lines = [
        f"mgpu: {run.job.name} ({run.job.workload}): would run on {physical} {facts[0].backend} "
        f"device(s) ({kinds}, {memory} each{workers}); nothing started",
        f"mgpu: plan: {run.plan.describe()}",
    ]
    if run.estimate is not None:
        lines.append(f"mgpu: {run.estimate.describe()}; ceilings {run.ceilings_from}")
    else:
        lines.append(f"mgpu: no estimate: ceilings {run.ceilings_from}")
    return lines


def as_json(run: DryRun) -> dict[str, Any]:
    """The dry run as JSON: the job as it would run, its devices, plan and estimate."""
    plan = run.plan
    return {
        "job": run.job.as_dict(),
        "devices": [
            {"id": f.id, "name": f.name, "memory": f.memory, "backend": f.backend, "uuid": f.physical}
            for f in run.devices.values()
        ],
        "plan": {
            "tiles": len(plan.tiles),
            "placement": plan.placement,
            "tile_shape": plan.tile_shape,
            "working_set": plan.working_set,
            "budget": plan.budget,
        },
        "estimate": None if run.estimate is None else {"seconds": run.estimate.seconds, "basis": run.estimate.basis},
        "ceilings": run.ceilings_from,
    }
