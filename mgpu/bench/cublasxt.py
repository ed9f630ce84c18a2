"""A small ctypes binding to cuBLASXt, cuBLAS's multi-GPU GEMM on host-resident operands.

    from mgpu.bench.cublasxt import xt_gemm
    c, seconds = xt_gemm(a, b, devices=(0, 1), block_dim=8192)   # c == a @ b

cuBLASXt lives in libcublas itself; this module opens the copy CuPy loaded (so both
agree on the CUDA version), found in ``/proc/self/maps`` after CuPy's cuBLAS module is
imported, or else by ``ctypes.util.find_library('cublas')``. Nothing is loaded at import:
the module imports on a machine with no GPU, and only :func:`gemm_args` (the row-major to
column-major mapping, pure) works there.

The prototypes bound here are those of ``cublasXt.h`` (CUDA 12 and 13): sizes and
leading dimensions are ``size_t``, the device list ``int*``, the block dimension ``int``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["CublasXt", "CublasXtError", "XtGemmArgs", "find_libcublas", "gemm_args", "mapped_library", "xt_gemm"]

CUBLAS_OP_N = 0  # cublasOperation_t
CUBLASXT_PINNING_ENABLED = 1  # cublasXtPinnedMemMode_t

# cublasStatus_t values (cublas_api.h).
_STATUS = {
    0: "CUBLAS_STATUS_SUCCESS",
    1: "CUBLAS_STATUS_NOT_INITIALIZED",
    3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE",
    8: "CUBLAS_STATUS_ARCH_MISMATCH",
    11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED",
    14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}


class CublasXtError(RuntimeError):
    """A cuBLASXt call returned a status other than CUBLAS_STATUS_SUCCESS."""

    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"{call} returned {status} ({_STATUS.get(status, 'unknown status')})")
        self.call = call
        self.status = status


class XtGemmArgs(NamedTuple):
    """A column-major ``gemm('N', 'N', m, n, k, first, lda, second, ldb, C, ldc)`` call.

    ``first`` and ``second`` name the NumPy operands (``"a"`` or ``"b"``) passed as
    cuBLAS's A and B.
    """

    m: int
    n: int
    k: int
    first: str
    lda: int
    second: str
    ldb: int
    ldc: int


def gemm_args(a_shape: Sequence[int], b_shape: Sequence[int]) -> XtGemmArgs:
    """The column-major call that computes row-major ``C = a @ b`` in place.

    A C-ordered (m, k) array read column-major with leading dimension k is Aᵀ (k x m),
    and likewise B is Bᵀ. Column-major gemm of Bᵀ (n x k) by Aᵀ (k x m) gives
    Bᵀ·Aᵀ = (A·B)ᵀ, n x m with leading dimension n: read row-major, exactly A·B.

    Raises
    ------
    ValueError
        If the shapes are not 2-D or a's columns differ from b's rows.
    """
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise ValueError(f"expected 2-D operands, got shapes {tuple(a_shape)} and {tuple(b_shape)}")
    (m, k), (k2, n) = a_shape, b_shape
    if k != k2:
        raise ValueError(f"a is {tuple(a_shape)} and b is {tuple(b_shape)}: a's columns must equal b's rows")
    return XtGemmArgs(m=n, n=m, k=k, first="b", lda=n, second="a", ldb=k, ldc=n)


def mapped_library(maps: str, stem: str = "libcublas.so") -> str | None:
    """The path of the first mapped file named ``stem*`` in ``/proc/<pid>/maps`` text.

    ``libcublasLt.so`` does not match ``libcublas.so``.
    """
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and os.path.basename(parts[5]).startswith(stem):
            return parts[5].strip()
    return None


def _maps() -> str:
    try:
        with open("/proc/self/maps") as fh:
            return fh.read()
    except OSError:
        return ""


def find_libcublas() -> str:
    """The libcublas CuPy loaded, or failing that the one the linker would find.

    Raises
    ------
    OSError
        If no libcublas can be found.
    """
    try:
        import cupy_backends.cuda.libs.cublas  # noqa: F401  (loading it loads libcublas)
    except ImportError:
        try:
            import cupy.cuda.cublas  # noqa: F401
        except ImportError:
            pass
    path = mapped_library(_maps())
    if path is None:
        try:  # a CuPy that opens cuBLAS on first use: make a handle
            import cupy

            cupy.cuda.device.get_cublas_handle()
            path = mapped_library(_maps())
        except Exception:
            pass
    if path is None:
        path = ctypes.util.find_library("cublas")
    if path is None:
        raise OSError("libcublas not found: CuPy did not load it and ctypes.util.find_library('cublas') found none")
    return path


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(find_libcublas())
    handle, size, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    protos: dict[str, list[Any]] = {
        "cublasXtCreate": [ctypes.POINTER(handle)],
        "cublasXtDestroy": [handle],
        "cublasXtDeviceSelect": [handle, c_int, ctypes.POINTER(c_int)],
        "cublasXtSetBlockDim": [handle, c_int],
        "cublasXtGetBlockDim": [handle, ctypes.POINTER(c_int)],
        "cublasXtSetPinningMemMode": [handle, c_int],
    }
    for name, real in (("cublasXtSgemm", ctypes.c_float), ("cublasXtDgemm", ctypes.c_double)):
        ptr = ctypes.POINTER(real)
        protos[name] = [
            handle,
            c_int,
            c_int,
            size,
            size,
            size,
            ptr,
            ctypes.c_void_p,
            size,
            ctypes.c_void_p,
            size,
            ptr,
            ctypes.c_void_p,
            size,
        ]
    for name, argtypes in protos.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = c_int
    return lib


def _check(call: str, status: int) -> None:
    if status != 0:
        raise CublasXtError(call, status)


class CublasXt:
    """A cuBLASXt handle on ``devices`` with square tiles of ``block_dim``.

    Parameters
    ----------
    devices
        CUDA device ordinals (as this process sees them) that share the work.
    block_dim
        The side of cuBLASXt's square tiles (its default is 1024).
    pinning
        Let cuBLASXt page-lock unpinned host operands itself (CUBLASXT_PINNING_ENABLED).

    Raises
    ------
    CublasXtError
        If creating or setting up the handle fails.
    """

    def __init__(self, devices: Sequence[int] = (0, 1), block_dim: int = 8192, *, pinning: bool = False) -> None:
        self._lib = _lib()
        self._handle = ctypes.c_void_p()
        _check("cublasXtCreate", self._lib.cublasXtCreate(ctypes.byref(self._handle)))
        try:
            ids = (ctypes.c_int * len(devices))(*devices)
            _check("cublasXtDeviceSelect", self._lib.cublasXtDeviceSelect(self._handle, len(devices), ids))
            _check("cublasXtSetBlockDim", self._lib.cublasXtSetBlockDim(self._handle, int(block_dim)))
            if pinning:
                _check(
                    "cublasXtSetPinningMemMode",
                    self._lib.cublasXtSetPinningMemMode(self._handle, CUBLASXT_PINNING_ENABLED),
                )
        except Exception:
            self.close()
            raise
        self.devices = tuple(devices)

    @property
    def block_dim(self) -> int:
        """The block dimension the handle reports."""
        value = ctypes.c_int()
        _check("cublasXtGetBlockDim", self._lib.cublasXtGetBlockDim(self._handle, ctypes.byref(value)))
        return value.value

    def gemm(self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, float]:
        """``a @ b`` for C-ordered float32 or float64 host arrays; returns (C, seconds of the call).

        The call returns once C is complete in host memory (cuBLASXt blocks for host
        operands), so the wall clock around it is the whole product, transfers included.
        Pass ``out`` (already written once, so its pages exist) to keep page faults out of
        the time.

        Raises
        ------
        ValueError
            On operands of other dtypes, layouts or shapes.
        CublasXtError
            If the gemm call fails.
        """
        if a.dtype != b.dtype or a.dtype not in (np.float32, np.float64):
            raise ValueError(f"expected two float32 or two float64 arrays, got {a.dtype} and {b.dtype}")
        if not (a.flags.c_contiguous and b.flags.c_contiguous):
            raise ValueError("a and b must be C-contiguous")
        args = gemm_args(a.shape, b.shape)
        shape = (a.shape[0], b.shape[1])
        if out is None:
            out = np.empty(shape, dtype=a.dtype)
        elif out.shape != shape or out.dtype != a.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {a.dtype} array of shape {shape}")
        real = ctypes.c_float if a.dtype == np.float32 else ctypes.c_double
        alpha, beta = real(1.0), real(0.0)
        ops = {"a": a, "b": b}
        name = "cublasXtSgemm" if a.dtype == np.float32 else "cublasXtDgemm"
        fn = getattr(self._lib, name)
        start = time.perf_counter()
        status = fn(
            self._handle,
            CUBLAS_OP_N,
            CUBLAS_OP_N,
            args.m,
            args.n,
            args.k,
            ctypes.byref(alpha),
            ops[args.first].ctypes.data,
            args.lda,
            ops[args.second].ctypes.data,
            args.ldb,
            ctypes.byref(beta),
            out.ctypes.data,
            args.ldc,
        )
        seconds = time.perf_counter() - start
        _check(name, status)
        return out, seconds

    def close(self) -> None:
        """Destroy the handle (once)."""
        if self._handle:
            handle, self._handle = self._handle, ctypes.c_void_p()
            _check("cublasXtDestroy", self._lib.cublasXtDestroy(handle))

    def __enter__(self) -> CublasXt:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def xt_gemm(
    a: np.ndarray, b: np.ndarray, *, devices: Sequence[int] = (0, 1), block_dim: int = 8192, pinning: bool = False
) -> tuple[np.ndarray, float]:
    """``a @ b`` by cuBLASXt on ``devices``; returns (C, seconds of the gemm call alone).

    A new handle is made and destroyed around the call (outside the time); use
    :class:`CublasXt` to warm a handle up and reuse it.
    """
    with CublasXt(devices, block_dim, pinning=pinning) as xt:
        return xt.gemm(a, b)
