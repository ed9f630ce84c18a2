"""The array kernels mgpu's tasks call, each with one meaning on NumPy and on CuPy.

Every function takes ``xp`` (numpy or cupy). The NumPy branch is the definition; the
CuPy branch is a fused kernel that computes bit-for-bit the same values (the GPU tests
check this), so a tile computed on either backend can be checked against the other.
CuPy is imported lazily: the client and the planner never need it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = [
    "BLOCK_SUM_SOURCE",
    "RANDOM_LAUNCH",
    "RANDOM_SOURCE",
    "RANDOM_C_TYPES",
    "gemm_into",
    "is_cupy",
    "matvec_f64",
    "multiprocessors",
    "random_block",
    "random_block_matvec",
    "stream_key",
    "to_host",
]

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

# Random bits per value: enough to fill the mantissa, few enough to be exact in the dtype.
_RANDOM_BITS = {np.dtype(np.float16): 11, np.dtype(np.float32): 24, np.dtype(np.float64): 53}


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def stream_key(seed: int, operand: int) -> int:
    """The 64-bit key of one operand's random stream (A=0, B=1, the check vector=2, ...)."""
    return _mix64((seed * _GAMMA + operand + 1) & _M64)


def is_cupy(xp: Any) -> bool:
    """Whether ``xp`` is CuPy (else it is NumPy)."""
    return xp.__name__ == "cupy"


def multiprocessors() -> int:
    """The current GPU's multiprocessor count, read once a device: CuPy's
    ``Device().attributes`` reads every attribute the device has at each call, host time
    that a kernel launched right after it waits out on an idle GPU (for the dot's 8 tiles
    taking turns at an H100, 0.28 ms of its 7.7 ms of making x and y)."""
    import cupy

    return _multiprocessors(cupy.cuda.runtime.getDevice())


@functools.cache
def _multiprocessors(device: int) -> int:
    import cupy

    runtime = cupy.cuda.runtime
    return int(runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device))


def to_host(xp: Any, arr: Any) -> np.ndarray:
    """``arr`` as a NumPy array; on a GPU, after a wait for the current stream.

    The wait comes first on purpose: CuPy's copy into pageable memory otherwise waits for
    the GPU inside the copy, and while it does, the CUDA calls of the process's other
    threads wait too (on an H200, Mandelbrot bands were then queued one at a time, each
    behind the count of the one before).
    """
    if not is_cupy(xp):
        return np.asarray(arr)
    xp.cuda.get_current_stream().synchronize()
    return arr.get()


