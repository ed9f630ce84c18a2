"""Worker plugins that reach into every tile's answer before its check (see
mgpu.worker.tile.run_tile's ``hook``): one spoils a tile, for the tests that prove every
workload's check fails a job; and one that holds every tile, for the tests that stop a job mid-way."""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

import cloudpickle
from distributed import WorkerPlugin

# Sent by value: the workers need not import the tests.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SpoilTile(WorkerPlugin):
    """Spoil the answer of tile ``index`` of every job (``Workload.spoil``) on these workers."""

    name = "mgpu-test-spoil-tile"

    def __init__(self, index: int) -> None:
        self.index = index

    def on_answer(self, workload: Any, tile: Any, answer: Any) -> Any:
        return workload.spoil(answer) if tile.index == self.index else answer


class SlowTiles(WorkerPlugin):
    """Hold every tile ``seconds`` before it starts, on these workers, so that a job is still
    running when a test kills a worker, changes an input or interrupts mgpu.

    It wraps the tile task's function in each worker's process (tasks name it by reference,
    so the workers find the wrapper); teardown puts it back.
    """

    name = "mgpu-test-slow-tiles"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._real: Any = None

    def setup(self, worker: Any = None) -> None:
        import mgpu.worker.tasks

        real = self._real = mgpu.worker.tasks.run_tile
        seconds = self.seconds

        @functools.wraps(real)
        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return real(*args, **kwargs)

        mgpu.worker.tasks.run_tile = slow

    def teardown(self, worker: Any = None) -> None:
        import mgpu.worker.tasks

        if self._real is not None:
            mgpu.worker.tasks.run_tile = self._real
