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
    "dot_check",
    "dot_f64",
    "is_cupy",
    "matvec_f64",
    "random_block",
    "random_pair_with_sums",
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
_RANDOM_LAUNCH = 1 << 30

# Shared by the random and dot modules: the block-wide float64 sum their reductions end with.
_BLOCK_SUM_SOURCE = r"""
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

_RANDOM_SOURCE = r"""
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

template<typename T, int VEC> struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };

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


// Elements g_first .. g_first + n of two random vectors (keys kx, ky) into x and y, and,
// from the values as they are made (not read back), sum(x*y) and sum|x*y| in float64:
// partial[2b], partial[2b+1] for block b. A dot of x and y read from memory is checked
// against these sums, so the check costs no pass over memory of its own.
template<typename T, int VEC>
__global__ void random_pair_sums(T* __restrict__ x, T* __restrict__ y, u64 kx, u64 ky, u64 g_first,
                                 unsigned n, double* __restrict__ partial) {
    const unsigned step = gridDim.x * blockDim.x * VEC;
    const u64 z_step = (u64)step * GAMMA;
    unsigned i = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    u64 zo = (g_first + i) * GAMMA;
    double s = 0.0, a = 0.0;
    for (; i + VEC <= n; i += step, zo += z_step) {
        Pack<T, VEC> px, py;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            px.v[k] = Value<T>::of(kx + zo + (u64)k * GAMMA);
            py.v[k] = Value<T>::of(ky + zo + (u64)k * GAMMA);
            const double p = (double)px.v[k] * (double)py.v[k];
            s += p;
            a += fabs(p);
        }
        *reinterpret_cast<Pack<T, VEC>*>(x + i) = px;
        *reinterpret_cast<Pack<T, VEC>*>(y + i) = py;
    }
    for (unsigned k = 0; i + k < n && k < VEC; ++k) {
        const T xv = Value<T>::of(kx + zo + (u64)k * GAMMA), yv = Value<T>::of(ky + zo + (u64)k * GAMMA);
        x[i + k] = xv;
        y[i + k] = yv;
        const double p = (double)xv * (double)yv;
        s += p;
        a += fabs(p);
    }
    s = block_sum(s);
    a = block_sum(a);
    if (threadIdx.x == 0) { partial[2 * blockIdx.x] = s; partial[2 * blockIdx.x + 1] = a; }
}
"""

_RANDOM_C_TYPES = {"float16": ("__half", 8), "float32": ("float", 4), "float64": ("double", 2)}


@functools.cache
def _cupy_random_module() -> Any:
    import cupy

    names = [f"{k}<{c}, {v}>" for c, v in _RANDOM_C_TYPES.values() for k in ("random_rows", "random_pair_sums")]
    names += [f"{k}<{c}, 1>" for c, _ in _RANDOM_C_TYPES.values() for k in ("random_rows", "random_pair_sums")]
    return cupy.RawModule(code=_BLOCK_SUM_SOURCE + _RANDOM_SOURCE, options=("-std=c++17",), name_expressions=names)


def _cupy_random_fill(out: Any, key: int, g_first: int, total_cols: int) -> None:
    """Fill the C-contiguous 2-D ``out`` with a random operand's block whose element (0, 0)
    is the operand's element number ``g_first`` (row length ``total_cols``)."""
    import cupy

    h, w = out.shape
    if out.size == 0:
        return
    if w == total_cols or h == 1:  # contiguous in the operand: one row of h * w elements
        h, w = 1, h * w
    c_type, vec = _RANDOM_C_TYPES[str(out.dtype)]
    if (h > 1 and w % vec) or out.data.ptr % 16:  # rows that do not start on a vector boundary
        vec = 1
    kernel = _cupy_random_module().get_function(f"random_rows<{c_type}, {vec}>")
    threads = 256
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    flat = out.reshape(-1)
    # Column pieces of at most _RANDOM_LAUNCH elements, so every index in the kernel fits
    # 32 bits; at most 65535 rows a launch (the grid's y limit), the kernel strides over more.
    for c0 in range(0, w, _RANDOM_LAUNCH):
        width = min(_RANDOM_LAUNCH, w - c0)
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


