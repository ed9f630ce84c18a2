"""A Result as a person reads it: the summary table, one row per device, and the cells
``mgpu report`` shares."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .results import Allocator, Result
from .sizes import format_bytes

__all__ = ["allocator_cell", "estimate_cell", "print_result"]


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
            f"recomputed tiles {result.recovery.recomputed_tiles[:20]} elsewhere"
            + "".join(f", from step {step}" for step in result.recovery.resumed_from_steps[:5]),
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
