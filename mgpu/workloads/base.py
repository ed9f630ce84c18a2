"""The contract every workload fulfils, and the record a tile task sends back to the client.

Plug-ins reach these through :mod:`mgpu.workload`, whose docstring is the contract's
description; this module defines them. A :class:`Workload` declares its parameters (a
pydantic model; inputs through :class:`mgpu.inputs.InputParams`), plans a job into tiles
(a :class:`~mgpu.tiling.Plan`: pure data), computes one tile given a
:class:`~mgpu.worker.tile.TileContext` (``run``), checks it (``check``), combines the
partial answers (``combine``) and names the ceiling that bounds it (``ceiling``). What a
workload may do beyond that it opts into by subclassing a capability: :class:`Estimates`,
:class:`HostBytes`, :class:`Stepped`, :class:`Outputs`. The routine around a tile (timing,
staging counters, spill accounting, the check, the record) is the core's:
:func:`mgpu.worker.tile.run_tile`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from ..tiling import Plan, Tile
from ..worker.device import Device, DeviceFacts
from ..worker.sources import NpySink
from ..worker.stores import ZarrSink

if TYPE_CHECKING:
    from ..worker.tile import TileContext

__all__ = ["Estimates", "HostBytes", "Outputs", "Stepped", "TileRecord", "Verdict", "Workload"]

# A check's verdict, (error, passed), or a function that gives it once the tile's stream is done.
Verdict = tuple[float, bool] | Callable[[], tuple[float, bool]]


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
    bytes_d2d: int = 0  # received device to device from another worker's memory (CUDA IPC)
    d2d_s: float = 0.0  # device time of those copies
    # Of bytes_d2d, those from a worker on this same GPU, and how many copies brought them.
    bytes_same_device: int = 0
    copies_same_device: int = 0
    h2d_s: float = 0.0  # device time of the staged host->device copies (see mgpu.worker.transfer)
    d2h_s: float = 0.0
    kind: str = "tile"  # "panel": the making of a panel the tiles read (see mgpu.worker.panels)
    value: float | None = None
    spill_events: int = 0
    spill_bytes: int = 0
    verify_error: float | None = None
    verify_ok: bool | None = None
    verify_s: float = 0.0  # the check's own time: device time on a GPU, wall clock on a CPU
    extra: dict[str, Any] = field(default_factory=dict)
    # Worker wall clock as the tile passed its steps ("checked", "written", ...), in order:
    # where a tile's time goes between start and stop.
    marks: dict[str, float] = field(default_factory=dict)


P = TypeVar("P", bound=BaseModel)


class Workload(ABC, Generic[P]):
    """A kind of job: its parameters, how it tiles, what one tile does, how it is checked.

    Subclasses set ``name``, ``Params`` (a pydantic model, ``extra="forbid"``),
    ``unit`` and ``axes`` (the names ``tiling:`` accepts), optionally ``size_params`` and
    ``grow`` (for ``mgpu scale``), and implement ``plan``, ``run``, ``check`` and
    ``ceiling``; ``combine``, ``store`` and the rest have defaults.
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
    concurrency: int = 1  # a class default an instance may change (matmul writing its output)
    # The ceilings this workload measures (see measure_ceilings): name -> unit.
    ceiling_units: ClassVar[dict[str, str]] = {}
    # Whether its bound or estimate reads the device's own ceilings (the copy, the pinned
    # transfers, the generator, the check: mgpu.roofline.DEVICE_CEILINGS); where none does,
    # its first job on a machine measures only its own.
    uses_device_ceilings: ClassVar[bool] = True
    # Small ``params:`` that make a job of two tiles or more in well under a second on CPU
    # workers: the shared contract tests (tests/test_contract.py) run every workload with them.
    example: ClassVar[dict[str, Any]] = {}

    def __init__(self, params: P, *, verify: bool = True) -> None:
        self.params = params
        self.verify = verify
        self.sinks: dict[str, NpySink | ZarrSink] = {}  # the outputs' files or stores (see Outputs.prepare)

    # -- what every workload defines -------------------------------------------------
    @abstractmethod
    def plan(
        self, devices: dict[str, DeviceFacts], budget: int, tiling: dict[str, int], *, spill: bool = False
    ) -> Plan:
        """Tile the job for these workers (address -> facts) under ``budget`` bytes each.

        With ``spill`` a task may exceed the budget (its excess goes to managed memory);
        without it, a job whose smallest tile does not fit raises JobInputError.
        """

    @abstractmethod
    def run(self, ctx: TileContext, tile: Tile) -> Any:
        """Compute one tile on ``ctx.dev`` (this thread's stream current) and return its
        answer: what ``check`` and ``store`` are given.

        Time the main kernels with ``ctx.timer()`` (their device time is the tile's busy
        time) and set ``ctx.record.work`` (flops, bytes or iterations done). The panels the
        tile reads (``tile.needs``) are in ``ctx.panels``; whether the job verifies is
        ``ctx.verify`` (a tile may gather what its check needs as it computes).
        """

    @abstractmethod
    def check(self, ctx: TileContext, tile: Tile, answer: Any) -> Verdict | None:
        """Check ``answer`` on the worker (only when the job verifies): its error and whether
        it passes; or a function that returns them, called once the tile's stream has been
        waited for (the check's device work then queues behind the tile's, and nothing
        waits for it alone); or None when the client judges it (see ``reference``,
        ``judge``). Its time is counted as the check's (``record.verify_s``); work a tile
        does for its check inside ``run`` is timed with ``ctx.check_timer()``."""

    def combine(self, records: list[TileRecord]) -> float | None:
        """The job's scalar answer from the tiles' records (their ``value``), where it has
        one; None by default."""
        return None

    @abstractmethod
    def ceiling(self) -> str:
        """The name of the ceiling this job is bound by: one of ``ceiling_units`` or of the
        device's own (:data:`mgpu.roofline.DEVICE_CEILINGS`, e.g. ``"copy"``)."""

    # -- what every workload may change --------------------------------------------------
    def store(self, ctx: TileContext, tile: Tile, answer: Any) -> bool:
        """Put ``answer`` where the job keeps it (the sinks, the record's ``value``);
        returns whether anything was written to an output. Nothing by default."""
        return False

    def warmup(self, dev: Device, tile: Tile) -> None:
        """Run a tiny tile's kernels once, untimed: compiles them and creates library
        handles so the first real tile is not charged for it. ``tile`` is one of the
        plan's (its size and args are the job's)."""
        return None  # nothing to warm up by default

    def warm_key(self, tile: Tile) -> str:
        """What :meth:`warmup` for tiles like ``tile`` prepares on a worker, as a key: a
        worker that ran a warm-up of the same key (for this job or any other) needs no
        other, and the client then sends it none. By default the job itself (its params,
        its check, the tile's bounds and args); a workload whose warm-up depends on less
        (a dtype, a shape) says so, and a warm worker then serves other jobs at once."""
        params = self.params.model_dump_json()
        return f"{self.name}|{params}|{self.verify}|{sorted(tile.bounds.items())!r}|{sorted(tile.args.items())!r}"

    @classmethod
    def measure_ceilings(cls, dev: Device, only: Collection[str] | None = None) -> dict[str, float]:
        """Measure the rates named in ``ceiling_units`` on ``dev`` alone (a task on a worker,
        its stream current), in those units; a rate this backend cannot run may be left out.
        With ``only``, those named there alone (a job's bound: its first run on a machine
        measures what it reads). :func:`mgpu.roofline.median_seconds` times a call as
        every ceiling is timed."""
        return {}

    def reference(self, plan: Plan) -> Any:
        """Check data made apart from the tiles, or None (the default: tiles check themselves).

        Runs in a process beside the client while the tiles run, so a check that costs CPU
        time never holds a GPU back; starting that process costs about a second, so a
        check the tiles can make themselves belongs in ``check``.
        """
        return None

    def judge(self, records: list[TileRecord], reference: Any) -> None:
        """Complete the records' checks against ``reference``, once every tile has ended.
        Nothing by default: the tiles checked themselves."""
        return None

    def bound_note(self) -> str | None:
        """What the work set against the ceiling counts, where a reader could take it for
        something else (a dot of made inputs counts their writing and their reading)."""
        return None

    def make_panel(self, ctx: TileContext, panel: Any) -> Any:
        """Make ``panel`` (a :class:`~mgpu.tiling.Panel` the plan named) on this worker
        (``ctx.dev``), kept in ``ctx.panel_store`` for the job ``ctx.token``
        (:func:`mgpu.worker.panels.publish`)."""
        raise NotImplementedError(f"{self.name} plans no panels")


