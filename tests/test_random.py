"""Counter-based random operands: tiling-independent, exact in their dtype, uniform in [-1, 1)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from mgpu.worker import kernels
from mgpu.worker.device import Device, DeviceFacts
from mgpu.worker.sources import RandomSource

DTYPES = ["float16", "float32", "float64"]
MANTISSA_BITS = {"float16": 11, "float32": 24, "float64": 53}

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(z: int) -> int:
    """The splitmix64 finaliser, in plain Python integers (an independent reference)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def test_reference_splitmix64_matches_the_published_sequence():
    # Vigna's splitmix64.c seeded with 1234567: the reference below is the real thing.
    state, out = 1234567, []
    for _ in range(3):
        state = (state + _GAMMA) & _M64
        out.append(_splitmix64(state))
    assert out == [6457827717110365317, 3203168211198807973, 9817491932198370423]


def _element(seed: int, operand: int, i: int, j: int, total_cols: int, dtype: str) -> float:
    """Element (i, j) as documented: splitmix64(key + (i * total_cols + j) * gamma)'s top
    bits scaled to [-1, 1), computed in Python floats (float64)."""
    bits = MANTISSA_BITS[dtype]
    key = kernels.stream_key(seed, operand)
    z = _splitmix64((key + (i * total_cols + j) * _GAMMA) & _M64)
    return (z >> (64 - bits)) * 2.0 ** (1 - bits) - 1.0


def _block(seed, operand, rows, cols, total_cols, dtype):
    return kernels.random_block(
        np, seed=seed, operand=operand, rows=rows, cols=cols, total_cols=total_cols, dtype=dtype
    )


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_elements_follow_the_documented_formula(dtype):
    m, n = 37, 53
    full = _block(11, 1, (0, m), (0, n), n, dtype)
    for i, j in [(0, 0), (0, n - 1), (m - 1, 0), (m - 1, n - 1), (17, 29), (5, 3)]:
        assert float(full[i, j]) == _element(11, 1, i, j, n, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [(1, 1), (7, 13), (16, 64), (97, 1), (1, 89)])
def test_same_values_under_any_tiling(dtype, tile):
    m, n = 97, 89
    whole = _block(3, 0, (0, m), (0, n), n, dtype)
    assert whole.shape == (m, n) and whole.dtype == np.dtype(dtype)
    tm, tn = tile
    assembled = np.empty((m, n), dtype=dtype)
    for r0 in range(0, m, tm):
        for c0 in range(0, n, tn):
            r1, c1 = min(r0 + tm, m), min(c0 + tn, n)
            assembled[r0:r1, c0:c1] = _block(3, 0, (r0, r1), (c0, c1), n, dtype)
    np.testing.assert_array_equal(_bits(assembled), _bits(whole))


def test_uneven_blocks_assemble_bit_for_bit():
    m, n = 101, 103
    whole = _block(5, 1, (0, m), (0, n), n, "float32")
    row_cuts, col_cuts = [0, 1, 2, 50, 99, m], [0, 7, 8, 60, n]
    parts = [
        [_block(5, 1, (r0, r1), (c0, c1), n, "float32") for c0, c1 in pairwise(col_cuts)]
        for r0, r1 in pairwise(row_cuts)
    ]
    np.testing.assert_array_equal(_bits(np.block(parts)), _bits(whole))


def test_empty_block():
    assert _block(0, 0, (3, 3), (0, 5), 5, "float32").shape == (0, 5)


def test_different_operands_and_seeds_give_different_values():
    kw = dict(rows=(0, 64), cols=(0, 64), total_cols=64, dtype="float64")
    a0 = kernels.random_block(np, seed=0, operand=0, **kw)
    b0 = kernels.random_block(np, seed=0, operand=1, **kw)
    a1 = kernels.random_block(np, seed=1, operand=0, **kw)
    for x, y in [(a0, b0), (a0, a1), (b0, a1)]:
        assert np.mean(x == y) < 0.01
        assert abs(np.corrcoef(x.ravel(), y.ravel())[0, 1]) < 0.1
    # The same arguments give the same values (a pure function).
    np.testing.assert_array_equal(a0, kernels.random_block(np, seed=0, operand=0, **kw))


