"""The dot workload's kernels: its random pairs with their sums, the float64 dot, and the
check's second route. Each has one meaning on NumPy and on CuPy (see
:mod:`mgpu.worker.kernels`, whose random values and block sum the CUDA source here builds on).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ...worker import kernels as core

__all__ = ["DOT_PIECE", "dot_check", "dot_f64", "dot_scratch", "random_pair", "random_pair_with_sums"]

_PAIR_SOURCE = r"""
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
"""

_C_TYPES = {"float16": "__half", "float32": "float", "float64": "double"}
_DOT_VECTOR = {"float32": "dot_partial<float, float4, 4>", "float64": "dot_partial<double, double2, 2>"}
_DOT_SCALAR = {
    "float16": "dot_partial_scalar<__half>",
    "float32": "dot_partial_scalar<float>",
    "float64": "dot_partial_scalar<double>",
}
_DOT_CHECK = {name: f"dot_check_partial<{c}>" for name, c in _C_TYPES.items()}
_PAIRS = [f"random_pair_sums<{c}, {v}>" for c, v in core.RANDOM_C_TYPES.values()] + [
    f"random_pair_sums<{c}, 1>" for c, _ in core.RANDOM_C_TYPES.values()
]


def random_pair(
    xp: Any, *, seed: int, operands: tuple[int, int], elements: tuple[int, int], dtype: Any
) -> tuple[Any, Any]:
    """Elements ``elements`` of two random vectors of ``seed`` (operand numbers ``operands``),
    as :func:`random_block` makes them."""
    kw = dict(seed=seed, rows=(0, 1), cols=elements, total_cols=elements[1], dtype=dtype)
    return (
        core.random_block(xp, operand=operands[0], **kw).reshape(-1),
        core.random_block(xp, operand=operands[1], **kw).reshape(-1),
    )


def random_pair_with_sums(
    xp: Any, *, seed: int, operands: tuple[int, int], elements: tuple[int, int], dtype: Any
) -> tuple[Any, Any, Any]:
    """Elements ``elements`` of two random vectors of ``seed`` (operand numbers ``operands``),
    as :func:`~mgpu.worker.kernels.random_block` makes them, and ``[sum(x*y), sum|x*y|]`` in float64 (an array
    of ``xp``: read it once the stream is done anyway).

    On a GPU one kernel makes x and y and sums their products as it goes, so the sums cost
    no pass over x and y of their own; on a CPU they are :func:`dot_check`'s.
    """
    lo, hi = elements
    if not core.is_cupy(xp):
        x, y = random_pair(xp, seed=seed, operands=operands, elements=elements, dtype=dtype)
        return x, y, np.array(dot_check(xp, x, y))
    import cupy

    dtype = np.dtype(dtype)
    n = hi - lo
    x, y = cupy.empty(n, dtype), cupy.empty(n, dtype)
    c_type, vec = core.RANDOM_C_TYPES[dtype.name]
    kernel = _cupy_dot_module().get_function(f"random_pair_sums<{c_type}, {vec}>")
    threads = 256
    blocks = core.multiprocessors() * 16
    pieces = range(0, n, core.RANDOM_LAUNCH)
    partial = cupy.zeros((len(pieces), blocks, 2), dtype=cupy.float64)
    kx, ky = (np.uint64(core.stream_key(seed, op)) for op in operands)
    for p, start in enumerate(pieces):
        count = min(core.RANDOM_LAUNCH, n - start)
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
    if core.is_cupy(xp):
        return _cupy_dot(x, y)
    # np.dot on float64 views is BLAS-fast; do it in slices to bound the float64 copies.
    total = 0.0
    step = DOT_PIECE
    for s in range(0, x.shape[0], step):
        total += float(np.dot(x[s : s + step].astype(np.float64), y[s : s + step].astype(np.float64)))
    return total


@functools.cache
def _cupy_dot_module() -> Any:
    import cupy

    return cupy.RawModule(
        code=core.BLOCK_SUM_SOURCE + core.RANDOM_SOURCE + _PAIR_SOURCE + _DOT_SOURCE,
        options=("-std=c++17",),
        name_expressions=[*_PAIRS, *_DOT_VECTOR.values(), *_DOT_SCALAR.values(), *_DOT_CHECK.values()],
    )


def _cupy_dot(x: Any, y: Any) -> float:
    import cupy

    n = x.shape[0]
    if n == 0:
        return 0.0
    blocks = core.multiprocessors() * 4
    threads = 512
    partial = cupy.empty(blocks, dtype=cupy.float64)
    name = str(x.dtype)
    aligned = x.data.ptr % 16 == 0 and y.data.ptr % 16 == 0
    kernel_name = _DOT_VECTOR.get(name) if aligned else None
    kernel = _cupy_dot_module().get_function(kernel_name or _DOT_SCALAR[name])
    kernel((blocks,), (threads,), (x, y, np.int64(n), partial))
    return float(core.to_host(cupy, partial.sum()))


def dot_check(xp: Any, x: Any, y: Any) -> tuple[float, float]:
    """``(sum(x*y), sum|x*y|)`` in float64 by a route other than :func:`dot_f64`'s.

    Used to check a dot: the two sums group the products differently, so a wrong kernel
    or a lost chunk shows, while rounding stays within ``sqrt(n)`` units of the scale.
    """
    if core.is_cupy(xp):
        import cupy

        n = x.shape[0]
        if n == 0:
            return 0.0, 0.0
        blocks = core.multiprocessors() * 8
        partial = cupy.empty(2 * blocks, dtype=cupy.float64)
        kernel = _cupy_dot_module().get_function(_DOT_CHECK[str(x.dtype)])
        kernel((blocks,), (256,), (x, y, np.int64(n), partial))
        s, a = core.to_host(cupy, partial.reshape(blocks, 2).sum(axis=0))
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
