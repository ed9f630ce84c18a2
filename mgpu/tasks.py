"""What the client's tasks run on a worker: a workload's warm-up, a panel's making, a tile."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from . import device as _device
from .panels import PanelRef
from .planner import Panel, Tile
from .workloads.base import TileRecord, Workload, injected_delay

__all__ = ["make_panel", "run_tile", "warmup"]


def _counter(dev: _device.Device) -> Callable[[TileRecord], None]:
    """Start counting what a task moves and spills; the function returned fills a record
    with what was counted since."""
    h2d, d2h, (events, spilled) = dev.bytes_h2d, dev.bytes_d2h, dev.spill_counts()
    if dev.is_gpu:
        dev.copy_seconds()  # forget copies from before this task (a warm-up's)

    def fill(record: TileRecord) -> None:
        record.bytes_h2d, record.bytes_d2h = dev.bytes_h2d - h2d, dev.bytes_d2h - d2h
        now_events, now_spilled = dev.spill_counts()
        record.spill_events, record.spill_bytes = now_events - events, now_spilled - spilled
        if dev.is_gpu:
            seconds = dev.copy_seconds()
            record.h2d_s, record.d2h_s = seconds["h2d"], seconds["d2h"]

    return fill


def make_panel(workload: Workload, panel: Panel, token: str, after: PanelRef | None = None) -> PanelRef:
    """Make ``panel`` on this worker; ``after``, the worker's panel before it, only orders them."""
    dev = _device.current()
    start = time.time()
    fill = _counter(dev)
    ref = workload.make_panel(dev, panel, token)
    record = Workload.new_record(dev, Tile(-1, panel.bounds), start, busy_s=0.0, work=0.0, kind="panel")
    record.extra["panel"] = panel.name
    fill(record)
    return dataclasses.replace(ref, record=record)


def run_tile(workload: Workload, tile: Tile, panels: dict[str, PanelRef] | None = None) -> TileRecord:
    """Compute ``tile`` on this worker's device and return its record."""
    dev = _device.current()
    delay = injected_delay()
    if delay:
        time.sleep(delay)
    fill = _counter(dev)
    record = workload.run_tile(dev, tile, panels) if panels else workload.run_tile(dev, tile)
    fill(record)
    return record


def warmup(workload: Workload, tile: Tile) -> None:
    """Run the workload's warm-up on this worker's device (compiles kernels, makes handles),
    for tiles like ``tile``."""
    workload.warmup(_device.current(), tile)