class Estimates(ABC):
    """A workload that knows its work before it runs: the client then says how long the
    job should take (``mgpu submit --dry-run``, the Result's estimate)."""

    @abstractmethod
    def expected_work(self, plan: Plan) -> float | None:
        """The work the plan's tiles will do (flops, bytes or iterations, as records count
        it), known before they run; None where it cannot be said."""

    def expected_seconds(self, plan: Plan, rates: dict[str, float], devices: int) -> float | None:
        """Seconds the plan's tiles should take on ``devices`` devices of these ceilings
        (name -> rate, see :mod:`mgpu.roofline`): by default the work at the rate of the
        workload's ceiling, spread evenly. None where the work or the rate is unknown."""
        work = self.expected_work(plan)
        rate = rates.get(self.ceiling())  # type: ignore[attr-defined]
        if work is None or not rate:
            return None
        return work / self.unit_scale / rate / devices  # type: ignore[attr-defined]


class HostBytes(ABC):
    """A workload whose data may live on the host (files): the bytes that must cross PCIe,
    set against those its plan moves (the Result's ``transfer``)."""

    @abstractmethod
    def host_bytes(self) -> int | None:
        """Bytes that must cross PCIe at least (inputs read once, output written once) when
        the job's data lives on the host (files); None when it is made on the devices."""

    def budget_host_bytes(self, plan: Plan) -> int | None:
        """The fewest bytes PCIe could carry under the plan's budget (at least
        :meth:`host_bytes`), where the workload knows; else None."""
        return None

    def naive_host_bytes(self, plan: Plan) -> int | None:
        """Bytes PCIe would carry had every tile read its own inputs from the host."""
        return None


