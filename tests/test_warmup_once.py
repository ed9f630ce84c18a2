"""A worker warms up once for each key of warm-up (what the warm-up prepares: a dtype, a
product's shape, the check's kernels): the same job again, or another job of the same key,
skips it; a job of another key gets its own. The keys say what the warm-ups depend on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mgpu.tiling import Tile
from mgpu.worker import runtime, tasks
from mgpu.worker.device import Device, DeviceFacts
from mgpu.workloads.dot import Dot, DotParams
from mgpu.workloads.mandelbrot import Mandelbrot, MandelbrotParams
from mgpu.workloads.matmul import Matmul, MatmulParams


def _runtime() -> runtime.Runtime:
    return runtime.Runtime(Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h")))


def test_a_worker_warms_up_once_for_each_key(monkeypatch):
    rt = _runtime()
    monkeypatch.setattr(tasks, "current", lambda dask_worker=None: rt)
    warmed: list[tuple[int, Any]] = []
    monkeypatch.setattr(Dot, "warmup", lambda self, dev, tile: warmed.append((self.params.n, tile.bounds)))
    tile = Tile(0, {"n": (0, 500)})
    assert tasks.warmup(Dot(DotParams(n=1000)), tile) is True
    assert tasks.warmup(Dot(DotParams(n=1000)), tile) is False  # the same job: its kernels are warm
    assert tasks.warmup(Dot(DotParams(n=2000, seed=5)), Tile(0, {"n": (0, 1000)})) is False  # the same small dot
    assert tasks.warmup(Dot(DotParams(n=1000, dtype="float64")), tile) is True  # another dtype: other kernels
    assert warmed == [(1000, {"n": (0, 500)}), (1000, {"n": (0, 500)})]
    # What the worker tells the client as a job finds it, most recent last.
    assert tasks.open_job(None) == [
        Dot(DotParams(n=1)).warm_key(tile),
        Dot(DotParams(n=1, dtype="float64")).warm_key(tile),
    ]


def test_a_worker_keeps_the_most_recent_keys():
    warmed = runtime.Warmed(limit=3)
    for key in "abcda":
        warmed.add(key)
    assert warmed.keys() == ["c", "d", "a"] and "b" not in warmed


def _matmul(**params: Any) -> Matmul:
    return Matmul(MatmulParams(**{"m": 4096, "n": 4096, "k": 4096, **params}))


def test_a_matmul_key_is_its_warm_up_product_and_kernels():
    tile = Tile(0, {"m": (0, 2048), "n": (0, 4096)})
    key = _matmul().warm_key(tile)
    assert _matmul(seed=3).warm_key(tile) == key  # other operands, the same product
    assert _matmul(k=8192).warm_key(tile) == key  # k past the warm-up's own: the same product
    assert _matmul(k=512).warm_key(tile) != key  # a shorter product: another kernel may be chosen
    assert _matmul().warm_key(Tile(1, {"m": (2048, 3072), "n": (0, 4096)})) != key  # another tile shape
    assert _matmul(dtype="float64").warm_key(tile) != key
    assert _matmul(precision="tf32").warm_key(tile) != key


def test_a_matmul_reading_files_or_writing_keeps_the_jobs_own_key(tmp_path):
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(a, np.ones((64, 32), np.float32))
    np.save(b, np.ones((32, 16), np.float32))
    tile = Tile(0, {"m": (0, 64), "n": (0, 16)})
    files = Matmul(MatmulParams(input={"a": str(a), "b": str(b)}))
    assert files.warm_key(tile) != _matmul(m=64, n=16, k=32).warm_key(tile)
    assert files.warm_key(tile).startswith("matmul|{")  # the job's params: its files' readers are its own
    written = _matmul(output=str(tmp_path / "c.npy"))
    assert written.warm_key(tile) != _matmul().warm_key(tile)


@pytest.mark.parametrize(
    "change, same",
    [
        ({"max_iter": 50}, True),  # the steps are an argument of the same kernels
        ({"xmin": -1.0, "ymax": 0.5}, True),  # another window
        ({"width": 20000, "height": 900}, True),  # wider than the warm-up's band: the same band
        ({"width": 1000}, False),  # a narrower band: its sum takes another reduction
        ({"dtype": "float64"}, False),
    ],
)
def test_a_mandelbrot_key_is_its_dtype_check_and_band_width(change, same):
    base = {"width": 16384, "height": 512}
    tile = Tile(0, {"rows": (0, 64)})
    key = Mandelbrot(MandelbrotParams(**base)).warm_key(tile)
    assert (Mandelbrot(MandelbrotParams(**{**base, **change})).warm_key(tile) == key) is same
    assert Mandelbrot(MandelbrotParams(**base), verify=False).warm_key(tile) != key  # no check's kernels
