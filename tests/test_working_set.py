"""Each workload's working-set estimate against what one of its tiles really allocates.

The plan promises that a task holds at most ``plan.working_set`` bytes on its device; the
tiles are sized by it. On a CPU the allocations are NumPy's, which tracemalloc sees; on a
GPU they are RMM's, counted by its statistics adaptor (the GPU tests print each figure,
for the record of a run on the GPU machine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mgpu.worker.device import Device, DeviceFacts
from mgpu.worker.tile import run_tile
from mgpu.workloads.base import Workload
from mgpu.workloads.dot import Dot, DotParams
from mgpu.workloads.mandelbrot import Mandelbrot, MandelbrotParams
from mgpu.workloads.matmul import Matmul, MatmulParams

# name -> (the workload, the tiling of its plan) on a CPU
CPU_CASES: dict[str, tuple[Callable[[], Workload], dict[str, int]]] = {
    "matmul-k-split": (lambda: Matmul(MatmulParams(m=2048, n=2048, k=2048)), {"m": 1024, "n": 1024, "k": 512}),
    "matmul-full-k": (lambda: Matmul(MatmulParams(m=2048, n=2048, k=1024)), {"m": 1024, "n": 2048}),
    "matmul-float64": (lambda: Matmul(MatmulParams(m=1024, n=1024, k=4096, dtype="float64")), {}),
    "dot": (lambda: Dot(DotParams(n=16_000_000)), {"n": 8_000_000}),
    "mandelbrot": (lambda: Mandelbrot(MandelbrotParams(width=2048, height=1024, max_iter=50)), {"rows": 256}),
}


def _cpu() -> tuple[Device, dict[str, DeviceFacts]]:
    facts = DeviceFacts("cpu", 0, "cpu", 8 << 30, 8 << 30, "host")
    return Device("cpu", np, facts), {"cpu-0": facts}


@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_a_cpu_tile_allocates_what_its_plan_estimates(name):
    import tracemalloc

    make, tiling = CPU_CASES[name]
    dev, devices = _cpu()
    workload = make()
    plan = workload.plan(devices, 4 << 30, tiling)
    tile = plan.tiles[0]
    run_tile(workload, dev, tile)  # once untimed: NumPy's and mgpu's caches are made
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        run_tile(workload, dev, tile)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # Never more than promised (the budget holds; the arrays' Python objects aside), and
    # not far more promised than used (the tiles are not made needlessly small).
    assert peak <= plan.working_set + (64 << 10) and plan.working_set <= 1.25 * peak, (plan.working_set, peak)


def test_the_random_generator_temporaries_are_bounded_whatever_the_block():
    import tracemalloc

    from mgpu.worker.kernels import random_block, random_scratch

    rows, cols = 2048, 3000  # 6M elements: a uint64 temporary of the block would be 48 MB
    tracemalloc.start()
    try:
        block = random_block(np, seed=1, operand=0, rows=(0, rows), cols=(0, cols), total_cols=cols, dtype="float32")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert block.nbytes <= peak <= block.nbytes + random_scratch(rows * cols)
    assert random_scratch(rows * cols) < 8 << 20


# -- on a GPU (run by `pytest -m gpu` on the GPU machine) -----------------------------------

GPU_CASES: dict[str, tuple[Callable[[], Workload], dict[str, int]]] = {
    "matmul-full-k": (lambda: Matmul(MatmulParams(m=8192, n=8192, k=8192)), {"m": 8192, "n": 8192}),
    "matmul-k-split": (lambda: Matmul(MatmulParams(m=8192, n=8192, k=8192)), {"m": 8192, "n": 8192, "k": 2048}),
    "matmul-float64": (lambda: Matmul(MatmulParams(m=8192, n=4096, k=8192, dtype="float64")), {}),
    "dot": (lambda: Dot(DotParams(n=1 << 28)), {"n": 1 << 28}),
    "mandelbrot": (lambda: Mandelbrot(MandelbrotParams(width=16384, height=4096, max_iter=100)), {"rows": 4096}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_a_gpu_tile_allocates_what_its_plan_estimates(name, capsys):
    cupy = pytest.importorskip("cupy")
    rmm = pytest.importorskip("rmm")
    from rmm.allocators.cupy import rmm_cupy_allocator

    from mgpu.worker.runtime import _cuda_device

    make, tiling = GPU_CASES[name]
    old_mr, old_alloc = rmm.mr.get_current_device_resource(), cupy.cuda.get_allocator()
    stats = rmm.mr.StatisticsResourceAdaptor(rmm.mr.CudaMemoryResource())
    try:
        rmm.mr.set_current_device_resource(stats)
        cupy.cuda.set_allocator(rmm_cupy_allocator)
        dev = _cuda_device()
        workload = make()
        plan = workload.plan({"gpu-0": dev.facts}, int(0.8 * dev.facts.memory), tiling)
        tile = plan.tiles[0]
        run_tile(workload, dev, tile)  # compiles the kernels, makes cuBLAS's handle
        dev.synchronize()
        dev.cache.clear()  # a fresh job's: its tile copies the axes to the device
        stats.push_counters()
        run_tile(workload, dev, tile)
        dev.synchronize()
        peak = _peak(stats.pop_counters())
    finally:
        cupy.cuda.set_allocator(old_alloc)
        rmm.mr.set_current_device_resource(old_mr)
    with capsys.disabled():
        print(
            f"\nworking set {name}: tile {plan.tile_shape}, estimate {plan.working_set / 2**20:.1f} MiB, "
            f"RMM peak {peak / 2**20:.1f} MiB, estimate / peak {plan.working_set / peak:.3f}"
        )
    assert abs(plan.working_set - peak) <= 0.10 * peak


def _peak(counts: Any) -> int:
    return int(counts["peak_bytes"] if isinstance(counts, dict) else counts.peak_bytes)