class Stepped(ABC):
    """A workload whose tiles keep their state on their worker and step together,
    exchanging data with their neighbours (a plan with ``steps`` > 1; see ``Tile.neighbours``)."""

    @abstractmethod
    def start(self, ctx: TileContext, tile: Tile) -> Any:
        """Make the tile's state on its worker before its first step (it stays there, in
        ``ctx.state``, until the tile ends)."""

    @abstractmethod
    def step(self, ctx: TileContext, tile: Tile, step: int, received: dict[int, Any]) -> dict[int, Any]:
        """Advance the tile's state (``ctx.state``) by step ``step``.

        ``received`` maps each neighbour (a tile index, see ``Tile.neighbours``) to what it
        sent at the step before (empty at step 0). Returns what to send each neighbour for
        the next step: small arrays on this device, which reach a neighbour on this worker
        as they are (ordered by the streams) and one on another worker through the host.
        An array sent at step s must stay as it is until this tile's step s + 2 (the core
        runs that after the neighbours' step s + 1, which read it): keep two buffers per
        neighbour and use them in turn, rather than new arrays that could be freed and
        reused while a neighbour's stream still reads them. After the last step, ``run``
        makes the tile's answer from the state.
        """

    def finish_step(self, ctx: TileContext, tile: Tile, step: int) -> None:
        """The rest of step ``step``, after ``step`` made what the neighbours get: what is
        sent to another worker crosses meanwhile (a band's interior, say, once its edge
        rows are done). By default nothing: ``step`` did it all."""
        return None

    def save(self, ctx: TileContext, tile: Tile) -> Any:
        """The tile's state after a completed step as host data (NumPy arrays, copies that
        later steps leave alone), kept on two workers so a lost worker's tiles resume from
        it; with :meth:`restore`. By default None: the tiles of a job that loses a worker
        start again from step 0, from their inputs."""
        return None

    def restore(self, ctx: TileContext, tile: Tile, step: int, saved: Any) -> dict[int, Any]:
        """Make ``ctx.state`` (on ``ctx.dev``, perhaps another worker's) from what
        :meth:`save` returned once ``step`` steps were done; return what the tile sent its
        neighbours at step ``step - 1`` (as :meth:`step` returned it), which their step
        ``step`` reads. ``saved`` is shared: copy what the steps change."""
        raise NotImplementedError(f"{type(self).__name__} saves its tiles' state but cannot restore it")

    @property
    def resumable(self) -> bool:
        """Whether the tiles' state can be saved after a step and restored (see :meth:`save`)."""
        return type(self).save is not Stepped.save


class Outputs(ABC):
    """A workload that writes output files: checked and created before any task, renamed
    into place only if every tile passed."""

    @abstractmethod
    def prepare(self, *, force: bool) -> None:
        """Check the outputs and make their temporary files (``self.sinks``: name ->
        :class:`~mgpu.worker.sources.NpySink`), on the client before any task."""

    def finish(self, client: Any) -> list[str]:
        """Work after every tile passed (a worker renders a PNG, say); returns extra outputs."""
        return []
