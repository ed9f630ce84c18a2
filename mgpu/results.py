"""The Result of a job (what ``--json`` writes) and how a person sees it (a table)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from .sharing import by_device, first_per_device
from .sizes import format_bytes

if TYPE_CHECKING:
    from .cluster import ClusterInfo
    from .spec import Job
    from .tiling import Plan
    from .worker.device import DeviceFacts
    from .workloads.base import TileRecord, Workload

__all__ = [
    "Allocator",
    "Expected",
    "Recovery",
    "Result",
    "Startup",
    "Timeline",
    "allocator_cell",
    "build_result",
    "estimate_cell",
    "print_result",
]


class Throughput(BaseModel):
    value: float  # all work over compute_s: inputs, checks and gaps included
    unit: str
    kernel: float = 0.0  # all work over the busiest device's kernel time: the kernels alone


class Roofline(BaseModel):
    limit: float
    fraction: float
    basis: str


class Allocator(BaseModel):
    """A worker's allocator over the job; ``None`` where it cannot be measured (n/a)."""

    kind: str  # pool | async | managed | cuda (RMM on cudaMalloc) | default (CuPy's pool) | numpy
    pool_size: int | None = None  # bytes the pool holds at the job's end
    limit: int | None = None  # a cap on what it may allocate (async with spill: the budget)
    peak_bytes: int | None = None  # most bytes allocated at once during the job
    current_bytes: int | None = None  # still allocated at the job's end
    total_bytes: int | None = None  # bytes allocated during the job, all allocations summed
    total_count: int | None = None  # allocations made during the job
    peak_count: int | None = None  # most allocations alive at once


class DeviceRow(BaseModel):
    """One physical device (in ``per_device``) or one worker (in ``per_worker``) over the job."""

    worker: str  # the worker's address (of a device: its first worker's)
    host: str
    id: int
    name: str
    memory: int
    uuid: str = ""  # the physical device (a GPU's or MIG slice's UUID, a CPU worker's name)
    workers: list[str] = []  # the workers that ran on it: several where they shared one GPU
    tiles: int = 0
    busy_s: float = 0.0
    span_s: float = 0.0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    bytes_d2d: int = 0  # copied device to device from other workers' memory (CUDA IPC), no host copy
    d2d_gbps: float | None = None  # rate of the peer copies alone (they overlap compute)
    bytes_same_device: int = 0  # of bytes_d2d, those from a worker on the same GPU
    copies_same_device: int = 0  # the copies that brought them (IPC within one GPU)
    h2d_gbps: float | None = None  # rate of the staged host->device DMAs alone
    d2h_gbps: float | None = None
    # Share of the DMA time hidden under compute: (busy + DMA - span) / DMA, at least.
    copy_overlap: float | None = None
    peak_memory: int = 0
    allocator: Allocator | None = None


class Verify(BaseModel):
    passed: bool | None
    method: str
    max_rel_error: float | None
    failed_tiles: list[int] = []


class Spill(BaseModel):
    events: int = 0
    bytes: int = 0


class Startup(BaseModel):
    """Where the time before the first finished tile went, in seconds (client clock)."""

    cluster_s: float  # starting (or joining) the cluster and setting its workers up; 0 after the first job
    ceilings_s: float  # the devices' ceilings, read from the cache or measured
    plan_s: float
    warmup_s: float  # each worker's untimed warm-up
    first_tile_s: float | None  # from the warm-up's end to the first tile's record


class Pcie(BaseModel):
    """Bytes between host and devices, for jobs whose inputs or outputs live on the host."""

    bytes: int  # moved in this run, both directions, all devices
    minimum_bytes: int  # every input read once and the output written once
    naive_bytes: int | None = None  # had each tile read its own inputs over PCIe (streamed: what the plan moves)
    budget_minimum_bytes: int | None = None  # the fewest any schedule could move under the budget


class Phase(BaseModel):
    """One step of every tile (a dot's generation, reduction or check), over all devices."""

    seconds: float  # device time, the busiest device's sum
    bytes: int  # all devices
    gbps: float | None  # bytes over seconds


class Expected(BaseModel):
    """The plan's estimate of its tiles' time (:mod:`mgpu.client.estimate`), made before
    they ran: what ``measures`` (``compute_s``) is set against. Start-up is not in it."""

    seconds: float
    basis: str
    measures: str = "compute_s"


class Timeline(BaseModel):
    """Where one tile's time went on its worker, in seconds (a streamed matmul's tiles; see
    :func:`mgpu.workloads.matmul.writers.timeline`): ``first_load_s`` + ``products_s`` +
    ``idle_s`` + ``write_tail_s`` = ``span_s``."""

    tile: int
    device: int
    span_s: float  # from the task's start to its last piece of output written
    first_load_s: float  # until the first product could start (its inputs read)
    products_s: float  # the products' device time
    idle_s: float  # between the first product and the last one's end, the device waiting
    write_tail_s: float  # after the last product, the writes still going on
    writes_s: float | None = None  # while at least one writer wrote, hidden or not
    pieces: int | None = None  # write jobs the writer threads ran


