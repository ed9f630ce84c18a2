"""The estimate: what it models (rates measured as the tiles run, every pass a tile makes),
where it is recorded (the Result, the report's rows), and what the client holds meanwhile."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from mgpu.device import DeviceFacts
from mgpu.workloads.dot import Dot, DotParams
from mgpu.workloads.mandelbrot import Mandelbrot, MandelbrotParams
from mgpu.workloads.mandelbrot import workload as mandelbrot_workload
from mgpu.workloads.mandelbrot.kernels import MANDELBROT_PIECE, mandelbrot_axes, mandelbrot_counts


def _devices(n: int, backend: str = "cpu") -> dict[str, DeviceFacts]:
    memory = 12 << 30
    return {f"w-{i}": DeviceFacts(backend, i, backend, memory, memory, "host") for i in range(n)}


def test_a_cpu_dot_is_estimated_with_its_check_pass():
    dot = Dot(DotParams(n=10**8))
    rates = {"copy": 40.0, "random": 0.05, "check": 0.5}
    cpu, gpu = dot.plan(_devices(2), 6 << 30, {}), dot.plan(_devices(2, "cuda"), 6 << 30, {})
    unchecked = Dot(DotParams(n=10**8), verify=False).expected_seconds(cpu, rates, 2)
    checked = dot.expected_seconds(cpu, rates, 2)
    assert unchecked is not None and checked is not None
    assert checked - unchecked == pytest.approx(10**8 / 0.5e9 / 2)  # one float64 pass over x and y
    assert dot.expected_seconds(gpu, rates, 2) == pytest.approx(unchecked)  # a GPU's check is in the making


def test_the_cpu_mandelbrot_ceiling_is_measured_over_a_whole_piece():
    side, _ = mandelbrot_workload._CEILING_SIZE["cpu"]
    assert side * side >= MANDELBROT_PIECE  # a band's pieces: the allocations the rate must include


def test_the_mandelbrot_reference_is_the_sampled_counts_and_holds_only_the_samples():
    small = Mandelbrot(MandelbrotParams(width=700, height=300, max_iter=60))
    plan = small.plan(_devices(2), 1 << 30, {"rows": 37})
    p = small.params
    x, y = mandelbrot_axes(
        width=p.width, height=p.height, bounds=(p.xmin, p.xmax, p.ymin, p.ymax), rows=(0, p.height), dtype=p.dtype
    )
    whole = mandelbrot_counts(np, x, y, p.max_iter)
    reference = small.reference(plan)
    for tile in plan.tiles:
        rows, step = mandelbrot_workload._sample(tile, p.width)
        np.testing.assert_array_equal(reference[tile.index], whole[rows, ::step])
    # 10^9 rows in 1000 bands: the image's axes alone would be 12 GB; the samples are 2 x 512 a band.
    tall = Mandelbrot(MandelbrotParams(width=100_000, height=10**9, max_iter=2))
    plan = tall.plan(_devices(2), 1 << 40, {"rows": 10**6}, spill=True)
    tracemalloc.start()
    reference = tall.reference(plan)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(reference) == 1000 and peak < 64 << 20, peak
