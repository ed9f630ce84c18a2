"""Build a job's Result from its tiles' records: per device and per worker, throughput, the
roofline's share, the checks' verdict, PCIe bytes, phases (the client's last step, see
:mod:`mgpu.client.assemble`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..results import (
    Allocator,
    DeviceRow,
    Expected,
    Pcie,
    Phase,
    Recovery,
    Result,
    Roofline,
    Spill,
    Startup,
    Throughput,
    Timeline,
    Verify,
)
from ..sharing import by_device, first_per_device
from ..sizes import format_bytes
from ..workloads.base import HostBytes

if TYPE_CHECKING:
    from ..cluster import ClusterInfo
    from ..spec import Job
    from ..tiling import Plan
    from ..worker.device import DeviceFacts
    from ..workloads.base import TileRecord, Workload

__all__ = ["build_result"]


def build_result(
    job: Job,
    workload: Workload,
    info: ClusterInfo,
    plan: Plan,
    records: list[TileRecord],
    *,
    wall_s: float,
    outputs: list[str],
    ceilings: dict[str, dict[str, float]] | None = None,
    allocators: dict[str, dict[str, Any]] | None = None,
    recovery: Recovery | None = None,
    startup: Startup | None = None,
    panel_records: list[TileRecord] | None = None,
) -> Result:
    """Fold the tiles' records into the Result.

    ``compute_s`` is the longest span, on any one host's clock, from its first tile's
    start to its last tile's end (a worker lost and its tiles recomputed on another are in
    one span): cluster start-up is out, input generation, checks and
    idle gaps between tiles are in. Throughput is all tiles' work over that span.
    ``allocators`` (worker address -> figures, see :mod:`mgpu.memory.stats`) fill each
    row's allocator and its peak memory. ``panel_records`` (panels made before the tiles
    that read them) count in each worker's span and bytes, not in its tiles.
    """
    # A record's worker is its host and process; the device tells workers of one process apart.
    by_worker: dict[tuple[str, int], list[TileRecord]] = defaultdict(list)
    for r in [*records, *(panel_records or [])]:
        by_worker[r.worker, r.device].append(r)
    where = _record_workers(info, recovery.processes if recovery else {})
    worker_rows: list[DeviceRow] = []
    by_device: dict[str, list[TileRecord]] = defaultdict(list)
    device_workers: dict[str, list[str]] = defaultdict(list)
    for recs in by_worker.values():
        addr, facts = where(recs[0])
        physical = facts.physical if facts else f"{recs[0].worker}/{recs[0].device}"
        by_device[physical] += recs
        device_workers[physical].append(addr)
        alloc = Allocator(**allocators[addr]) if allocators and addr in allocators else None
        worker_rows.append(_row(recs, [addr], facts, alloc))
    rows = []
    for physical, recs in by_device.items():
        addrs = sorted(device_workers[physical])
        alone = worker_rows[[r.workers for r in worker_rows].index(addrs)] if len(addrs) == 1 else None
        facts = where(recs[0])[1]
        # The allocator is each worker's own: a device several workers shared has one per worker.
        rows.append(
            alone or _row(recs, addrs, facts, None, peak=sum(w.peak_memory for w in worker_rows if w.worker in addrs))
        )
    worker_rows.sort(key=lambda d: (d.host, d.id, d.worker))
    rows.sort(key=lambda d: (d.host, d.id, d.uuid))
    # From the first tile's start to the last one's end on each host's clock (workers of one
    # host share it; hosts' clocks may differ): the longest host's.
    by_host: dict[str, list[TileRecord]] = defaultdict(list)
    for r in [*records, *(panel_records or [])]:
        by_host[r.worker.rsplit(":", 1)[0]].append(r)
    compute_s = max((max(r.stop for r in rs) - min(r.start for r in rs) for rs in by_host.values()), default=0.0)
    work = sum(r.work for r in records)
    errors = [r.verify_error for r in records if r.verify_error is not None]
    if job.verify:
        failed = sorted(r.index for r in records if not r.verify_ok)
        per_device: dict[tuple[str, int], float] = defaultdict(float)
        for r in records:
            per_device[r.worker, r.device] += r.verify_s
        verify = Verify(
            passed=not failed,
            method=workload.verify_method,
            max_rel_error=max(errors) if errors else None,
            failed_tiles=failed,
            seconds=max(per_device.values(), default=0.0),
        )
    else:
        verify = Verify(passed=None, method="off", max_rel_error=None)
    from ..info import runtime_env

    throughput = _throughput(
        work / workload.unit_scale, compute_s, max((d.busy_s for d in rows), default=0.0), workload.unit
    )
    host_bytes = workload.host_bytes() if isinstance(workload, HostBytes) else None
    pcie = None
    if isinstance(workload, HostBytes) and host_bytes is not None:
        pcie = Pcie(
            bytes=sum(d.bytes_h2d + d.bytes_d2h for d in rows),
            minimum_bytes=host_bytes,
            naive_bytes=workload.naive_host_bytes(plan),
            budget_minimum_bytes=workload.budget_host_bytes(plan),
        )

    return Result(
        status="failed" if verify.passed is False else "ok",
        job=job.as_dict(),
        workload=job.workload,
        value=workload.combine(records),
        backend=info.backend,
        devices=_devices(info),
        wall_s=wall_s,
        compute_s=compute_s,
        throughput=throughput,
        roofline=_roofline(
            throughput,
            workload.ceiling(),
            first_per_device(ceilings or {}, info.devices),
            work / workload.unit_scale,
            host_bytes,
            workload.bound_note(),
            workers=len(ceilings or {}),
        ),
        per_device=rows,
        per_worker=worker_rows,
        spill=Spill(events=sum(r.spill_events for r in records), bytes=sum(r.spill_bytes for r in records)),
        verify=verify,
        outputs=outputs,
        plan={
            "tiles": len(plan.tiles),
            "placement": plan.placement,
            "tile_shape": plan.tile_shape,
            "working_set": plan.working_set,
            "budget": plan.budget,
            "expected_s": plan.notes.get("estimate", {}).get("seconds"),
        },
        env=runtime_env(info, recovery.lost_workers if recovery else ()),
        recovery=recovery or Recovery(),
        startup=startup,
        pcie=pcie,
        phases=_phases(records, where),
        estimate=Expected(**plan.notes["estimate"]) if "estimate" in plan.notes else None,
        timeline=[
            Timeline(tile=r.index, device=r.device, **r.extra["timeline"])
            for r in sorted(records, key=lambda r: r.index)
            if "timeline" in r.extra
        ],
    )


def _record_workers(
    info: ClusterInfo, processes: dict[str, str] | None = None
) -> Callable[[TileRecord], tuple[str, DeviceFacts | None]]:
    """What finds the worker (address, facts) that made a record, by its host, process and
    device ordinal (workers of one GPU differ in process, workers of one process in device;
    by host and ordinal alone for facts that name no process). ``processes`` ("host:pid"
    -> address, see :class:`~mgpu.results.Recovery`) names the workers that joined during
    the job (one replacing a lost worker on its device), which the facts do not know."""
    by_pid = {(f.host, f.pid, f.id): (addr, f) for addr, f in info.devices.items() if f.pid}
    by_id = {(f.host, f.id): (addr, f) for addr, f in info.devices.items()}

    def where(r: TileRecord) -> tuple[str, DeviceFacts | None]:
        host, _, pid = r.worker.rpartition(":")
        found = by_pid.get((host, int(pid), r.device)) if pid.isdigit() else None
        if found is None and r.worker in (processes or {}):
            return (processes or {})[r.worker], by_id.get((host, r.device), ("?", None))[1]
        return found or by_id.get((host, r.device)) or ("?", None)

    return where


def _row(
    recs: list[TileRecord], addrs: list[str], facts: DeviceFacts | None, alloc: Allocator | None, peak: int = 0
) -> DeviceRow:
    """The row of one worker's records, or of every record of a device its ``addrs`` shared."""
    return DeviceRow(
        worker=addrs[0],
        workers=addrs,
        host=recs[0].worker.rsplit(":", 1)[0],
        id=recs[0].device,
        uuid=facts.physical if facts else "",
        name=facts.name if facts else "?",
        memory=facts.memory if facts else 0,
        tiles=sum(r.kind == "tile" for r in recs),
        busy_s=sum(r.busy_s for r in recs),
        span_s=max(r.stop for r in recs) - min(r.start for r in recs),
        h2d_gbps=_rate(sum(r.bytes_h2d for r in recs), sum(r.h2d_s for r in recs)),
        d2h_gbps=_rate(sum(r.bytes_d2h for r in recs), sum(r.d2h_s for r in recs)),
        copy_overlap=_overlap(recs),
        bytes_h2d=sum(r.bytes_h2d for r in recs),
        bytes_d2h=sum(r.bytes_d2h for r in recs),
        bytes_d2d=sum(r.bytes_d2d for r in recs),
        d2d_gbps=_rate(sum(r.bytes_d2d for r in recs), sum(r.d2d_s for r in recs)),
        bytes_same_device=sum(r.bytes_same_device for r in recs),
        copies_same_device=sum(r.copies_same_device for r in recs),
        peak_memory=((alloc.peak_bytes or 0) if alloc else peak),
        allocator=alloc,
    )