class Recovery(BaseModel):
    lost_workers: list[str] = []  # addresses of workers that left the cluster during the job
    recomputed_tiles: list[int] = []  # tiles resubmitted to other workers because theirs was lost


class Result(BaseModel):
    """Everything a run reports; ``model_dump_json()`` is the ``--json`` record."""

    status: Literal["ok", "failed"]
    job: dict[str, Any]
    workload: str
    value: float | None
    backend: str
    devices: list[dict[str, Any]]
    wall_s: float
    compute_s: float
    throughput: Throughput
    roofline: Roofline | None = None
    per_device: list[DeviceRow]  # one row per physical device
    per_worker: list[DeviceRow] = []  # one row per worker (several per device where they share one)
    spill: Spill = Spill()
    verify: Verify
    outputs: list[str]
    plan: dict[str, Any]
    env: dict[str, Any]
    recovery: Recovery = Recovery()
    startup: Startup | None = None
    pcie: Pcie | None = None
    phases: dict[str, Phase] = {}
    estimate: Expected | None = None  # absent from results written before it was recorded
    timeline: list[Timeline] = []  # per tile that reports one (streamed matmul), by tile


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

    ``compute_s`` is the longest span, on any one worker's own clock, from its first tile's
    start to its last tile's end: cluster start-up is out, input generation, checks and
    idle gaps between tiles are in. Throughput is all tiles' work over that span.
    ``allocators`` (worker address -> figures, see :mod:`mgpu.memory.stats`) fill each
    row's allocator and its peak memory. ``panel_records`` (panels made before the tiles
    that read them) count in each worker's span and bytes, not in its tiles.
    """
    # A record's worker is its host and process; the device tells workers of one process apart.
    by_worker: dict[tuple[str, int], list[TileRecord]] = defaultdict(list)
    for r in [*records, *(panel_records or [])]:
        by_worker[r.worker, r.device].append(r)
    where = _record_workers(info)
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
    compute_s = max((d.span_s for d in rows), default=0.0)
    work = sum(r.work for r in records)
    errors = [r.verify_error for r in records if r.verify_error is not None]
    if job.verify:
        failed = sorted(r.index for r in records if not r.verify_ok)
        verify = Verify(
            passed=not failed,
            method=workload.verify_method,
            max_rel_error=max(errors) if errors else None,
            failed_tiles=failed,
        )
    else:
        verify = Verify(passed=None, method="off", max_rel_error=None)
    from .info import runtime_env
    from .workloads.base import HostBytes

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
        env=runtime_env(info),
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


def _record_workers(info: ClusterInfo) -> Callable[[TileRecord], tuple[str, DeviceFacts | None]]:
    """What finds the worker (address, facts) that made a record, by its host, process and
    device ordinal (workers of one GPU differ in process, workers of one process in device;
    by host and ordinal alone for facts that name no process)."""
    by_pid = {(f.host, f.pid, f.id): (addr, f) for addr, f in info.devices.items() if f.pid}
    by_id = {(f.host, f.id): (addr, f) for addr, f in info.devices.items()}

    def where(r: TileRecord) -> tuple[str, DeviceFacts | None]:
        host, _, pid = r.worker.rpartition(":")
        found = by_pid.get((host, int(pid), r.device)) if pid.isdigit() else None
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
    """The physical devices of the cluster, each once, with how many workers shared it."""
    out = []
    for addrs in by_device(info.devices).values():
        f = info.devices[addrs[0]]
        out.append(
            {"id": f.id, "name": f.name, "memory": f.memory, "host": f.host, "uuid": f.physical, "workers": len(addrs)}
        )
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


def print_result(result: Result, console: Console) -> None:
    """The result as a person reads it: a summary table and one row per device."""
    table = Table(
        title=f"{result.job.get('name', result.workload)} ({result.workload}, {result.backend})",
        show_header=False,
        title_justify="left",
    )
    table.add_column(style="bold")
    table.add_column()
    status = "[green]ok[/green]" if result.status == "ok" else "[red]FAILED[/red]"
    table.add_row("status", status)
    if result.value is not None:
        table.add_row("value", f"{result.value:.10g}")
    t = result.throughput
    table.add_row("throughput", f"{t.value:.4g} {t.unit} (kernels alone {t.kernel:.4g})")
    if result.roofline:
        table.add_row(
            "of hardware limit",
            f"{result.roofline.fraction:.1%} of {result.roofline.limit:.4g} "
            f"{result.throughput.unit} ({result.roofline.basis})",
        )
    table.add_row("compute / wall", f"{result.compute_s:.3f} s / {result.wall_s:.3f} s")
    if result.estimate:
        table.add_row("estimate", estimate_cell(result))
    if result.phases:
        table.add_row(
            "phases",
            ", ".join(
                f"{name} {p.seconds * 1e3:.3g} ms" + (f" ({p.gbps:.4g} GB/s)" if p.gbps else "")
                for name, p in result.phases.items()
            ),
        )
    if result.startup:
        st = result.startup
        first = f", first tile {st.first_tile_s:.2f} s" if st.first_tile_s is not None else ""
        table.add_row(
            "start-up",
            f"cluster {st.cluster_s:.2f} s, ceilings {st.ceilings_s:.2f} s, plan {st.plan_s:.3f} s, "
            f"warm-up {st.warmup_s:.2f} s{first}",
        )
    v = result.verify
    if v.passed is None:
        table.add_row("verify", "off")
    else:
        err = f", max rel. error {v.max_rel_error:.2e}" if v.max_rel_error is not None else ""
        tiles = f", failed tiles {v.failed_tiles[:10]}" if v.failed_tiles else ""
        table.add_row("verify", f"{'passed' if v.passed else '[red]FAILED[/red]'} ({v.method}{err}{tiles})")
    table.add_row("plan", f"{result.plan['tiles']} tiles {result.plan['tile_shape']}, {result.plan['placement']}")
    if result.pcie:
        naive = (
            f", {format_bytes(result.pcie.naive_bytes)} if every tile read its own" if result.pcie.naive_bytes else ""
        )
        within = (
            f" ({format_bytes(result.pcie.budget_minimum_bytes)} under the budget)"
            if result.pcie.budget_minimum_bytes
            else ""
        )
        table.add_row(
            "PCIe",
            f"{format_bytes(result.pcie.bytes)} moved; at least {format_bytes(result.pcie.minimum_bytes)}"
            f"{within}{naive}",
        )
    if result.spill.events:
        table.add_row(
            "spilled", f"{result.spill.events} allocations, {format_bytes(result.spill.bytes)} to managed memory"
        )
    if result.recovery.lost_workers:
        table.add_row(
            "recovered",
            f"lost {', '.join(result.recovery.lost_workers)}; "
            f"recomputed tiles {result.recovery.recomputed_tiles[:20]} elsewhere",
        )
    for path in result.outputs:
        table.add_row("output", path)
    console.print(table)
    devices = Table(
        "device", "name", "tiles", "busy s", "span s", "H2D", "D2H", "from peers", "allocator", title_justify="left"
    )
    for d in result.per_device:
        peer = format_bytes(d.bytes_d2d) + (f" at {d.d2d_gbps:.0f} GB/s" if d.d2d_gbps else "")
        if d.bytes_same_device:
            peer += f" ({format_bytes(d.bytes_same_device)} within the GPU)"
        shared = f" ({len(d.workers)} workers)" if len(d.workers) > 1 else ""
        devices.add_row(
            f"{d.host}:{d.id}{shared}",
            d.name,
            str(d.tiles),
            f"{d.busy_s:.3f}",
            f"{d.span_s:.3f}",
            _moved(d.bytes_h2d, d.h2d_gbps, d.copy_overlap),
            _moved(d.bytes_d2h, d.d2h_gbps, None),
            peer,
            allocator_cell(d.allocator),
        )
    console.print(devices)


def estimate_cell(result: Result) -> str:
    """The estimate against what it estimates: "0.215 s of tiles, took 0.232 s (1.08x)"."""
    e = result.estimate
    if e is None:
        return "n/a"
    took = getattr(result, e.measures, result.compute_s)
    ratio = f" ({took / e.seconds:.2f}x)" if e.seconds > 0 else ""
    return f"{e.seconds:.3g} s of tiles, took {took:.3g} s{ratio}"


def _moved(nbytes: int, gbps: float | None, overlap: float | None) -> str:
    cell = format_bytes(nbytes) + (f" at {gbps:.0f} GB/s" if gbps else "")
    return cell + (f", {overlap:.0%} under compute" if overlap is not None else "")


def allocator_cell(a: Allocator | None) -> str:
    """One compact cell: kind, pool size, the job's peak and allocation count (n/a if unknown)."""
    if a is None:
        return "n/a"
    if a.pool_size is None and a.peak_bytes is None and a.total_count is None:
        return f"{a.kind}, n/a"
    parts = [a.kind + (f" {format_bytes(a.pool_size)}" if a.pool_size is not None else "")]
    if a.limit is not None:
        parts.append(f"cap {format_bytes(a.limit)}")
    parts.append(f"peak {format_bytes(a.peak_bytes)}" if a.peak_bytes is not None else "peak n/a")
    if a.total_count is not None:
        parts.append(f"{a.total_count} allocs")
    return ", ".join(parts)