def test_element_depends_on_its_global_position_not_just_the_block():
    # The shape's row length is part of the counter: (1, 0) of a 5-wide matrix is element 5.
    a = _block(2, 0, (1, 2), (0, 1), 5, "float64")
    b = _block(2, 0, (0, 1), (5, 6), 10, "float64")
    assert a[0, 0] == b[0, 0]
    assert a[0, 0] != _block(2, 0, (1, 2), (0, 1), 6, "float64")[0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_are_in_range_and_exact_in_the_dtype(dtype):
    n = 4096
    block = _block(9, 0, (0, 16), (0, n), n, dtype)
    assert block.dtype == np.dtype(dtype)
    assert block.min() >= -1.0 and block.max() < 1.0
    wide = block.astype(np.float64)
    # Exact: a round trip through float64 changes nothing ...
    np.testing.assert_array_equal(_bits(wide.astype(dtype)), _bits(block))
    # ... and each value is the float64 computation of the same bits (no rounding on the cast).
    bits = MANTISSA_BITS[dtype]
    key = kernels.stream_key(9, 0)
    g = np.arange(16 * n, dtype=np.uint64)
    z = g * np.uint64(_GAMMA) + np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    want = (z >> np.uint64(64 - bits)).astype(np.float64) * 2.0 ** (1 - bits) - 1.0
    np.testing.assert_array_equal(wide.ravel(), want)
    # Values sit on the grid of 2**(1 - bits): every mantissa bit is used, none lost.
    steps = (wide + 1.0) * 2.0 ** (bits - 1)
    np.testing.assert_array_equal(steps, np.round(steps))
    assert len(np.unique(block)) > 0.5 * min(block.size, 2**bits)


def _cpu_device() -> Device:
    facts = DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "host")
    return Device("cpu", np, facts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_1d_random_source_is_row_0_of_the_2d_function(dtype):
    n = 1009
    dev = _cpu_device()
    src = RandomSource(seed=4, operand=1, shape=(n,), dtype=dtype)
    row0 = _block(4, 1, (0, 3), (0, n), n, dtype)[0]
    whole = src.read(dev, (0, n))
    assert whole.shape == (n,) and whole.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(_bits(whole), _bits(row0))
    # Pieces of the vector are the same elements.
    pieces = np.concatenate([src.read(dev, (lo, hi)) for lo, hi in [(0, 1), (1, 500), (500, 1008), (1008, n)]])
    np.testing.assert_array_equal(_bits(pieces), _bits(row0))


def test_2d_random_source_reads_blocks_of_the_matrix():
    dev = _cpu_device()
    src = RandomSource(seed=4, operand=0, shape=(30, 40), dtype="float32")
    whole = _block(4, 0, (0, 30), (0, 40), 40, "float32")
    np.testing.assert_array_equal(src.read(dev, (3, 17), (5, 39)), whole[3:17, 5:39])


@pytest.mark.parametrize("dtype", DTYPES)
def test_uniform_statistics(dtype):
    n = 1 << 20
    x = _block(123, 0, (0, 1), (0, n), n, dtype).astype(np.float64).ravel()
    # Uniform on [-1, 1): mean 0, std 1/sqrt(3); standard errors are ~6e-4 here.
    assert abs(x.mean()) < 5e-3
    assert abs(x.std() - 1 / np.sqrt(3)) < 5e-3
    hist, _ = np.histogram(x, bins=16, range=(-1, 1))
    assert hist.min() > 0.9 * n / 16 and hist.max() < 1.1 * n / 16
    # Neighbours are uncorrelated (a counter hash, not a sequence with structure).
    assert abs(np.corrcoef(x[:-1], x[1:])[0, 1]) < 0.01