def _devices(info: ClusterInfo) -> list[dict[str, Any]]:
    """The physical devices of the cluster, each once, with how many workers shared it and,
    where several did, how: side by side under MPS ("mps") or taking turns ("turns")."""
    out = []
    for addrs in by_device(info.devices).values():
        f = info.devices[addrs[0]]
        row = {
            "id": f.id,
            "name": f.name,
            "memory": f.memory,
            "host": f.host,
            "uuid": f.physical,
            "workers": len(addrs),
        }
        if len(addrs) > 1 and f.backend == "cuda":
            row["sharing"] = "mps" if all(info.devices[a].mps for a in addrs) else "turns"
        out.append(row)
    return out


def _phases(
    records: list[TileRecord], where: Callable[[TileRecord], tuple[str, DeviceFacts | None]]
) -> dict[str, Phase]:
    """Each phase the tiles report (``extra["phases"]``): bytes summed, seconds the busiest
    physical device's (its workers' summed)."""
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    nbytes: dict[str, int] = defaultdict(int)
    for r in records:
        facts = where(r)[1]
        device = facts.physical if facts else f"{r.worker}/{r.device}"
        for name, p in r.extra.get("phases", {}).items():
            seconds[name][device] += p["seconds"]
            nbytes[name] += p["bytes"]
    out = {}
    for name, per_device in seconds.items():
        s = max(per_device.values())
        out[name] = Phase(seconds=s, bytes=nbytes[name], gbps=nbytes[name] / s / 1e9 if s > 0 else None)
    return out


