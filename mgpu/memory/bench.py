"""``mgpu bench alloc``: what one allocate + use + free costs, per allocator and size.

The classic experiment, in-process on one GPU (no cluster): allocate a buffer, touch every
byte of it on the device (a memset), free it, many times over, with plain cudaMalloc, an
RMM pool, cudaMallocAsync, managed memory, and mgpu's spill fallback
(:class:`~mgpu.memory.spill.ManagedFallback`) both on its normal path (a pool with room: the cost
of the Python callback wrapper) and on its fallback path (a pool capped below the buffer,
so every allocation fails over to managed memory). Managed allocations are kept far below
the GPU's free memory: the lent GPUs must never be oversubscribed.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from ..errors import JobInputError
from ..gpus import cuda_count, cuda_name
from ..sizes import format_bytes, parse_size

__all__ = ["ALLOCATORS", "AllocBench", "parse_sizes", "print_alloc_bench", "run_alloc_bench"]

DEFAULT_SIZES = "1MiB,64MiB,1GiB"
MANAGED_CAP = 256 << 20  # managed buffers never exceed this ...
MANAGED_SHARE = 16  # ... nor 1/16 of the GPU's free memory
_ALIGN = 256  # RMM pools want sizes in multiples of 256 bytes


def _align_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def spill_cap(size: int) -> int:
    """The capped pool of the fallback path: below ``size``, so every allocation spills."""
    return max(_ALIGN, size // 2 // _ALIGN * _ALIGN)


def managed_limit(free: int) -> int:
    """The largest managed buffer the bench asks for on a GPU with ``free`` bytes free."""
    return min(MANAGED_CAP, free // MANAGED_SHARE)


# size -> (the RMM resource to time, the ManagedFallback inside it or None)
Factory = Callable[[int], tuple[Any, Any]]


def _cuda(size: int) -> tuple[Any, Any]:
    import rmm

    return rmm.mr.CudaMemoryResource(), None


def _pool(size: int) -> tuple[Any, Any]:
    import rmm

    room = _align_up(size) + (1 << 20)
    return rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=room, maximum_pool_size=room), None


def _async(size: int) -> tuple[Any, Any]:
    import rmm

    return rmm.mr.CudaAsyncMemoryResource(), None


def _managed(size: int) -> tuple[Any, Any]:
    import rmm

    return rmm.mr.ManagedMemoryResource(), None


def _fallback(size: int) -> tuple[Any, Any]:
    from .spill import ManagedFallback

    fallback = ManagedFallback(_pool(size)[0])
    return fallback.resource, fallback


def _fallback_spill(size: int) -> tuple[Any, Any]:
    import rmm

    from .spill import ManagedFallback

    cap = spill_cap(size)
    fallback = ManagedFallback(
        rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=cap, maximum_pool_size=cap)
    )
    return fallback.resource, fallback


# name -> (what it is, whether it asks for managed memory, its factory); cudaMalloc first: the baseline
ALLOCATORS: dict[str, tuple[str, bool, Factory]] = {
    "cudaMalloc": ("cudaMalloc/cudaFree (rmm.mr.CudaMemoryResource)", False, _cuda),
    "pool": ("RMM pool over cudaMalloc (PoolMemoryResource)", False, _pool),
    "async": ("cudaMallocAsync (CudaAsyncMemoryResource)", False, _async),
    "managed": ("CUDA managed memory (ManagedMemoryResource)", True, _managed),
    "fallback": ("mgpu spill fallback over a pool with room: the wrapper's cost", False, _fallback),
    "fallback-spill": ("mgpu spill fallback over a capped pool: every allocation spills", True, _fallback_spill),
}
BASELINE = "cudaMalloc"


@dataclass
class Row:
    """One allocator at one size: µs per allocate + use + free."""

    allocator: str
    size: int
    us: float | None = None  # median over the repeats
    us_min: float | None = None
    us_max: float | None = None
    samples_us: list[float] = field(default_factory=list)
    vs_cudamalloc: float | None = None  # us / cudaMalloc's us at this size
    fallback_events: int | None = None  # allocations the spill fallback sent to managed memory
    skipped: str | None = None


@dataclass
class AllocBench:
    """The figures of one run; ``asdict`` of it is what ``--json`` writes."""

    device: dict[str, Any]
    sizes: list[int]
    iterations: int
    repeats: int
    managed_limit: int
    rows: list[Row]
    fallback_overhead_us: dict[str, float] = field(default_factory=dict)  # size -> fallback - pool

    def row(self, allocator: str, size: int) -> Row:
        return next(r for r in self.rows if r.allocator == allocator and r.size == size)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_sizes(text: str) -> list[int]:
    """``"1MiB,64MiB,1GiB"`` -> bytes; anything else raises JobInputError naming --sizes."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            size = parse_size(int(part) if part.isdigit() else part, key="--sizes")
        except ValueError:
            raise JobInputError(
                f"--sizes: {part!r} is not a size; give positive bytes (4096) or sizes like 1MiB,64MiB,1GiB"
            ) from None
        out.append(int(size))
    if not out:
        raise JobInputError("--sizes: give one size or more, like 1MiB,64MiB,1GiB")
    return out


def _gpu_count() -> tuple[int, str]:
    """(GPUs visible, why none) without failing where CuPy or RMM is missing."""
    if importlib.util.find_spec("cupy") is None:
        return 0, "CuPy is not installed (pip install 'mgpu[cuda13]')"
    if importlib.util.find_spec("rmm") is None:
        return 0, "RMM is not installed (pip install 'mgpu[cuda13]')"
    count = cuda_count()
    return count, "" if count else "no CUDA GPU is visible"


