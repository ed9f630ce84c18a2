"""Faults the tests inject from their side: a tile whose answer is spoiled between its run
and its check, for the tests that prove every workload's check fails a job; tiles (or a
stepped job's steps) held before they start, for the tests that stop a job mid-way; and
writes into an output that fail mid-way. Each is a worker plugin that wraps a function in each worker's process
(tasks name it by reference, so the workers find the wrapper); teardown puts it back."""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import time
from typing import Any

import cloudpickle
from distributed import WorkerPlugin

# Sent by value: the workers need not import the tests.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def spoil(answer: Any) -> Any:
    """``answer`` with its first part off by one everywhere, in place: the first field of a
    dataclass, a number or an array. Every workload's answer
    leads with what its check reads (a product, counts, a band, a sum)."""
    if dataclasses.is_dataclass(answer):
        name = dataclasses.fields(answer)[0].name
        value = getattr(answer, name)
        if isinstance(value, (int, float)):
            setattr(answer, name, value + 1)
        else:
            value += 1  # an array, changed where it lies (on its device)
        return answer
    return answer + 1


def spoiled(workload: Any) -> Any:
    """A copy of ``workload`` whose ``run`` spoils every answer it returns (see :func:`spoil`):
    an instance of a subclass made here, so the core sees the workload it knows."""
    cls = type(workload)
    subclass = type(f"Spoiled{cls.__name__}", (cls,), {"run": lambda self, ctx, tile: spoil(cls.run(self, ctx, tile))})
    twin = copy.copy(workload)
    twin.__class__ = subclass
    return twin


class _WrapsRunTile(WorkerPlugin):
    """Replace the task ``mgpu.worker.tasks.<task>`` (``run_tile`` unless a subclass says)
    in the worker's process with :meth:`wrap`'s."""

    task = "run_tile"

    def __init__(self) -> None:
        self._real: Any = None

    def wrap(self, real: Any) -> Any:
        raise NotImplementedError

    def setup(self, worker: Any = None) -> None:
        import mgpu.worker.tasks

        self._real = getattr(mgpu.worker.tasks, self.task)
        setattr(mgpu.worker.tasks, self.task, functools.wraps(self._real)(self.wrap(self._real)))

    def teardown(self, worker: Any = None) -> None:
        import mgpu.worker.tasks

        if self._real is not None:
            setattr(mgpu.worker.tasks, self.task, self._real)


class SpoilTile(_WrapsRunTile):
    """Spoil the answer of tile ``index`` of every job on these workers (:func:`spoiled`)."""

    name = "mgpu-test-spoil-tile"

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def wrap(self, real: Any) -> Any:
        index = self.index

        def spoiling(workload: Any, tile: Any, *args: Any, **kwargs: Any) -> Any:
            return real(spoiled(workload) if tile.index == index else workload, tile, *args, **kwargs)

        return spoiling


class SlowTiles(_WrapsRunTile):
    """Hold every tile ``seconds`` before it starts, on these workers, so that a job is still
    running when a test kills a worker, changes an input or interrupts mgpu."""

    name = "mgpu-test-slow-tiles"

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def wrap(self, real: Any) -> Any:
        seconds = self.seconds

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return real(*args, **kwargs)

        return slow


class SlowSteps(SlowTiles):
    """Hold every step of a stepped job ``seconds`` before it starts, on these workers."""

    name = "mgpu-test-slow-steps"
    task = "step_tile"


class FailWrites(WorkerPlugin):
    """Make every write into an output whose name ends in ``suffix``, past its first row,
    fail (``OSError``) on these workers: a job whose output is written piece by piece
    fails after some pieces are in the file. Other outputs are written as ever."""

    name = "mgpu-test-fail-writes"

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self._real: Any = None

    def setup(self, worker: Any = None) -> None:
        from mgpu.worker.sources import NpySink

        real = self._real = NpySink.write
        suffix = self.suffix

        @functools.wraps(real)
        def write(sink: Any, index: Any, block: Any, dev: Any = None) -> None:
            if sink.path.endswith(suffix) and index[0].indices(sink.shape[0])[0] > 0:
                raise OSError(28, "no space left (a test's stand-in)", sink.partial)
            real(sink, index, block, dev)

        NpySink.write = write  # type: ignore[method-assign]

    def teardown(self, worker: Any = None) -> None:
        from mgpu.worker.sources import NpySink

        if self._real is not None:
            NpySink.write = self._real  # type: ignore[method-assign]
