"""Worker plugins that reach into every tile's answer before its check (see
mgpu.tiles.run_tile's ``hook``): one spoils a tile, for the tests that prove every
workload's check fails a job; one holds every tile, for the tests that stop a job mid-way."""

from __future__ import annotations

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
    """Hold every tile ``seconds`` longer on these workers (before its check), so that a job
    is still running when a test kills a worker or interrupts mgpu."""

    name = "mgpu-test-slow-tiles"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_answer(self, workload: Any, tile: Any, answer: Any) -> Any:
        time.sleep(self.seconds)
        return answer
