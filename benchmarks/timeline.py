"""Where a job's wall time goes on each worker: a tile-by-tile timeline.

    python3 benchmarks/timeline.py JOB.yaml [--set key=value ...] [--json OUT.json]

Runs the job through mgpu's client side (the same path as ``submit``), keeps every tile's
record as it arrives, and prints, per worker: the span from its first tile's start to
its last tile's end, the device-busy time inside it, the time with no tile running at
all (between tasks: Dask's hand-over), and the time inside tasks but off the kernel
(inputs, checks, copies back). With two tiles per device at once, "no tile running"
counts only the time when neither runs. Where tiles mark their steps (``TileRecord.marks``:
inputs made, products queued, checked, written), it prints the median time from a tile's
start to each step, and from each step to the next. Where the job makes panels (matmul's
``operands: distributed``), it prints each one's span against the first tile's start and
the bytes it moved to the device.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import click

from mgpu.client.run import run_job
from mgpu.client.watch import Events
from mgpu.spec import load_job
from mgpu.workloads.base import TileRecord


class _Keep(Events):
    def __init__(self) -> None:
        self.records: list[TileRecord] = []
        self.panels: list[TileRecord] = []

    def tile_done(self, record: TileRecord) -> None:
        self.records.append(record)

    def panels_made(self, records: list[TileRecord]) -> None:
        self.panels = list(records)


def idle_between(intervals: list[tuple[float, float]]) -> float:
    """Seconds inside [first start, last stop] that no interval covers."""
    if not intervals:
        return 0.0
    intervals = sorted(intervals)
    idle, reach = 0.0, intervals[0][1]
    for lo, hi in intervals[1:]:
        if lo > reach:
            idle += lo - reach
        reach = max(reach, hi)
    return idle


def summarise(records: list[TileRecord]) -> dict[str, dict[str, Any]]:
    """Per worker: span, busy, idle between tasks, in-task overhead, tile count."""
    by_worker: dict[str, list[TileRecord]] = defaultdict(list)
    for r in records:
        by_worker[r.worker].append(r)
    out = {}
    for worker, recs in sorted(by_worker.items()):
        span = max(r.stop for r in recs) - min(r.start for r in recs)
        busy = sum(r.busy_s for r in recs)
        in_task = sum(r.stop - r.start for r in recs)
        out[worker] = {
            "tiles": len(recs),
            "span_s": span,
            "busy_s": busy,
            "idle_between_s": idle_between([(r.start, r.stop) for r in recs]),
            "in_task_off_kernel_s": in_task - busy,
            "tile_s": sorted((round(r.stop - r.start, 4), round(r.busy_s, 4)) for r in recs),
            "steps_s": step_medians(recs),
        }
    return out


def step_medians(records: list[TileRecord]) -> dict[str, float]:
    """Median seconds from each marked step (and the tile's start) to the next, ending at stop."""
    steps: dict[str, list[float]] = defaultdict(list)
    for r in records:
        marks = [("start", r.start), *r.marks.items(), ("stop", r.stop)]
        for (a, ta), (b, tb) in pairwise(marks):
            steps[f"{a}->{b}"].append(tb - ta)
    return {step: statistics.median(values) for step, values in steps.items()}


def panel_lines(panels: list[TileRecord], tiles: list[TileRecord]) -> list[str]:
    """One line per panel a worker made: when it started and ended against the job's first
    tile's start, its bounds, and the bytes it moved to the device and how fast."""
    if not panels:
        return []
    t0 = min(r.start for r in tiles) if tiles else min(p.start for p in panels)
    lines = []
    for p in sorted(panels, key=lambda p: p.start):
        seconds = p.stop - p.start
        rate = f", {p.bytes_h2d / seconds / 1e9:.1f} GB/s" if p.bytes_h2d and seconds > 0 else ""
        lines.append(
            f"panel {p.extra.get('panel', '?')}: {p.start - t0:+.3f} -> {p.stop - t0:+.3f} s, "
            f"{p.bytes_h2d / 1e9:.2f} GB{rate}"
        )
    return lines


@click.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--set", "sets", multiple=True, help="Override a job key, as in submit.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(job_file: Path, sets: tuple[str, ...], json_path: Path | None) -> None:
    keep = _Keep()
    result = run_job(load_job(job_file, list(sets)), keep)
    summary = summarise(keep.records)
    print(
        f"{result.workload}: {result.throughput.value:.4g} {result.throughput.unit}, "
        f"compute {result.compute_s:.3f} s, wall {result.wall_s:.3f} s"
    )
    for worker, s in summary.items():
        print(
            f"  {worker}: {s['tiles']} tiles, span {s['span_s']:.3f} s, busy {s['busy_s']:.3f} s, "
            f"no tile running {s['idle_between_s']:.3f} s, in tasks off the kernel {s['in_task_off_kernel_s']:.3f} s"
        )
        if s["steps_s"]:
            print("    median " + ", ".join(f"{step} {sec * 1e3:.1f} ms" for step, sec in s["steps_s"].items()))
        for line in panel_lines([p for p in keep.panels if p.worker == worker], keep.records):
            print("    " + line)
    if json_path:
        records = [{k: v for k, v in vars(r).items() if k != "extra"} for r in keep.records]
        panels = [
            {**{k: v for k, v in vars(r).items() if k != "extra"}, "panel": r.extra.get("panel")} for r in keep.panels
        ]
        json_path.write_text(
            json.dumps(
                {"summary": summary, "records": records, "panels": panels, "result": result.model_dump(mode="json")},
                indent=1,
                default=lambda o: o.item() if hasattr(o, "item") else str(o),
            )
        )


if __name__ == "__main__":
    main()
