"""The Result of a job: what ``--json`` writes and ``mgpu report`` reads (its schema).

The client builds it from the tiles' records (:mod:`mgpu.client.result`); a person sees it
as a table (:mod:`mgpu.show`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = [
    "Allocator",
    "DeviceRow",
    "Expected",
    "Pcie",
    "Phase",
    "Recovery",
    "Result",
    "Roofline",
    "Spill",
    "Startup",
    "Throughput",
    "Timeline",
    "Verify",
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
    # The check's own time on the device that spent most on it (its tiles' sum): device
    # time on GPUs, wall clock on CPUs; absent from results written before it was recorded.
    seconds: float | None = None


class Spill(BaseModel):
    events: int = 0
    bytes: int = 0


class Startup(BaseModel):
    """Where the time besides the tiles' went, in seconds (client clock): before the first
    finished tile, and after the last. The seconds add up to the job's ``wall_s`` (those
    absent from results written before they were recorded aside)."""

    # Starting (or joining) the cluster and setting its workers up (of a connection to a
    # running cluster, begun while the command checked the jobs, what was left to wait for);
    # after the first job of a submit, the round trip that finds the workers (and which are
    # warm) for this one.
    cluster_s: float
    ceilings_s: float  # the devices' ceilings, read from the cache or measured
    plan_s: float
    warmup_s: float  # the untimed warm-up of each worker not yet warm for the job's tiles
    first_tile_s: float | None  # from the warm-up's end to the first tile's record
    # From the first tile's record to the last's (and the panels' records gathered, the
    # workers' buffers of the job let go).
    later_tiles_s: float | None = None
    # From the last tile's record until the outputs are committed: the allocators'
    # statistics, the outputs written.
    finish_s: float | None = None
    # Workers sent a warm-up: those that had run none of the same key (0: all were warm).
    warmups: int | None = None


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
    # Of idle_s: before products whose inputs were still being read, before products whose
    # buffer held C not yet written, and the check's kernels (the rest: the task's thread late).
    idle_inputs_s: float | None = None
    idle_writes_s: float | None = None
    checks_s: float | None = None
    # The products' rate over a block of k (adding to sums) and over all of k (B kept whole).
    blocks_tflops: float | None = None
    whole_k_tflops: float | None = None


class Recovery(BaseModel):
    lost_workers: list[str] = []  # addresses of workers that left the cluster during the job
    recomputed_tiles: list[int] = []  # tiles resubmitted to other workers because theirs was lost
    # A stepped job's: the step its tiles went back to, once per worker lost (0: their inputs).
    resumed_from_steps: list[int] = []
    # The process of each worker that finished a tile, as records name it ("host:pid") ->
    # its address: a worker lost and the one that replaced it (same host and device) are
    # told apart by it. Not saved.
    processes: dict[str, str] = Field(default_factory=dict, exclude=True)


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
