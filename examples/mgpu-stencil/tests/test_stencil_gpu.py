"""workload: stencil on GPUs: the CUDA kernel is NumPy's step bit for bit, and jobs on one
and two GPUs give NumPy's sweep. Run on a GPU machine with ``pytest -m gpu``."""

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
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


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


def _job(tmp_path, devices, **params):
    out = tmp_path / "grid.npy"
    doc = {
        "workload": "stencil",
        "params": {"height": 1531, "width": 1203, "steps": 40, "seed": 2, "output": str(out), **params},
        "cluster": {"backend": "cuda", "devices": devices, "dashboard": None},
    }
    return run_job(validate_job(doc)), out


def test_one_gpu_several_bands_give_numpys_sweep(tmp_path):
    result, out = _job(tmp_path, [0], bands_per_device=3)
    assert result.status == "ok" and result.verify.passed and result.backend == "cuda"
    assert result.roofline is not None and "copy measured on one device alone" in result.roofline.basis
    np.testing.assert_array_equal(np.load(out), sweep(_grid(1531, 1203, seed=2), 40))


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_two_gpus_exchange_halo_rows_and_give_numpys_sweep(tmp_path):
    result, out = _job(tmp_path, [0, 1], bands_per_device=2, dtype="float64")
    assert result.status == "ok" and result.verify.passed
    assert sorted(d.id for d in result.per_device) == [0, 1]
    np.testing.assert_array_equal(np.load(out), sweep(_grid(1531, 1203, seed=2, dtype="float64"), 40))