def random_pair_with_sums(
    xp: Any, *, seed: int, operands: tuple[int, int], elements: tuple[int, int], dtype: Any
) -> tuple[Any, Any, Any]:
    """Elements ``elements`` of two random vectors of ``seed`` (operand numbers ``operands``),
    as :func:`random_block` makes them, and ``[sum(x*y), sum|x*y|]`` in float64 (an array
    of ``xp``: read it once the stream is done anyway).

    On a GPU one kernel makes x and y and sums their products as it goes, so the sums cost
    no pass over x and y of their own; on a CPU they are :func:`dot_check`'s.
    """
    lo, hi = elements
    if not is_cupy(xp):
        kw = dict(seed=seed, rows=(0, 1), cols=elements, total_cols=hi, dtype=dtype)
        x = random_block(xp, operand=operands[0], **kw).reshape(-1)
        y = random_block(xp, operand=operands[1], **kw).reshape(-1)
        return x, y, np.array(dot_check(xp, x, y))
    import cupy

    dtype = np.dtype(dtype)
    n = hi - lo
    x, y = cupy.empty(n, dtype), cupy.empty(n, dtype)
    c_type, vec = _RANDOM_C_TYPES[dtype.name]
    kernel = _cupy_random_module().get_function(f"random_pair_sums<{c_type}, {vec}>")
    threads = 256
    blocks = cupy.cuda.Device().attributes["MultiProcessorCount"] * 16
    pieces = range(0, n, _RANDOM_LAUNCH)
    partial = cupy.zeros((len(pieces), blocks, 2), dtype=cupy.float64)
    kx, ky = (np.uint64(stream_key(seed, op)) for op in operands)
    for p, start in enumerate(pieces):
        count = min(_RANDOM_LAUNCH, n - start)
        kernel(
            (min(blocks, max(1, -(-count // (vec * threads)))),),
            (threads,),
            (x[start:], y[start:], kx, ky, np.uint64(lo + start), np.uint32(count), partial[p]),
        )
    return x, y, partial.sum(axis=(0, 1))


# Elements of x and y a CPU casts to float64 at once.
DOT_PIECE = 1 << 20


def dot_scratch(n: int) -> int:
    """Bytes a CPU's :func:`dot_f64` and :func:`dot_check` of ``n`` elements hold beyond
    x and y: a float64 piece of each. A GPU's kernels make none."""
    return 2 * 8 * min(n, DOT_PIECE)


def dot_f64(xp: Any, x: Any, y: Any) -> float:
    """``sum(x * y)`` with every product and the sum in float64, for 1-D ``x`` and ``y``.

    On the GPU a fused kernel reads each input once (cupy.dot would accumulate in the
    input dtype; casting first would write two float64 copies).
    """
    if is_cupy(xp):
        return _cupy_dot(x, y)
    # np.dot on float64 views is BLAS-fast; do it in slices to bound the float64 copies.
    total = 0.0
    step = DOT_PIECE
    for s in range(0, x.shape[0], step):
        total += float(np.dot(x[s : s + step].astype(np.float64), y[s : s + step].astype(np.float64)))
    return total


_DOT_SOURCE = r"""
template<typename T, typename V, int W>
__device__ __forceinline__ double dot_vec(const V a, const V b);

template<> __device__ __forceinline__ double dot_vec<float, float4, 4>(const float4 a, const float4 b) {
    return (double)a.x * b.x + (double)a.y * b.y + (double)a.z * b.z + (double)a.w * b.w;
}
template<> __device__ __forceinline__ double dot_vec<double, double2, 2>(const double2 a, const double2 b) {
    return a.x * b.x + a.y * b.y;
}


__device__ __forceinline__ void store_block_sum(double acc, double* partial) {
    acc = block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One partial sum per block; the host side adds the partials (deterministic order).
template<typename T, typename V, int W>
__global__ void dot_partial(const T* __restrict__ x, const T* __restrict__ y,
                            long long n, double* __restrict__ partial) {
    double acc = 0.0;
    const long long nvec = n / W;
    const V* xv = reinterpret_cast<const V*>(x);
    const V* yv = reinterpret_cast<const V*>(y);
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + stride < nvec; i += 2 * stride) {  // two loads in flight per thread
        V a0 = xv[i], b0 = yv[i], a1 = xv[i + stride], b1 = yv[i + stride];
        acc += dot_vec<T, V, W>(a0, b0) + dot_vec<T, V, W>(a1, b1);
    }
    if (i < nvec) acc += dot_vec<T, V, W>(xv[i], yv[i]);
    if (blockIdx.x == 0) {
        for (long long t = nvec * W + threadIdx.x; t < n; t += blockDim.x) acc += (double)x[t] * (double)y[t];
    }
    store_block_sum(acc, partial);
}

// Any dtype, any alignment: the plain loop.
template<typename T>
__global__ void dot_partial_scalar(const T* __restrict__ x, const T* __restrict__ y,
                                   long long n, double* __restrict__ partial) {
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        acc += (double)x[i] * (double)y[i];
    store_block_sum(acc, partial);
}

// The checks' route: each block sums one contiguous segment (a grouping unlike the dot
// kernel's grid stride), keeping sum(x*y) and sum|x*y| for the relative error.
template<typename T>
__global__ void dot_check_partial(const T* __restrict__ x, const T* __restrict__ y,
                                  long long n, double* __restrict__ partial) {
    const long long per = (n + gridDim.x - 1) / gridDim.x;
    const long long lo = (long long)blockIdx.x * per;
    const long long hi = lo + per < n ? lo + per : n;
    double s = 0.0, a = 0.0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const double p = (double)x[i] * (double)y[i];
        s += p;
        a += fabs(p);
    }
    s = block_sum(s);
    a = block_sum(a);
    if (threadIdx.x == 0) { partial[2 * blockIdx.x] = s; partial[2 * blockIdx.x + 1] = a; }
}

// out[r] = sum_c m[r, c] * v[c] in float64 for a C-ordered m: one block per row at a
// time, reading m once (a float64 copy of m would cost three times the traffic).
template<typename T>
__global__ void matvec_rows_f64(const T* __restrict__ m, const double* __restrict__ v,
                                long long rows, long long cols, double* __restrict__ out) {
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = m + r * cols;
        double acc = 0.0;
        for (long long c = threadIdx.x; c < cols; c += blockDim.x) acc += (double)row[c] * v[c];
        acc = block_sum(acc);
        if (threadIdx.x == 0) out[r] = acc;
    }
}
"""

_DOT_VECTOR = {"float32": "dot_partial<float, float4, 4>", "float64": "dot_partial<double, double2, 2>"}
_DOT_SCALAR = {
    "float16": "dot_partial_scalar<__half>",
    "float32": "dot_partial_scalar<float>",
    "float64": "dot_partial_scalar<double>",
}
_C_TYPES = {"float16": "__half", "float32": "float", "float64": "double"}
_DOT_CHECK = {name: f"dot_check_partial<{c}>" for name, c in _C_TYPES.items()}
_MATVEC = {name: f"matvec_rows_f64<{c}>" for name, c in _C_TYPES.items()}


@functools.cache
def _cupy_dot_module() -> Any:
    import cupy

    return cupy.RawModule(
        code="#include <cuda_fp16.h>\n" + _BLOCK_SUM_SOURCE + _DOT_SOURCE,
        options=("-std=c++17",),
        name_expressions=[*_DOT_VECTOR.values(), *_DOT_SCALAR.values(), *_DOT_CHECK.values(), *_MATVEC.values()],
    )


def _cupy_dot(x: Any, y: Any) -> float:
    import cupy

    n = x.shape[0]
    if n == 0:
        return 0.0
    dev = cupy.cuda.Device()
    blocks = dev.attributes["MultiProcessorCount"] * 4
    threads = 512
    partial = cupy.empty(blocks, dtype=cupy.float64)
    name = str(x.dtype)
    aligned = x.data.ptr % 16 == 0 and y.data.ptr % 16 == 0
    kernel_name = _DOT_VECTOR.get(name) if aligned else None
    kernel = _cupy_dot_module().get_function(kernel_name or _DOT_SCALAR[name])
    kernel((blocks,), (threads,), (x, y, np.int64(n), partial))
    return float(to_host(cupy, partial.sum()))


def dot_check(xp: Any, x: Any, y: Any) -> tuple[float, float]:
    """``(sum(x*y), sum|x*y|)`` in float64 by a route other than :func:`dot_f64`'s.

    Used to check a dot: the two sums group the products differently, so a wrong kernel
    or a lost chunk shows, while rounding stays within ``sqrt(n)`` units of the scale.
    """
    if is_cupy(xp):
        import cupy

        n = x.shape[0]
        if n == 0:
            return 0.0, 0.0
        blocks = cupy.cuda.Device().attributes["MultiProcessorCount"] * 8
        partial = cupy.empty(2 * blocks, dtype=cupy.float64)
        kernel = _cupy_dot_module().get_function(_DOT_CHECK[str(x.dtype)])
        kernel((blocks,), (256,), (x, y, np.int64(n), partial))
        s, a = to_host(cupy, partial.reshape(blocks, 2).sum(axis=0))
        return float(s), float(a)
    total = scale = 0.0
    step = DOT_PIECE
    for s in range(0, x.shape[0], step):
        prod = x[s : s + step].astype(np.float64)
        prod *= y[s : s + step]
        total += float(prod.sum())
        np.abs(prod, out=prod)
        scale += float(prod.sum())
    return total, scale


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
            blocks = min(rows, cupy.cuda.Device().attributes["MultiProcessorCount"] * 16)
            kernel = _cupy_dot_module().get_function(_MATVEC[str(m.dtype)])
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
