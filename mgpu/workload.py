"""The plug-in contract: everything a workload needs from mgpu, in one module.

A workload is a class the registry finds by name (mgpu's own in ``mgpu/workloads/``, any
other package's under the ``mgpu.workloads`` entry-point group). A plug-in imports from
this module alone; the rest of mgpu is internal and may change.

What every workload defines (:class:`Workload`)
-----------------------------------------------
``name``, ``Params``
    Its name in a job file, and a pydantic model of its ``params:`` (``extra="forbid"``;
    operands from files or random through :class:`InputParams`), with ``unit``,
    ``unit_scale``, ``axes`` (what ``tiling:`` accepts), ``verify_method`` and
    ``example`` (small params the contract tests run it with).
``plan(devices, budget, tiling, *, spill)``
    The job cut into tiles for these workers: a :class:`Plan` that is plain data, each
    :class:`Tile` carrying what it needs (:func:`split`, :func:`split_by_size` and
    :func:`assign_contiguous` cut and place).
``run(ctx, tile)``
    One tile on ``ctx.dev`` (a :class:`Device`: ``dev.xp`` is NumPy or CuPy, so the same
    code runs on both), given a :class:`TileContext`; returns the tile's answer.
``check(ctx, tile, answer)``
    The answer's own verification: (error, passed); or a function that gives them once
    the tile's stream is done (its device work queued behind the tile's, a
    :data:`Verdict`); or None where the client judges it. Its time is the result's
    ``verify.seconds``; check work done inside ``run`` is timed with ``ctx.check_timer()``.
``combine(records)``
    The job's scalar answer from the tiles' :class:`TileRecord` values (None: none).
``ceiling()``
    The name of the device ceiling that bounds the job (e.g. ``"copy"``).

Optional capabilities, each a class to subclass beside :class:`Workload`
-------------------------------------------------------------------------
:class:`Estimates`
    ``expected_work(plan)``: the work known before the job runs, so mgpu says how long it
    should take.
:class:`HostBytes`
    ``host_bytes()``: bytes that must cross PCIe when the data lives in files, set against
    those the job moved.
:class:`Stepped`
    ``start``, ``step``, ``finish_step``: tiles that keep their state on their worker and
    exchange data with their neighbours at every step (``Plan.steps``, ``Tile.neighbours``);
    ``save`` and ``restore`` (optional): a tile's state in host memory after a step, kept on
    two workers every ``mgpu.recovery.checkpoint-steps`` steps, from which the tiles go on
    after a worker is lost (without them, from step 0).
:class:`Outputs`
    ``prepare(force=...)``: outputs checked and their files or stores (:func:`output_sink`
    makes an :class:`NpySink` or a :class:`ZarrSink` by the path's suffix; see
    :func:`check_output_path`) made before any task; renamed into place only if every
    tile passed.

``warmup(dev, tile)``, optional, runs a small tile's kernels untimed on each worker before
the job's tiles (compiles them, makes library handles); ``warm_key(tile)`` names what it
prepares: a worker that ran a warm-up of the same key, for this job or another, is sent
none (by default the key is the job's own params and the tile's bounds).

The routine around a tile (timing, staging counters, spill accounting, the check, the
record) is mgpu's. Errors in params that a model cannot express raise
:class:`JobInputError` naming the key.
"""

from __future__ import annotations

from .errors import JobInputError
from .inputs import InputParams, Operand
from .sizes import format_bytes
from .tiling import Panel, Plan, Tile, assign_contiguous, split, split_by_size
from .worker.device import Device, DeviceFacts
from .worker.kernels import is_cupy, random_block
from .worker.sources import NpySink, check_output_path
from .worker.stores import ZarrSink, output_sink
from .worker.tile import TileContext
from .workloads.base import Estimates, HostBytes, Outputs, Stepped, TileRecord, Verdict, Workload

__all__ = [
    "Device",
    "DeviceFacts",
    "Estimates",
    "HostBytes",
    "InputParams",
    "JobInputError",
    "NpySink",
    "Operand",
    "Outputs",
    "Panel",
    "Plan",
    "Stepped",
    "Tile",
    "TileContext",
    "TileRecord",
    "Verdict",
    "Workload",
    "ZarrSink",
    "assign_contiguous",
    "check_output_path",
    "format_bytes",
    "is_cupy",
    "output_sink",
    "random_block",
    "split",
    "split_by_size",
]
