"""The cuBLASXt binding ``mgpu bench`` sets mgpu against: the row-major to column-major
argument mapping checked with NumPy, the library found by its mapping, nothing loaded at
import; and, on a GPU, a product checked against float64."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import gpu_count

from mgpu.bench import cublasxt


def _column_major_gemm(args, ops: dict[str, np.ndarray], c_size: int) -> np.ndarray:
    """What BLAS gemm('N', 'N', m, n, k, 1, A, lda, B, ldb, 0, C, ldc) does to raw buffers.

    Element (i, j) of a column-major matrix with leading dimension ld is buffer[i + j * ld].
    """
    first, second = ops[args.first].reshape(-1), ops[args.second].reshape(-1)
    a = first.reshape(args.k, args.lda).T[: args.m, :]  # m x k
    b = second.reshape(args.n, args.ldb).T[: args.k, :]  # k x n
    c = np.full(c_size, np.nan)
    c.reshape(args.n, args.ldc).T[: args.m, :] = a @ b
    return c


@pytest.mark.parametrize("m,k,n", [(3, 5, 7), (7, 5, 3), (4, 4, 4), (1, 9, 2)])
def test_gemm_args_compute_the_row_major_product(m, k, n):
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    args = cublasxt.gemm_args(a.shape, b.shape)
    c = _column_major_gemm(args, {"a": a, "b": b}, m * n)
    np.testing.assert_allclose(c.reshape(m, n), a @ b, rtol=1e-12)  # read back row-major


def test_gemm_args_swap_the_operands():
    args = cublasxt.gemm_args((3, 5), (5, 7))
    assert (args.m, args.n, args.k) == (7, 3, 5)
    assert (args.first, args.lda, args.second, args.ldb, args.ldc) == ("b", 7, "a", 5, 7)
    with pytest.raises(ValueError, match="columns must equal"):
        cublasxt.gemm_args((3, 5), (4, 7))
    with pytest.raises(ValueError, match="2-D"):
        cublasxt.gemm_args((3,), (3, 7))


def test_mapped_library_finds_libcublas_not_lt():
    maps = "\n".join(
        [
            "7f00-7f10 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6",
            "7f10-7f20 r-xp 00000000 08:01 2 /opt/py/site-packages/nvidia/cu13/lib/libcublasLt.so.13",
            "7f20-7f30 r-xp 00000000 08:01 3 /opt/py/site-packages/nvidia/cu13/lib/libcublas.so.13",
            "7f30-7f40 rw-p 00000000 00:00 0 ",
            "7f40-7f50 rw-p 00000000 00:00 0 [heap]",
        ]
    )
    assert cublasxt.mapped_library(maps) == "/opt/py/site-packages/nvidia/cu13/lib/libcublas.so.13"
    assert cublasxt.mapped_library(maps.replace("libcublas.so.13", "libfoo.so")) is None


def test_cublasxt_imports_without_loading_and_checks_operands():
    assert cublasxt._lib.cache_info().currsize == 0  # nothing opened at import
    err = cublasxt.CublasXtError("cublasXtSgemm", 7)
    assert err.status == 7 and "CUBLAS_STATUS_INVALID_VALUE" in str(err)
    if gpu_count() == 0 and __import__("ctypes.util").util.find_library("cublas") is None:
        with pytest.raises(OSError, match="libcublas not found"):
            cublasxt.xt_gemm(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), devices=(0,))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_xt_gemm_on_one_gpu(dtype, tol):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((1000, 3000)).astype(dtype), rng.standard_normal((3000, 2000)).astype(dtype)
    c, seconds = cublasxt.xt_gemm(a, b, devices=(0,), block_dim=512)
    assert c.shape == (1000, 2000) and c.dtype == dtype and seconds > 0
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(c - want).max() / np.abs(want).max() < tol
    with cublasxt.CublasXt((0,), 768) as handle:
        assert handle.block_dim == 768
