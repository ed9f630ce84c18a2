"""workload: stencil on GPUs: the CUDA kernel is NumPy's step bit for bit, and jobs on one
GPU and on two workers (two GPUs, or two workers sharing one) give NumPy's sweep. Run on a
GPU machine with ``pytest -m gpu``."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
pytest.importorskip("dask_cuda")

from mgpu_stencil import jacobi_step, sweep  # noqa: E402
from mgpu_stencil.kernels import _MAX_GRID_Y, CHUNK  # noqa: E402

from mgpu.client.run import run_job  # noqa: E402
from mgpu.spec import validate_job  # noqa: E402
from mgpu.worker.kernels import random_block  # noqa: E402


def _gpus() -> int:
    from mgpu.gpus import cuda_count

    return cuda_count()


def _workers(n: int) -> dict:
    """n GPU workers: one on each of n GPUs where there are, else n sharing GPU 0."""
    return {"devices": list(range(n))} if _gpus() >= n else {"devices": [0], "workers_per_device": n}


if _gpus() == 0:
    pytest.skip("no CUDA GPU visible", allow_module_level=True)


def _grid(height: int, width: int, seed: int, dtype: str = "float32") -> np.ndarray:
    return random_block(np, seed=seed, operand=0, rows=(0, height), cols=(0, width), total_cols=width, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "first,height,rows",
    # Bands at the grid's top and bottom rows, inside it, and longer than one run of rows.
    [(0, 40, 9), (7, 60, 9), (30, 39, 9), (0, 39, 9), (0, CHUNK + 5, CHUNK + 5), (3, 100, CHUNK + 5)],
)
def test_the_kernel_is_numpys_step_bit_for_bit(dtype, first, height, rows):
    width = 70001  # wider than one block row of threads
    u = _grid(rows + 2, width, seed=first, dtype=dtype)
    want = np.zeros_like(u)
    jacobi_step(np, u, want, first, height)
    got = cupy.zeros_like(cupy.asarray(u))
    jacobi_step(cupy, cupy.asarray(u), got, first, height)
    np.testing.assert_array_equal(cupy.asnumpy(got)[1:-1], want[1:-1])


def test_a_band_taller_than_the_grid_of_blocks():
    # More runs of rows than gridDim.y holds: the kernel's loop over runs covers the rest,
    # and the last run is shorter than the others and than the unrolled rows.
    rows = _MAX_GRID_Y * CHUNK + CHUNK + 3
    u = _grid(rows + 2, 33, seed=1)
    want = np.zeros_like(u)
    jacobi_step(np, u, want, 5, rows + 10)
    got = cupy.zeros_like(cupy.asarray(u))
    jacobi_step(cupy, cupy.asarray(u), got, 5, rows + 10)
    np.testing.assert_array_equal(cupy.asnumpy(got)[1:-1], want[1:-1])


def _job(tmp_path, cluster, **params):
    out = tmp_path / "grid.npy"
    doc = {
        "workload": "stencil",
        "params": {"height": 1531, "width": 1203, "steps": 40, "seed": 2, "output": str(out), **params},
        "cluster": {"backend": "cuda", "dashboard": None, **cluster},
    }
    return run_job(validate_job(doc)), out


@pytest.mark.parametrize(
    "bands,depth",
    # Bands of 510 rows, 32 sweeps then 8; bands of 218 rows, six steps of 6 sweeps then 4.
    [(3, "auto"), (7, 6)],
)
def test_one_gpu_several_bands_give_numpys_sweep(tmp_path, bands, depth):
    result, out = _job(tmp_path, {"devices": [0]}, bands_per_device=bands, sweeps_per_exchange=depth)
    assert result.status == "ok" and result.verify.passed and result.backend == "cuda"
    assert result.roofline is not None and "copy measured on one device alone" in result.roofline.basis
    np.testing.assert_array_equal(np.load(out), sweep(_grid(1531, 1203, seed=2), 40))


def test_two_workers_exchange_halo_rows_and_give_numpys_sweep(tmp_path):
    # Halos 5 rows deep: 8 steps of 5 sweeps, the first 7 sending their neighbours 5 rows.
    result, out = _job(tmp_path, _workers(2), bands_per_device=2, dtype="float64", sweeps_per_exchange=5)
    assert result.status == "ok" and result.verify.passed
    assert len(result.per_worker) == 2 and all(w.tiles == 2 for w in result.per_worker)
    np.testing.assert_array_equal(np.load(out), sweep(_grid(1531, 1203, seed=2, dtype="float64"), 40))
    if _gpus() < 2:
        # Both workers on one GPU: one device, and the halo rows between them went by CUDA
        # IPC within it, five float64 rows of the grid per copy, one copy each way per
        # exchange (none after the last step), never through the host.
        assert [d["workers"] for d in result.devices] == [2]
        for w in result.per_worker:
            assert w.copies_same_device == 7 and w.bytes_same_device == w.bytes_d2d == 7 * 5 * 1203 * 8
    else:
        assert sorted(d.id for d in result.per_device) == [0, 1]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bands_saved_to_host_memory_and_restored_on_the_gpu_step_on_to_numpys_sweep(tmp_path, dtype):
    # The state goes device -> host at the save and host -> device at the restore; the
    # restore may come on a CPU worker too (a GPU band resumed where no GPU is left).
    from test_stencil import resumed_sweep

    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.worker.runtime import _cuda_device

    gpu = _cuda_device()
    cpu = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    grid = _grid(301, 257, seed=8, dtype=dtype)
    want = sweep(grid, 11)
    np.testing.assert_array_equal(resumed_sweep(tmp_path, gpu, grid, 11, 5), want)
    np.testing.assert_array_equal(resumed_sweep(tmp_path, gpu, grid, 11, 5, other=cpu), want)
    # Halos 4 rows deep: steps of 4, 4 and 3 sweeps, saved after the second.
    np.testing.assert_array_equal(resumed_sweep(tmp_path, gpu, grid, 11, 2, depth=4), want)
    np.testing.assert_array_equal(resumed_sweep(tmp_path, gpu, grid, 11, 2, other=cpu, depth=4), want)