def random_block(
    xp: Any,
    *,
    seed: int,
    operand: int,
    rows: tuple[int, int],
    cols: tuple[int, int],
    total_cols: int,
    dtype: Any,
) -> Any:
    """Rows ``rows`` x columns ``cols`` of a random operand, uniform in [-1, 1).

    Element (i, j) is ``splitmix64(key + (i * total_cols + j) * gamma)``'s top bits scaled
    to [-1, 1): a pure function of (seed, operand, i, j), so the same element comes out
    under any tiling, on any worker, on CPU or GPU. The values are exact in ``dtype``.
    """
    dtype = np.dtype(dtype)
    bits = _RANDOM_BITS[dtype]
    key = stream_key(seed, operand)
    (r0, r1), (c0, c1) = rows, cols
    h, w = r1 - r0, c1 - c0
    scale = 2.0 ** (1 - bits)
    if is_cupy(xp):
        out = xp.empty((h, w), dtype=dtype)
        _cupy_random_fill(out, key, r0 * total_cols + c0, total_cols)
        return out
    out = np.empty((h, w), dtype=dtype)
    # In pieces of at most RANDOM_PIECE elements: the hash's uint64 temporaries (8 bytes an
    # element each) stay a few MB whatever the block's size (see random_scratch).
    rows_per = max(1, RANDOM_PIECE // max(1, w))
    cols_per = min(w, RANDOM_PIECE)
    for a in range(0, h, rows_per):
        for b in range(0, w, cols_per):
            rows_here = min(h, a + rows_per) - a
            cols_here = min(w, b + cols_per) - b
            g = np.arange(r0 + a, r0 + a + rows_here, dtype=np.uint64)[:, None] * np.uint64(total_cols)
            g = g + np.arange(c0 + b, c0 + b + cols_here, dtype=np.uint64)[None, :]
            out[a : a + rows_here, b : b + cols_here] = _splitmix_values(g, key, bits, scale)
    return out


# Elements of a random block hashed at once on a CPU.
RANDOM_PIECE = 1 << 18


def random_scratch(elements: int) -> int:
    """Bytes a CPU's :func:`random_block` of ``elements`` holds beyond the block: the
    uint64 hash, one uint64 temporary and the float64 values of a piece (8 bytes an
    element each). A GPU's kernel writes the block directly."""
    return 3 * 8 * min(elements, RANDOM_PIECE)


def _splitmix_values(g: np.ndarray, key: int, bits: int, scale: float) -> np.ndarray:
    """Values in [-1, 1) (float64) of the uint64 element indices ``g`` (consumed)."""
    z = g
    z *= np.uint64(_GAMMA)
    z += np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    z >>= np.uint64(64 - bits)
    values = z.astype(np.float64)
    values *= scale
    values -= 1.0
    return values


# A launch covers at most this many elements of a row (a multiple of every vector width),
# so every index inside a kernel is a 32-bit number: CuPy's elementwise kernels switch to
# 64-bit index math past 2^31 elements, and a 2e9-element operand was written at 843 GB/s.
RANDOM_LAUNCH = 1 << 30

# Shared by the kernels' modules (and the dot workload's): the block-wide float64 sum their
# reductions end with.
BLOCK_SUM_SOURCE = r"""
// Sum a value over the block; the total is valid in thread 0. Ends with a barrier so a
// block may call it again (the shared scratch is reused).
__device__ __forceinline__ double block_sum(double acc) {
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    __shared__ double warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    }
    __syncthreads();
    return acc;
}
"""

# VEC neighbours of a row, loaded or stored at once (one 16-byte access).
PACK_SOURCE = r"""
template<typename T, int VEC> struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };
"""

# The random operands' values (the dot workload makes its pairs with them too) and their rows.
RANDOM_SOURCE = (
    PACK_SOURCE
    + r"""
#include <cuda_fp16.h>
typedef unsigned long long u64;
#define GAMMA 0x9E3779B97F4A7C15ULL

// splitmix64's mix of z, shifted down to its top BITS bits. The last step, z ^= z >> 31,
// cannot change the top 33 bits, so a value that needs no more of them skips it.
template<int BITS> __device__ __forceinline__ u64 top_bits(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    if (BITS > 33) z ^= z >> 31;
    return z >> (64 - BITS);
}

// top * 2^(1-BITS) - 1, exact in the dtype (as NumPy's float64 route is, then rounded).
template<typename T> struct Value;
template<> struct Value<float> {
    static constexpr int BITS = 24;
    static __device__ __forceinline__ float of(u64 z) {
        return (float)(unsigned)top_bits<24>(z) * 0x1p-23f - 1.0f;
    }
};
template<> struct Value<double> {
    static constexpr int BITS = 53;
    static __device__ __forceinline__ double of(u64 z) {
        return (double)top_bits<53>(z) * 0x1p-52 - 1.0;
    }
};
template<> struct Value<__half> {
    static constexpr int BITS = 11;
    static __device__ __forceinline__ __half of(u64 z) {
        return __float2half_rn((float)(unsigned)top_bits<11>(z) * 0x1p-10f - 1.0f);
    }
};

// Rows of a random operand's block: element (r, c) of out (row stride ld) is the operand's
// element number g = g_first + r * total_cols + c. Each thread makes VEC neighbours of a
// row, stepping z by GAMMA between them, and stores them at once (VEC > 1 only where
// every row starts on a vector boundary).
template<typename T, int VEC>
__global__ void random_rows(T* __restrict__ out, u64 ld, u64 key, u64 g_first, u64 total_cols,
                            unsigned width, unsigned height) {
    const unsigned step = gridDim.x * blockDim.x * VEC;
    const u64 z_step = (u64)step * GAMMA;
    for (unsigned r = blockIdx.y; r < height; r += gridDim.y) {
        T* row = out + (u64)r * ld;
        unsigned c = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
        u64 z = key + (g_first + (u64)r * total_cols + c) * GAMMA;
        for (; c + VEC <= width; c += step, z += z_step) {
            Pack<T, VEC> p;
#pragma unroll
            for (int k = 0; k < VEC; ++k) p.v[k] = Value<T>::of(z + (u64)k * GAMMA);
            *reinterpret_cast<Pack<T, VEC>*>(row + c) = p;
        }
        for (unsigned k = 0; c + k < width && k < VEC; ++k) row[c + k] = Value<T>::of(z + (u64)k * GAMMA);
    }
}
"""
)

RANDOM_C_TYPES = {"float16": ("__half", 8), "float32": ("float", 4), "float64": ("double", 2)}


@functools.cache
def _cupy_random_module() -> Any:
    import cupy

    names = [f"random_rows<{c}, {v}>" for c, v in RANDOM_C_TYPES.values()]
    names += [f"random_rows<{c}, 1>" for c, _ in RANDOM_C_TYPES.values()]
    return cupy.RawModule(code=BLOCK_SUM_SOURCE + RANDOM_SOURCE, options=("-std=c++17",), name_expressions=names)


def _cupy_random_fill(out: Any, key: int, g_first: int, total_cols: int) -> None:
    """Fill the C-contiguous 2-D ``out`` with a random operand's block whose element (0, 0)
    is the operand's element number ``g_first`` (row length ``total_cols``)."""
    h, w = out.shape
    if out.size == 0:
        return
    if w == total_cols or h == 1:  # contiguous in the operand: one row of h * w elements
        h, w = 1, h * w
    c_type, vec = RANDOM_C_TYPES[str(out.dtype)]
    if (h > 1 and w % vec) or out.data.ptr % 16:  # rows that do not start on a vector boundary
        vec = 1
    kernel = _cupy_random_module().get_function(f"random_rows<{c_type}, {vec}>")
    threads = 256
    sms = multiprocessors()
    flat = out.reshape(-1)
    # Column pieces of at most RANDOM_LAUNCH elements, so every index in the kernel fits
    # 32 bits; at most 65535 rows a launch (the grid's y limit), the kernel strides over more.
    for c0 in range(0, w, RANDOM_LAUNCH):
        width = min(RANDOM_LAUNCH, w - c0)
        rows = min(h, 65535)
        # About 16 blocks of 256 threads a multiprocessor; each thread makes several vectors.
        blocks_x = max(1, min(-(-width // (vec * threads)), -(-sms * 16 // rows)))
        kernel(
            (blocks_x, rows),
            (threads,),
            (
                flat[c0:],
                np.uint64(w),
                np.uint64(key),
                np.uint64(g_first + c0),
                np.uint64(total_cols),
                np.uint32(width),
                np.uint32(h),
            ),
        )


_MATVEC_SOURCE = r"""
// out[r] = sum_c m[r, c] * v[c] in float64 for a C-ordered m: one block per row at a
// time, reading m once (a float64 copy of m would cost three times the traffic). VEC
// elements a load where every row starts on a 16-byte boundary, four loads in flight a
// thread: on an H100, float32 rows of 32768 read at 2.27-2.75 TB/s, one element a load
// at 1.83-2.22.
template<typename T, int VEC>
__global__ void matvec_rows_f64(const T* __restrict__ m, const double* __restrict__ v,
                                long long rows, long long cols, double* __restrict__ out) {
    const long long packs = cols / VEC;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = m + r * cols;
        const Pack<T, VEC>* packed = reinterpret_cast<const Pack<T, VEC>*>(row);
        double acc = 0.0;
#pragma unroll 4
        for (long long i = threadIdx.x; i < packs; i += blockDim.x) {
            const Pack<T, VEC> p = packed[i];
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc += (double)p.v[k] * v[i * VEC + k];
        }
        for (long long c = packs * VEC + threadIdx.x; c < cols; c += blockDim.x) acc += (double)row[c] * v[c];
        acc = block_sum(acc);
        if (threadIdx.x == 0) out[r] = acc;
    }
}
"""

_RANDOM_MATVEC_SOURCE = r"""
// Rows of a random operand's block, C-ordered with no gap (element (r, c) is the operand's
// element number g_first + r * total_cols + c, as random_rows makes it), and each row's sum
// of value * v[c] in float64, as matvec_rows_f64 sums the rows once made: the same threads
// take the same elements in the same order, so the sums are bit for bit those.
template<typename T, int VEC>
__global__ void random_rows_matvec_f64(T* __restrict__ out, u64 key, u64 g_first, u64 total_cols,
                                       long long rows, long long cols, const double* __restrict__ v,
                                       double* __restrict__ mv) {
    const long long packs = cols / VEC;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        T* row = out + r * cols;
        const u64 z_row = key + (g_first + (u64)r * total_cols) * GAMMA;
        double acc = 0.0;
        for (long long i = threadIdx.x; i < packs; i += blockDim.x) {
            Pack<T, VEC> p;
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                p.v[k] = Value<T>::of(z_row + (u64)(i * VEC + k) * GAMMA);
                acc += (double)p.v[k] * v[i * VEC + k];
            }
            *reinterpret_cast<Pack<T, VEC>*>(row + i * VEC) = p;
        }
        for (long long c = packs * VEC + threadIdx.x; c < cols; c += blockDim.x) {
            row[c] = Value<T>::of(z_row + (u64)c * GAMMA);
            acc += (double)row[c] * v[c];
        }
        acc = block_sum(acc);
        if (threadIdx.x == 0) mv[r] = acc;
    }
}
"""

_C_TYPES = {"float16": "__half", "float32": "float", "float64": "double"}
# Elements a load: 16 bytes of float32 or float64; float16 one at a time (in 16-byte loads,
# 8192 x 32768 read at 0.91 TB/s on an H100, one at a time at 1.17).
_MATVEC_VEC = {"float16": 1, "float32": 4, "float64": 2}
_MATVEC = {
    (name, vec): f"matvec_rows_f64<{c}, {vec}>" for name, c in _C_TYPES.items() for vec in {1, _MATVEC_VEC[name]}
}


_RANDOM_MATVEC = {key: name.replace("matvec_rows_f64", "random_rows_matvec_f64") for key, name in _MATVEC.items()}


@functools.cache
def _cupy_matvec_module() -> Any:
    import cupy

    return cupy.RawModule(
        code="#include <cuda_fp16.h>\n" + BLOCK_SUM_SOURCE + PACK_SOURCE + _MATVEC_SOURCE,
        options=("-std=c++17",),
        name_expressions=[*_MATVEC.values()],
    )


@functools.cache
def _cupy_random_matvec_module() -> Any:
    import cupy

    return cupy.RawModule(
        code=BLOCK_SUM_SOURCE + RANDOM_SOURCE + _RANDOM_MATVEC_SOURCE,
        options=("-std=c++17",),
        name_expressions=[*_RANDOM_MATVEC.values()],
    )


def random_block_matvec(
    xp: Any,
    *,
    seed: int,
    operand: int,
    rows: tuple[int, int],
    cols: tuple[int, int],
    total_cols: int,
    dtype: Any,
    v: Any,
) -> tuple[Any, Any]:
    """``random_block(...)`` and ``matvec_f64(xp, block, v)``, bit for bit.

    On a GPU one kernel makes the rows and sums each against ``v`` as it goes: the check's
    product needs no second pass over the block (a 32768² float32 B read again took 1.4 ms
    of an H100's 0.19 s TF32 tile, outside its products).
    """
    if not is_cupy(xp):
        block = random_block(xp, seed=seed, operand=operand, rows=rows, cols=cols, total_cols=total_cols, dtype=dtype)
        return block, matvec_f64(xp, block, v)
    import cupy

    dtype = np.dtype(dtype)
    (r0, r1), (c0, c1) = rows, cols
    h, w = r1 - r0, c1 - c0
    block = cupy.empty((h, w), dtype=dtype)
    sums = cupy.empty(h, dtype=cupy.float64)
    if h and w:
        v = cupy.ascontiguousarray(v, dtype=cupy.float64)
        vec = _MATVEC_VEC[dtype.name] if w % _MATVEC_VEC[dtype.name] == 0 else 1  # as matvec_f64 reads them
        kernel = _cupy_random_matvec_module().get_function(_RANDOM_MATVEC[dtype.name, vec])
        key = stream_key(seed, operand)
        args = (block, np.uint64(key), np.uint64(r0 * total_cols + c0), np.uint64(total_cols))
        kernel((min(h, multiprocessors() * 16),), (256,), (*args, np.int64(h), np.int64(w), v, sums))
    elif h:
        sums[:] = 0
    return block, sums


# Bytes of the float64 row pieces matvec_f64 casts at once on a CPU.
MATVEC_SCRATCH = 16 << 20


def matvec_scratch(rows: int, cols: int) -> int:
    """Bytes a CPU's :func:`matvec_f64` of a ``rows`` x ``cols`` matrix holds beyond it
    and its result: the float64 copy of a piece of rows. A GPU's kernel makes none."""
    return 8 * cols * min(rows, max(1, MATVEC_SCRATCH // (8 * max(1, cols))))


def matvec_f64(xp: Any, m: Any, v: Any) -> Any:
    """``m @ v`` with the products and sums in float64, for a 2-D ``m`` of any float dtype.

    On the GPU one kernel reads ``m`` once; on the CPU ``m`` is cast in row pieces so the
    float64 copy stays small.
    """
    if is_cupy(xp):
        import cupy

        m = cupy.ascontiguousarray(m)
        v = cupy.ascontiguousarray(v, dtype=cupy.float64)
        rows, cols = m.shape
        out = cupy.empty(rows, dtype=cupy.float64)
        if rows and cols:
            blocks = min(rows, multiprocessors() * 16)
            vec = _MATVEC_VEC[str(m.dtype)]
            if cols % vec or m.data.ptr % 16:  # rows that do not all start on a 16-byte boundary
                vec = 1
            kernel = _cupy_matvec_module().get_function(_MATVEC[str(m.dtype), vec])
            kernel((blocks,), (256,), (m, v, np.int64(rows), np.int64(cols), out))
        elif rows:
            out[:] = 0
        return out
    piece = max(1, MATVEC_SCRATCH // (8 * max(1, m.shape[1])))
    if m.shape[0] <= piece:
        return m.astype(np.float64, copy=False) @ v
    out = np.empty(m.shape[0], dtype=np.float64)
    for i in range(0, m.shape[0], piece):
        out[i : i + piece] = m[i : i + piece].astype(np.float64) @ v
    return out


def gemm_into(xp: Any, a: Any, b: Any, c: Any, *, accumulate: bool = False) -> None:
    """``c = a @ b`` (``c += a @ b`` with ``accumulate``) in place, for 2-D float32 or
    float64 views whose rows are contiguous, at any row stride.

    On CuPy one cuBLAS call with the views' leading dimensions: ``cupy.cublas.gemm`` copies
    an operand that is not contiguous as a whole, so a piece of a larger array would be
    copied first.

    Raises
    ------
    ValueError
        If a view's rows are not contiguous.
    """
    if not is_cupy(xp):
        if accumulate:
            c += a @ b
        else:
            np.matmul(a, b, out=c)
        return
    import cupy
    from cupy_backends.cuda.libs import cublas

    dtype = np.dtype(a.dtype)
    size = dtype.itemsize
    if any(x.ndim != 2 or x.dtype != dtype or x.strides[1] != size or x.strides[0] % size for x in (a, b, c)):
        raise ValueError(f"gemm_into: 2-D {dtype} views with contiguous rows are needed")
    call = cublas.dgemm if dtype == np.float64 else cublas.sgemm
    (m, k), n = a.shape, b.shape[1]
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    one, beta = np.array(1.0, dtype), np.array(1.0 if accumulate else 0.0, dtype)
    # Row-major C = A B is column-major C^T = B^T A^T: B goes first.
    call(
        handle,
        cublas.CUBLAS_OP_N,
        cublas.CUBLAS_OP_N,
        n,
        m,
        k,
        one.ctypes.data,
        b.data.ptr,
        b.strides[0] // size,
        a.data.ptr,
        a.strides[0] // size,
        beta.ctypes.data,
        c.data.ptr,
        c.strides[0] // size,
    )