def check_device(device: int) -> None:
    """Raise JobInputError unless ``device`` is a GPU this process can use."""
    count, why = _gpu_count()
    if count == 0:
        raise JobInputError(f"mgpu bench alloc needs a GPU: {why}")
    if not 0 <= device < count:
        raise JobInputError(
            f"--device: GPU {device} does not exist; this machine has {count} GPU(s), ids 0-{count - 1}"
        )


def summarise(samples: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the repeats."""
    return statistics.median(samples), min(samples), max(samples)


def _cycle_us(mr: Any, size: int, iterations: int, repeats: int) -> list[float]:
    """µs per allocate + memset + free: one sample per repeat, after an untimed first one.

    The wall clock around a synchronised loop rather than CUDA events: most of the cost
    is host work (cudaMalloc and cudaFree block the host), which events on a stream miss.
    """
    import cupy

    rt = cupy.cuda.runtime
    samples = []
    for rep in range(repeats + 1):
        rt.deviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(iterations):
            ptr = mr.allocate(size)
            rt.memsetAsync(ptr, 0, size, 0)  # use it: every byte written on the device
            mr.deallocate(ptr, size)
        rt.deviceSynchronize()
        if rep:
            samples.append((time.perf_counter() - t0) / iterations * 1e6)
    return samples


def run_alloc_bench(
    *, device: int = 0, sizes: list[int], iterations: int = 50, repeats: int = 5, allocators: list[str] | None = None
) -> AllocBench:
    """Time every allocator at every size on GPU ``device``.

    Raises
    ------
    JobInputError
        No GPU, no such device, or a size too large for this GPU's free memory.
    """
    check_device(device)
    import cupy

    cupy.cuda.Device(device).use()  # RMM resources belong to the device current at creation
    free, total = cupy.cuda.runtime.memGetInfo()
    too_big = [s for s in sizes if 4 * s > free]
    if too_big:
        raise JobInputError(
            f"--sizes: {format_bytes(too_big[0])} is more than a quarter of GPU {device}'s free "
            f"memory ({format_bytes(free)}); choose smaller sizes"
        )
    limit = managed_limit(free)
    bench = AllocBench(
        device={
            "id": device,
            "name": cuda_name(device),
            "free": int(free),
            "total": int(total),
        },
        sizes=list(sizes),
        iterations=iterations,
        repeats=repeats,
        managed_limit=limit,
        rows=[],
    )
    for key in allocators or list(ALLOCATORS):
        _, uses_managed, factory = ALLOCATORS[key]
        for size in sizes:
            row = Row(key, size)
            bench.rows.append(row)
            if uses_managed and size > limit:
                row.skipped = f"managed buffers stay at or below {format_bytes(limit)}"
                continue
            mr, fallback = factory(size)
            row.samples_us = _cycle_us(mr, size, iterations, repeats)
            row.us, row.us_min, row.us_max = summarise(row.samples_us)
            if fallback is not None:
                row.fallback_events = fallback.events
            del mr, fallback  # give a pool's memory back before the next one is made: the
            gc.collect()  # fallback's callbacks refer back to it, so only the collector frees it
    _compare(bench)
    return bench


def _compare(bench: AllocBench) -> None:
    """Fill the ratios to cudaMalloc and the fallback wrapper's cost over the raw pool."""
    by = {(r.allocator, r.size): r for r in bench.rows}
    for r in bench.rows:
        base = by.get((BASELINE, r.size))
        if r.us is not None and base is not None and base.us:
            r.vs_cudamalloc = r.us / base.us
    for size in bench.sizes:
        pool, wrapped = by.get(("pool", size)), by.get(("fallback", size))
        if pool and wrapped and pool.us is not None and wrapped.us is not None:
            bench.fallback_overhead_us[str(size)] = wrapped.us - pool.us


def print_alloc_bench(bench: AllocBench, console: Console) -> None:
    """A table of µs per allocate + use + free (median of the repeats) and the ratio to cudaMalloc."""
    d = bench.device
    table = Table(
        title=f"allocate + memset + free on GPU {d['id']} ({d['name']}): µs per cycle, median of "
        f"{bench.repeats} x {bench.iterations}",
        title_justify="left",
    )
    table.add_column("allocator", style="bold")
    for size in bench.sizes:
        table.add_column(format_bytes(size), justify="right")
    for key in dict.fromkeys(r.allocator for r in bench.rows):
        cells = []
        for size in bench.sizes:
            r = bench.row(key, size)
            if r.us is None:
                cells.append("skipped")
            else:
                ratio = f" ({r.vs_cudamalloc:.2g}x)" if r.vs_cudamalloc is not None and key != BASELINE else ""
                cells.append(f"{r.us:.4g}{ratio}")
        table.add_row(key, *cells)
    console.print(table)
    console.print(
        "(x: the time relative to cudaMalloc at the same size; "
        f"managed buffers capped at {format_bytes(bench.managed_limit)})"
    )
    for size_key, extra in bench.fallback_overhead_us.items():
        console.print(
            f"spill fallback wrapper at {format_bytes(int(size_key))}: {extra:+.3g} µs per allocation over the raw pool"
        )
    spilled = [r for r in bench.rows if r.allocator == "fallback-spill" and r.fallback_events]
    for r in spilled:
        console.print(
            f"fallback path at {format_bytes(r.size)}: {r.fallback_events} allocations went to managed "
            f"memory (pool capped at {format_bytes(spill_cap(r.size))})"
        )
