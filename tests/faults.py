"""A worker plugin that spoils one tile's answer before its check, for the tests that prove
every workload's check fails a job (see mgpu.tiles.run_tile's ``hook``)."""

from __future__ import annotations

import sys
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
