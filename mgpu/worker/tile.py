"""The routine around one tile on its worker, written once for every workload.

A workload says what a tile computes (:meth:`~mgpu.workloads.base.Workload.run`), how it
is checked (``check``) and where its answer goes (``store``); this module times it,
counts the bytes it staged and what it spilled, runs the check when the job verifies,
and fills the record the client receives. Panels (blocks made once per worker) are made
through the same routine, and so are the warm-ups' small tiles. A stepped tile (see
``Plan.steps``) keeps its context on its worker from its first step to its end, in the
worker runtime's :class:`StepStore`; at the steps the client names it saves its state
(a :class:`Checkpoint`, which the client keeps on two workers), and a tile whose worker
was lost resumes from one on another worker (:func:`resume_tile`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..tiling import Panel, Tile
from ..workloads.base import Stepped, TileRecord, Verdict, Workload
from . import exchange
from .device import Device, Timing
from .panels import PanelRef, PanelStore

__all__ = [
    "Checkpoint",
    "Sent",
    "StepStore",
    "TileContext",
    "make_panel",
    "new_record",
    "resume_tile",
    "run_tile",
    "step_tile",
]


@dataclass
class TileContext:
    """What a tile's computation is given on its worker.

    ``dev`` offers the array module, this thread's streams (``stream``, ``copy_stream``,
    ``in_order``) and host<->device copies; ``panels`` maps the names in ``tile.needs`` to
    the panels made for the job (:class:`~mgpu.worker.panels.PanelRef`), and ``panel_store``
    is where this worker keeps the panels it made and the peers' it opened (its runtime's);
    ``record`` is the record being filled (``work``, ``value``, ``bytes_d2d``, ``extra``
    are the workload's to set); ``token`` names the job's run on the workers.
    """

    dev: Device
    record: TileRecord
    verify: bool = True
    panels: dict[str, PanelRef] = field(default_factory=dict)
    token: str = ""
    timings: list[Timing] = field(default_factory=list)
    check_timings: list[Timing] = field(default_factory=list)
    state: Any = None  # a stepped tile's, between its steps (see Workload.start)
    # A tile run apart from a worker's runtime (a warm-up's, a test's) gets a store of its own.
    panel_store: PanelStore = field(default_factory=PanelStore)

    @contextlib.contextmanager
    def timer(self, stream: Any = None, *, wait: bool = False) -> Iterator[Timing]:
        """Time device work enqueued inside (see :meth:`Device.timer`); its seconds count
        in the tile's busy time. With ``wait`` the block ends once that work has run."""
        with self.dev.timer(stream) as t:
            yield t
        self.timings.append(t)
        if wait:
            t.seconds  # noqa: B018 (reading the seconds waits for the stop event)

    @contextlib.contextmanager
    def check_timer(self, stream: Any = None) -> Iterator[Timing]:
        """Time device work enqueued inside for the tile's check (see :meth:`Device.timer`):
        its seconds count as the check's (``record.verify_s``), not in the busy time."""
        with self.dev.timer(stream) as t:
            yield t
        self.check_timings.append(t)

    def mark(self, name: str) -> None:
        """Note the worker's wall clock as the tile passes a step."""
        self.record.marks[name] = time.time()

    @property
    def busy_s(self) -> float:
        return sum(t.seconds for t in self.timings)


def new_record(dev: Device, tile: Tile, start: float, **kwargs: Any) -> TileRecord:
    """A record of ``tile`` begun at ``start`` on this worker (stop: now)."""
    return TileRecord(
        index=tile.index,
        worker=f"{socket.gethostname()}:{os.getpid()}",
        device=dev.facts.id,
        start=start,
        stop=time.time(),
        **kwargs,
    )


def _counter(dev: Device, *, add: bool = False) -> Callable[[TileRecord], None]:
    """Start counting what a task moves and spills; the function returned fills a record
    with what was counted since (adds it, with ``add``: a stepped tile's steps each count)."""
    h2d, d2h, (events, spilled) = dev.bytes_h2d, dev.bytes_d2h, dev.spill_counts()
    if dev.is_gpu:
        dev.copy_seconds()  # forget copies from before this task (a warm-up's)

    def fill(record: TileRecord) -> None:
        now_events, now_spilled = dev.spill_counts()
        counts: dict[str, float] = {
            "bytes_h2d": dev.bytes_h2d - h2d,
            "bytes_d2h": dev.bytes_d2h - d2h,
            "spill_events": now_events - events,
            "spill_bytes": now_spilled - spilled,
        }
        if dev.is_gpu:
            seconds = dev.copy_seconds()
            counts.update(h2d_s=seconds["h2d"], d2h_s=seconds["d2h"])
        for name, value in counts.items():
            setattr(record, name, getattr(record, name) + value if add else value)

    return fill


@dataclass
class Sent:
    """What one step of tile ``sender`` sends its neighbours (tile index -> data).

    ``ready``: on a GPU, an event on the sender's stream after which the step and its
    data (on the device) are complete; None where the step was waited for (its data
    fetched to the host for a neighbour on another worker) and on CPUs.
    """

    sender: int
    data: dict[int, Any]
    ready: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # Only what was made for another process goes there (host copies, peer buffers'
        # names): the device arrays are for this worker's tiles, and an event means
        # nothing elsewhere.
        far = {n: d for n, d in self.data.items() if isinstance(d, (np.ndarray, exchange.PeerArray))}
        return {"sender": self.sender, "data": far, "ready": None}


@dataclass
class Checkpoint:
    """A stepped tile's state once ``step`` steps were done, in host memory (the workload's
    :meth:`~mgpu.workloads.base.Stepped.save`), with what its record had counted by then:
    a tile resumed from it reports the whole job's work, from its first step's start."""

    index: int
    step: int
    state: Any
    start: float
    work: float


class StepStore:
    """The contexts of one worker's stepped tiles between their steps, by (job token, tile
    index), and the checkpoints they saved until the client takes them."""

    def __init__(self) -> None:
        self._contexts: dict[tuple[str, int], TileContext] = {}
        self._saved: dict[tuple[str, int, int], Checkpoint] = {}
        self._lock = threading.Lock()  # the steps of one worker's tiles run on its task threads

    def keep(self, token: str, index: int, ctx: TileContext) -> None:
        with self._lock:
            self._contexts[(token, index)] = ctx

    def get(self, token: str, index: int) -> TileContext:
        with self._lock:
            return self._contexts[(token, index)]

    def pop(self, token: str, index: int) -> TileContext | None:
        with self._lock:
            return self._contexts.pop((token, index), None)

    def held(self) -> int:
        """How many stepped tiles this worker holds, over every job."""
        with self._lock:
            return len(self._contexts)

    def stash(self, token: str, checkpoint: Checkpoint) -> None:
        """Hold a tile's checkpoint until :meth:`take`."""
        with self._lock:
            self._saved[(token, checkpoint.index, checkpoint.step)] = checkpoint

    def take(self, token: str, index: int, step: int) -> Checkpoint:
        with self._lock:
            return self._saved.pop((token, index, step))

    def release(self, token: str) -> int:
        """Drop the stepped tiles of one job (and the checkpoints not taken)."""
        with self._lock:
            gone = [key for key in self._contexts if key[0] == token]
            for key in gone:
                del self._contexts[key]
            for saved in [key for key in self._saved if key[0] == token]:
                del self._saved[saved]
        return len(gone)

    def close(self) -> None:
        with self._lock:
            self._contexts.clear()
            self._saved.clear()


def step_tile(
    workload: Workload,
    dev: Device,
    tile: Tile,
    step: int,
    token: str,
    previous: Sent | None,
    received: list[Sent],
    remote: frozenset[int] = frozenset(),
    peers: frozenset[int] = frozenset(),
    same_device: frozenset[int] = frozenset(),
    save: bool = False,
    *,
    steps: StepStore,
    buffers: exchange.PeerBuffers,
) -> Sent:
    """Run step ``step`` of a stepped tile on this worker (see ``Plan.steps``).

    Waits (on this thread's stream) for the tile's step before and for what its neighbours
    sent, calls the workload's ``step`` (``start`` first, at step 0), then its
    ``finish_step``, and returns what the tile sends. Data for a neighbour in ``remote``
    (placed on another worker) leaves on the copy stream as soon as ``step`` has made it,
    while ``finish_step``'s work runs: device to device where that worker is in ``peers``
    (a GPU of this host) and the GPUs reach each other, or in ``same_device`` (a worker on
    this GPU) (see :mod:`mgpu.worker.exchange`), through the host otherwise; what came
    device to device is counted in the tile's record (``bytes_d2d``, and of it
    ``bytes_same_device``). The rest stays on the device, ordered by an event after the step.
    ``steps`` keeps the tile's context between its steps; ``buffers`` are the worker's of
    that exchange. With ``save``, the state after the step is saved (the workload's
    ``save``) and held in ``steps`` as a :class:`Checkpoint` until the client takes it.
    """
    if not isinstance(workload, Stepped):
        raise TypeError(f"{workload.name} plans no steps: it is not a mgpu.workload.Stepped")
    with dev.on_stream():
        if dev.is_gpu:
            for sent in (previous, *received):
                if sent is not None and sent.ready is not None:
                    dev.stream.wait_event(sent.ready)
        count = _counter(dev, add=True)
        if step == 0:
            ctx = TileContext(dev, new_record(dev, tile, time.time(), busy_s=0.0, work=0.0), workload.verify, {}, token)
            ctx.state = workload.start(ctx, tile)
            steps.keep(token, tile.index, ctx)
        else:
            ctx = steps.get(token, tile.index)
        inbox = {}
        for sent in received:
            data = sent.data[tile.index]
            if isinstance(data, exchange.PeerArray):
                ctx.record.bytes_d2d += data.nbytes
                if data.same_device:
                    ctx.record.bytes_same_device += data.nbytes
                    ctx.record.copies_same_device += 1
                data = buffers.receive(dev, data, previous.ready if previous is not None else None)
            inbox[sent.sender] = data
        out = workload.step(ctx, tile, step, inbox)
        far = remote & set(out)
        made = dev.stream.record() if far and dev.is_gpu else None
        workload.finish_step(ctx, tile, step)
        if far:
            direct = (
                ((peers if exchange.peers_reachable() else frozenset()) | same_device) if dev.is_gpu else frozenset()
            )
            out = {
                n: (buffers.export(dev, token, tile.index, n, step, d, made) if n in direct else _fetch(dev, d, made))
                if n in far
                else d
                for n, d in out.items()
            }
        if save:  # after the step's work on this stream: the copy waits for it
            state = workload.save(ctx, tile)
            steps.stash(token, Checkpoint(tile.index, step + 1, state, ctx.record.start, ctx.record.work))
        # The next step (and the neighbours' here) may run on another thread's stream.
        ready = dev.stream.record() if dev.is_gpu else None
        count(ctx.record)
    return Sent(tile.index, out, ready)


def resume_tile(
    workload: Workload,
    dev: Device,
    tile: Tile,
    checkpoint: Checkpoint,
    token: str,
    remote: frozenset[int] = frozenset(),
    *,
    steps: StepStore,
) -> Sent:
    """Make a stepped tile's context on this worker from ``checkpoint`` (its state once
    ``checkpoint.step`` steps were done), as its step ``checkpoint.step - 1`` left it: the
    tile's next step and its neighbours' take the :class:`Sent` returned as that step's.
    What goes to a neighbour in ``remote`` (another worker) goes through the host."""
    if not isinstance(workload, Stepped):
        raise TypeError(f"{workload.name} plans no steps: it is not a mgpu.workload.Stepped")
    with dev.on_stream():
        count = _counter(dev, add=True)
        record = new_record(dev, tile, checkpoint.start, busy_s=0.0, work=checkpoint.work)
        ctx = TileContext(dev, record, workload.verify, {}, token)
        out = workload.restore(ctx, tile, checkpoint.step, checkpoint.state)
        steps.keep(token, tile.index, ctx)
        made = dev.stream.record() if dev.is_gpu else None
        out = {n: _fetch(dev, d, made) if n in remote else d for n, d in out.items()}
        ready = dev.stream.record() if dev.is_gpu else None
        count(ctx.record)
    return Sent(tile.index, out, ready)


def _fetch(dev: Device, data: Any, made: Any) -> np.ndarray:
    """``data`` on the host, copied on the copy stream once ``made`` (an event) has passed:
    the work enqueued after it on this thread's stream goes on meanwhile."""
    if not dev.is_gpu:
        return np.asarray(data)
    copy = dev.copy_stream
    copy.wait_event(made)
    return data.get(stream=copy)  # blocking: returns once the copy is done


def run_tile(
    workload: Workload,
    dev: Device,
    tile: Tile,
    panels: dict[str, PanelRef] | None = None,
    *,
    token: str = "",
    stepped: Sent | None = None,
    steps: StepStore | None = None,
    panel_store: PanelStore | None = None,
    turn: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
) -> TileRecord:
    """Run ``tile`` of ``workload`` on ``dev`` and return its record.

    On this thread's stream: the workload's ``run``, then (when the job verifies) its
    ``check``, then its ``store``, then a wait for the stream (and a deferred check's
    verdict). The record holds the device time of what the workload timed, the bytes
    staged in and out, what spilled, the check's error, verdict and time, and the wall
    clock at the steps ("checked", "written").
    ``stepped`` is the last step of a stepped tile (see :func:`step_tile`), whose context,
    kept in ``steps`` since its first step, the tile ends with. ``panel_store`` holds the
    worker's panels (its runtime's), where the tile finds ``panels``. ``turn`` holds the
    device from the tile's first work on it until that work has run (a turn at a GPU that
    other workers share, see :mod:`mgpu.worker.turns`): what the host does before and
    after runs while another worker has its turn.
    """
    if stepped is None:
        fill = _counter(dev)
        ctx = TileContext(
            dev, new_record(dev, tile, time.time(), busy_s=0.0, work=0.0), workload.verify, panels or {}, token
        )
        if panel_store is not None:
            ctx.panel_store = panel_store
    else:
        if steps is None:
            raise ValueError(f"tile {tile.index} is stepped: run_tile needs the steps' store (steps=)")
        kept = steps.pop(token, tile.index)
        if kept is None:
            raise RuntimeError(f"tile {tile.index}'s state is not on this worker: its steps ran elsewhere")
        ctx = kept
        fill = _counter(dev, add=True)
    with dev.on_stream():
        with turn():
            ctx.mark("turn")
            if stepped is not None and stepped.ready is not None:
                dev.stream.wait_event(stepped.ready)
            answer = workload.run(ctx, tile)
            verdict: Verdict | None = None
            if workload.verify:
                with ctx.check_timer():
                    verdict = workload.check(ctx, tile, answer)
                if verdict is not None and not callable(verdict):  # None: judged on the client
                    ctx.record.verify_error, ctx.record.verify_ok = verdict
                    ctx.mark("checked")
            if workload.store(ctx, tile, answer):
                ctx.mark("written")
            dev.synchronize()
        ctx.mark("turn_done")
        if callable(verdict):  # its device work ran behind the tile's, waited for with it
            ctx.record.verify_error, ctx.record.verify_ok = verdict()
            ctx.mark("checked")
    record = ctx.record
    record.busy_s = ctx.busy_s
    record.verify_s = sum(t.seconds for t in ctx.check_timings)
    fill(record)
    record.stop = time.time()
    return record


def make_panel(workload: Workload, dev: Device, panel: Panel, token: str, panel_store: PanelStore) -> PanelRef:
    """Make ``panel`` on this worker, kept in ``panel_store`` (its runtime's); the reference
    returned carries the record of its making."""
    record = new_record(dev, Tile(-1, panel.bounds), time.time(), busy_s=0.0, work=0.0, kind="panel")
    fill = _counter(dev)
    ctx = TileContext(dev, record, workload.verify, token=token, panel_store=panel_store)
    ref = workload.make_panel(ctx, panel)
    record.stop = time.time()
    record.extra["panel"] = panel.name
    fill(record)
    return dataclasses.replace(ref, record=record)
