"""A worker warms up once for a job's tiles: the same job again (a repeated submit on a
running cluster) skips it; another job's tiles get their own."""

from __future__ import annotations

from typing import Any

import numpy as np

from mgpu.tiling import Tile
from mgpu.worker import runtime, tasks
from mgpu.worker.device import Device, DeviceFacts
from mgpu.workloads.dot import Dot, DotParams


def test_a_worker_warms_up_once_for_the_same_job(monkeypatch):
    rt = runtime.Runtime(Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h")))
    monkeypatch.setattr(tasks, "current", lambda dask_worker=None: rt)
    warmed: list[tuple[int, Any]] = []
    monkeypatch.setattr(Dot, "warmup", lambda self, dev, tile: warmed.append((self.params.n, tile.bounds)))
    tile = Tile(0, {"n": (0, 500)})
    assert tasks.warmup(Dot(DotParams(n=1000)), tile) is True
    assert tasks.warmup(Dot(DotParams(n=1000)), tile) is False  # the same job: its kernels are warm
    assert tasks.warmup(Dot(DotParams(n=2000)), Tile(0, {"n": (0, 1000)})) is True
    assert tasks.warmup(Dot(DotParams(n=1000), verify=False), tile) is True  # no check: other kernels
    assert warmed == [(1000, {"n": (0, 500)}), (2000, {"n": (0, 1000)}), (1000, {"n": (0, 500)})]
