"""The entry points of what the client runs on a worker: its tasks, and the functions it
runs there with ``Client.run``.

These alone look up the worker's runtime (:func:`current`); they hand its parts down to
the routine around a tile (:mod:`mgpu.worker.tile`) and, through it, to the workloads. A
tile, a step and a panel each run in a turn at the worker's GPU, where other workers
share it (:mod:`mgpu.worker.turns`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

from distributed import get_worker

from ..tiling import Panel, Tile
from ..workloads.base import TileRecord, Workload
from . import tile as _tile
from .device import Device, DeviceFacts
from .panels import PanelRef
from .plugins import runtime_of
from .runtime import Runtime

__all__ = [
    "close_allocator_window",
    "current",
    "device_facts",
    "drop_stepped",
    "end_job",
    "hand_over_checkpoint",
    "keep_checkpoint",
    "make_panel",
    "open_job",
    "resume_tile",
    "run_tile",
    "step_tile",
    "take_turns",
    "warmup",
    "with_device",
]

T = TypeVar("T")


def current(dask_worker: Any = None) -> Runtime:
    """The runtime of the worker this task runs on, or of ``dask_worker`` where given (a
    function run by ``Client.run`` is given its worker: it does not run as a task).

    Raises
    ------
    RuntimeError
        Outside a worker, or on a worker without mgpu's runtime plugin.
    """
    if dask_worker is None:
        try:
            dask_worker = get_worker()
        except ValueError:
            raise RuntimeError(
                "mgpu's worker runtime is reached from a task on a Dask worker; this is not one"
            ) from None
    return runtime_of(dask_worker)


def make_panel(workload: Workload, panel: Panel, token: str, after: PanelRef | None = None) -> PanelRef:
    """Make ``panel`` on this worker; ``after``, the worker's panel before it, only orders them."""
    rt = current()
    with rt.turns.turn():
        return _tile.make_panel(workload, rt.device, panel, token, rt.panels)


def run_tile(
    workload: Workload,
    tile: Tile,
    panels: dict[str, PanelRef] | None = None,
    token: str = "",
    stepped: _tile.Sent | None = None,
) -> TileRecord:
    """Compute ``tile`` on this worker's device and return its record (``stepped``: the
    tile's last step, for a stepped plan)."""
    rt = current()
    return _tile.run_tile(
        workload,
        rt.device,
        tile,
        panels,
        token=token,
        stepped=stepped,
        steps=rt.steps,
        panel_store=rt.panels,
        turn=rt.turns.turn,
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
    same_device: frozenset[int] = frozenset(),
    save: bool = False,
) -> _tile.Sent:
    """Step ``step`` of a stepped tile on this worker's device (see :func:`mgpu.worker.tile.step_tile`)."""
    rt = current()
    with rt.turns.turn():
        return _tile.step_tile(
            workload,
            rt.device,
            tile,
            step,
            token,
            previous,
            received,
            remote,
            peers,
            same_device,
            save,
            steps=rt.steps,
            buffers=rt.exchange,
        )


def hand_over_checkpoint(token: str, index: int, step: int, after: _tile.Sent) -> _tile.Checkpoint:
    """The checkpoint tile ``index`` saved at its step ``step - 1`` (``after``, that step,
    only orders them), as this task's result: Dask keeps it in this worker's memory."""
    return current().steps.take(token, index, step)


def keep_checkpoint(checkpoint: _tile.Checkpoint) -> _tile.Checkpoint:
    """A checkpoint as this task's result: a copy of it in this worker's memory, which
    outlives the worker that saved it."""
    return checkpoint


def resume_tile(
    workload: Workload, tile: Tile, checkpoint: _tile.Checkpoint, token: str, remote: frozenset[int]
) -> _tile.Sent:
    """Make a stepped tile's context on this worker from a checkpoint (see
    :func:`mgpu.worker.tile.resume_tile`)."""
    rt = current()
    with rt.turns.turn():
        return _tile.resume_tile(workload, rt.device, tile, checkpoint, token, remote, steps=rt.steps)


def warmup(workload: Workload, tile: Tile) -> bool:
    """Run the workload's warm-up on this worker's device (compiles kernels, makes
    handles) for tiles like ``tile``, unless this worker ran one of the same key
    (:meth:`~mgpu.workloads.base.Workload.warm_key`) already; returns whether it ran."""
    rt = current()
    key = workload.warm_key(tile)
    if key in rt.warmed:
        return False
    workload.warmup(rt.device, tile)
    rt.warmed.add(key)
    return True


def open_job(dask_worker: Any = None) -> list[str]:
    """Open a job's window of allocator statistics on this worker (run in the one round
    trip that finds the workers for a job: none of its own) and return the keys of the
    warm-ups this worker has run (see :func:`warmup`): the client sends a warm worker none."""
    rt = current(dask_worker)
    tracker = rt.device.extra.get("allocator")  # the allocator's statistics (mgpu.memory.stats)
    if tracker is not None:
        tracker.begin()
    return rt.warmed.keys()


def take_turns(shared: dict[str, int], dask_worker: Any = None) -> bool:
    """Whether this worker now takes turns at its GPU: where ``shared`` (worker address ->
    how many workers share its device) says others share it."""
    turns = current(dask_worker).turns
    turns.shared = shared.get(dask_worker.address, 1) > 1
    return turns.shared


def with_device(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args, device)`` with this worker's device last: a measurement of the device
    alone run as a task (the roofline's ceilings). The job's window of allocator
    statistics opens again after it: what a measurement allocates is not the job's."""
    dev = current().device
    try:
        return fn(*args, dev)
    finally:
        tracker = dev.extra.get("allocator")
        if tracker is not None:
            tracker.begin()


def end_job(token: str, stage: Literal["close", "free"], dask_worker: Any = None) -> None:
    """Let go of what this worker holds for the job ``token`` once every tile has ended.

    Run on every worker twice: ``"close"`` drops the job's stepped tiles and closes what
    this worker opened of the others' (exchange buffers, panels); ``"free"``, once every
    worker has closed them, frees its own (an owner freeing memory a peer still has open
    is undefined in CUDA IPC).
    """
    rt = current(dask_worker)
    if stage == "close":
        rt.close_opened(token)
    else:
        rt.free_own(token)


def drop_stepped(token: str, dask_worker: Any = None) -> int:
    """Let go of the stepped tiles this worker holds for ``token`` (their steps were
    submitted again under another: a worker was lost); how many it held."""
    return current(dask_worker).steps.release(token)


def device_facts(dask_worker: Any = None) -> DeviceFacts:
    """What this worker's device is (run by ``Client.run`` as the cluster opens)."""
    return current(dask_worker).device.facts


def close_allocator_window(dask_worker: Any = None) -> dict[str, Any]:
    """The allocator's figures since the job opened its window (see :func:`open_job` and
    :mod:`mgpu.memory.stats`)."""
    dev: Device = current(dask_worker).device
    tracker = dev.extra.get("allocator")
    if tracker is None:
        return {"kind": "numpy" if not dev.is_gpu else "unknown"}
    return tracker.end()