def _rate(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if nbytes and seconds > 0 else None


def _overlap(recs: list[TileRecord]) -> float | None:
    """The least share of a worker's DMA time that ran under its compute.

    Device work (kernels plus DMAs) that does not fit in the span must have overlapped:
    (busy + DMA - span) / DMA, between 0 and 1; None without staged copies.
    """
    dma = sum(r.h2d_s + r.d2h_s for r in recs)
    if dma <= 0:
        return None
    span = max(r.stop for r in recs) - min(r.start for r in recs)
    return min(1.0, max(0.0, (sum(r.busy_s for r in recs) + dma - span) / dma))


def _roofline(
    throughput: Throughput,
    key: str,
    ceilings: dict[str, dict[str, float]],
    work: float = 0.0,
    host_bytes: int | None = None,
    note: str | None = None,
    workers: int = 0,
) -> Roofline | None:
    """The summed single-device ceilings of every physical device (``ceilings``: one
    worker's per device), and the share the run reached; ``workers``, where more than the
    devices, is said in the basis.

    With ``host_bytes`` (inputs or outputs on the host), the bound is the slower of the
    compute at that rate and those bytes over the summed pinned host->device rate.
    ``note`` (the workload's :meth:`~mgpu.workloads.base.Workload.bound_note`) joins the basis.
    """
    rates = [c[key] for c in ceilings.values() if key in c]
    if not rates or len(rates) != len(ceilings):
        return None
    limit = sum(rates)
    basis = f"{len(rates)} x {key} measured on one device alone"
    pcie = [c.get("h2d_pinned") or 0.0 for c in ceilings.values()]
    if host_bytes and work > 0 and all(pcie):
        compute_s, pcie_s = work / limit, host_bytes / 1e9 / sum(pcie)
        if pcie_s > compute_s:
            limit, basis = work / pcie_s, f"{len(rates)} x h2d_pinned for {format_bytes(host_bytes)} over PCIe"
        else:
            basis += f" (PCIe for {format_bytes(host_bytes)} would take {pcie_s:.3g} s, compute {compute_s:.3g} s)"
    if workers > len(rates):
        basis += f"; {workers} workers shared the {len(rates)} device{'s' * (len(rates) != 1)}"
    if note:
        basis += f"; {note}"
    return Roofline(limit=limit, fraction=throughput.value / limit, basis=basis)


def _throughput(work: float, compute_s: float, busy_s: float, unit: str) -> Throughput:
    return Throughput(value=work / compute_s if compute_s else 0.0, unit=unit, kernel=work / busy_s if busy_s else 0.0)
