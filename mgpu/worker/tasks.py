"""What the client's tasks run on a worker: a workload's warm-up, a panel's making, a tile.

The routine around a tile (timing, counters, the check, the record) is :mod:`mgpu.worker.tile`;
these are the tasks' entry points, which find the worker's device and what its runtime
keeps (:mod:`mgpu.worker.runtime`).
"""

from __future__ import annotations

from typing import Any

from distributed import get_worker

from ..planner import Panel, Tile
from ..workloads.base import TileRecord, Workload
from . import device as _device
from . import runtime
from . import tile as _tile
from .panels import PanelRef

__all__ = ["lost_stepped_tile", "make_panel", "release_steps", "run_tile", "step_tile", "warmup"]


def make_panel(workload: Workload, panel: Panel, token: str, after: PanelRef | None = None) -> PanelRef:
    """Make ``panel`` on this worker; ``after``, the worker's panel before it, only orders them."""
    return _tile.make_panel(workload, _device.current(), panel, token)


def _answer_hook() -> _tile.AnswerHook | None:
    """The ``on_answer`` of a worker plugin that has one (tests spoil a tile's answer
    through it to prove the checks, or hold it to stop a job mid-way); None in every job."""
    try:
        worker = get_worker()
    except ValueError:
        return None
    hooks = [hook for p in worker.plugins.values() if callable(hook := getattr(p, "on_answer", None))]
    return hooks[0] if hooks else None


def run_tile(
    workload: Workload,
    tile: Tile,
    panels: dict[str, PanelRef] | None = None,
    token: str = "",
    stepped: _tile.Sent | None = None,
) -> TileRecord:
    """Compute ``tile`` on this worker's device and return its record (``stepped``: the
    tile's last step, for a stepped plan)."""
    rt = runtime.current()
    return _tile.run_tile(
        workload, rt.device, tile, panels, token=token, hook=_answer_hook(), stepped=stepped, steps=rt.steps
    )


def step_tile(
    workload: Workload,
    tile: Tile,
    step: int,
    token: str,
    previous: _tile.Sent | None,
    received: list[_tile.Sent],
    remote: frozenset[int],
    peers: frozenset[int],
) -> _tile.Sent:
    """Step ``step`` of a stepped tile on this worker's device (see :func:`mgpu.worker.tile.step_tile`)."""
    rt = runtime.current()
    return _tile.step_tile(
        workload, rt.device, tile, step, token, previous, received, remote, peers, steps=rt.steps, buffers=rt.exchange
    )


def release_steps(token: str, dask_worker: Any = None) -> int:
    """Drop this worker's stepped tiles of one job (run on each worker once the job ends)."""
    return runtime.current(dask_worker).steps.release(token)


def lost_stepped_tile(index: int) -> None:
    """Stands for a stepped tile resubmitted after its worker was lost: its state went too."""
    raise RuntimeError(
        f"tile {index} kept its state on a worker that was lost; a stepped job cannot recompute "
        "one tile alone: run the job again"
    )


def warmup(workload: Workload, tile: Tile) -> None:
    """Run the workload's warm-up on this worker's device (compiles kernels, makes handles),
    for tiles like ``tile``."""
    workload.warmup(_device.current(), tile)
