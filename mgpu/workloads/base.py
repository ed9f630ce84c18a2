"""What every workload provides, and the record a tile task sends back to the client."""

from __future__ import annotations

import os
import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import dask.config
from pydantic import BaseModel

from ..device import Device, DeviceFacts
from ..planner import Plan, Tile
from ..sources import NpySink

__all__ = ["TileRecord", "Workload", "injected_delay", "injected_fault"]


@dataclass
class TileRecord:
    """The small record a tile task returns: timings, bytes, its check and partial answer."""

    index: int
    worker: str
    device: int
    start: float  # worker wall clock, seconds since the epoch
    stop: float
    busy_s: float  # device time of the tile's main kernel(s)
    work: float  # flops, bytes or iterations this tile did
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    bytes_d2d: int = 0  # received from another GPU, peer to peer
    d2d_s: float = 0.0  # device time of those copies
    h2d_s: float = 0.0  # device time of the staged host->device copies (see mgpu.transfer)
    d2h_s: float = 0.0
    kind: str = "tile"  # "panel": the making of a panel the tiles read (see mgpu.panels)
    value: float | None = None
    spill_events: int = 0
    spill_bytes: int = 0
    verify_error: float | None = None
    verify_ok: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Worker wall clock as the tile passed its steps ("checked", "written", ...), in order:
    # where a tile's time goes between start and stop (benchmarks/timeline.py prints them).
    marks: dict[str, float] = field(default_factory=dict)


def injected_fault(kind: str, tile: Tile) -> bool:
    """Whether the tests asked this tile to be corrupted (``mgpu.testing.corrupt-tile``).

    Read from Dask's config on the worker (``DASK_MGPU__TESTING__CORRUPT_TILE=3`` in the
    worker's environment), so the check path can be shown to fail a job end to end.
    """
    target = dask.config.get("mgpu.testing.corrupt-tile", default=None)
    return target is not None and int(target) == tile.index


def injected_delay() -> float:
    """Seconds the tests asked every tile to take longer (``mgpu.testing.tile-delay``).

    Read from Dask's config on the worker, so that a job is still running when a test
    kills a worker or interrupts mgpu.
    """
    return float(dask.config.get("mgpu.testing.tile-delay", default=0) or 0)


class Workload(ABC):
    """A kind of job: its parameters, how it tiles, what one tile does, how it is checked.

    Subclasses set ``name``, ``Params`` (a pydantic model, ``extra="forbid"``),
    ``unit`` and ``axes`` (the names ``tiling:`` accepts), optionally ``size_params`` and
    ``grow`` (for ``mgpu scale``), and implement the methods.
    The instance travels to the workers with each task, so it holds only parameters.
    """

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]]
    unit: ClassVar[str]  # "TFLOP/s" | "GB/s" | "Giter/s"
    unit_scale: ClassVar[float]  # work units per one unit of throughput numerator
    axes: ClassVar[tuple[str, ...]]
    verify_method: ClassVar[str]
    # The params that set the problem's size (named in sweeps), and those ``mgpu scale
    # --weak`` grows with the device count unless the job's ``scale.grow`` says otherwise.
    size_params: ClassVar[tuple[str, ...]] = ()
    grow: ClassVar[tuple[str, ...]] = ()
    # Tiles that may share one device at once (each gets 1/concurrency of the budget).
    concurrency: ClassVar[int] = 1
    # The ceilings this workload measures (see measure_ceilings): name -> unit.
    ceiling_units: ClassVar[dict[str, str]] = {}

    def __init__(self, params: BaseModel, *, verify: bool = True) -> None:
        self.params = params
        self.verify = verify
        self.sinks: dict[str, NpySink] = {}

    # -- on the client -------------------------------------------------------------
    def prepare(self, *, force: bool) -> None:
        """Check outputs and create their temporary files (the sinks); before any task."""

    @abstractmethod
    def plan(
        self, devices: dict[str, DeviceFacts], budget: int, tiling: dict[str, int], *, spill: bool = False
    ) -> Plan:
        """Tile the job for these workers (address -> facts) under ``budget`` bytes each.

        With ``spill`` a task may exceed the budget (its excess goes to managed memory);
        without it, a job whose smallest tile does not fit raises JobInputError.
        """

    @abstractmethod
    def ceiling(self) -> str:
        """The name of the ceiling this job is bound by: one of ``ceiling_units`` or of the
        device's own (:data:`mgpu.roofline.DEVICE_CEILINGS`, e.g. ``"copy"``)."""

    @classmethod
    def measure_ceilings(cls, dev: Device) -> dict[str, float]:
        """Measure the rates named in ``ceiling_units`` on ``dev`` alone (a task on a worker,
        its stream current), in those units; a rate this backend cannot run may be left out.
        :func:`mgpu.roofline.median_seconds` times a call as every ceiling is timed."""
        return {}

    def reduce(self, records: list[TileRecord]) -> float | None:
        """The job's scalar answer from the tiles' records, where it has one."""
        return None

    def host_bytes(self) -> int | None:
        """Bytes that must cross PCIe at least (inputs read once, output written once) when
        the job's data lives on the host (files); None when it is made on the devices."""
        return None

    def naive_host_bytes(self, plan: Plan) -> int | None:
        """Bytes PCIe would carry had every tile read its own inputs from the host."""
        return None

    def reference(self, plan: Plan) -> Any:
        """Check data made apart from the tiles, or None (the default: tiles check themselves).

        Runs in a process beside the client while the tiles run, so a check that costs CPU
        time (Mandelbrot's reference counts) never holds a GPU back.
        """
        return None

    def judge(self, records: list[TileRecord], reference: Any) -> None:
        """Complete the records' checks against ``reference``, once every tile has ended."""

    def finish(self, client: Any) -> list[str]:
        """Work after every tile passed (a worker renders a PNG, say); returns extra outputs."""
        return []

    # -- on a worker ---------------------------------------------------------------
    def warmup(self, dev: Device, tile: Tile) -> None:
        """Run a tiny tile's kernels once, untimed: compiles them and creates library
        handles so the first real tile is not charged for it. ``tile`` is one of the
        plan's (its size and args are the job's)."""

    @abstractmethod
    def run_tile(self, dev: Device, tile: Tile, panels: dict[str, Any] | None = None) -> TileRecord:
        """Compute, check and write one tile on this worker's device.

        ``panels`` maps the names in ``tile.needs`` to :class:`~mgpu.panels.PanelRef`.
        """

    def make_panel(self, dev: Device, panel: Any, token: str) -> Any:
        """Make ``panel`` (a :class:`~mgpu.planner.Panel` the plan named) on this worker."""
        raise NotImplementedError(f"{self.name} plans no panels")

    # -- helpers -------------------------------------------------------------------
    @staticmethod
    def new_record(dev: Device, tile: Tile, start: float, **kwargs: Any) -> TileRecord:
        return TileRecord(
            index=tile.index,
            worker=f"{socket.gethostname()}:{os.getpid()}",
            device=dev.facts.id,
            start=start,
            stop=time.time(),
            **kwargs,
        )
