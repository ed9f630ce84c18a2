"""Tiling: splitting ranges, matmul tile sizes under a budget, placement, and each
workload's plan covering its output exactly once. Pure functions: no cluster here."""

from __future__ import annotations

import itertools
import math
from itertools import pairwise
from pathlib import Path

import dask.config
import numpy as np
import pytest
import yaml

from mgpu.errors import JobInputError
from mgpu.tiling import (
    Plan,
    assign_contiguous,
    check_tiling_keys,
    split,
    split_aligned,
    split_by_cost,
    split_by_prefix,
    split_by_size,
)
from mgpu.worker.device import DeviceFacts
from mgpu.workloads.dot import Dot, DotParams
from mgpu.workloads.mandelbrot import Mandelbrot, MandelbrotParams, mandelbrot_axes, mandelbrot_counts, row_costs
from mgpu.workloads.mandelbrot.kernels import estimate_counts
from mgpu.workloads.matmul import Matmul, MatmulParams, choose_matmul_tiles, cpu_working_set, matmul_working_set

AWKWARD = [1, 2, 3, 7, 13, 97, 101, 1000, 10_007]
JOBS = Path(__file__).resolve().parents[1] / "jobs"


def _check_pieces(pieces: list[tuple[int, int]], n: int) -> None:
    """Contiguous, non-empty, in order, covering range(n) exactly."""
    if n == 0:
        assert pieces == []
        return
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    for (_, hi), (lo2, _) in pairwise(pieces):
        assert hi == lo2
    assert all(hi > lo for lo, hi in pieces)


# -- split / split_by_size ------------------------------------------------------------


@pytest.mark.parametrize("n", [0, *AWKWARD])
@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8, 97, 2000])
def test_split_is_contiguous_exact_and_near_equal(n, parts):
    pieces = split(n, parts)
    _check_pieces(pieces, n)
    if n:
        assert len(pieces) == min(parts, n)  # n < parts: one element each, none empty
        sizes = [hi - lo for lo, hi in pieces]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n", [0, *AWKWARD])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1000, 10**7])
def test_split_by_size_respects_the_size_and_uses_fewest_pieces(n, size):
    pieces = split_by_size(n, size)
    _check_pieces(pieces, n)
    if n:
        sizes = [hi - lo for lo, hi in pieces]
        assert max(sizes) <= size
        assert len(pieces) == math.ceil(n / size)
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n", [0, *AWKWARD, 27136, 41984])
@pytest.mark.parametrize("size,quantum", [(7, 3), (300, 128), (1000, 128), (2816, 128), (7168, 128), (64, 128)])
def test_split_aligned_ends_no_piece_but_the_last_in_part_of_a_quantum(n, size, quantum):
    pieces = split_aligned(n, size, quantum)
    _check_pieces(pieces, n)
    if not n:
        return
    sizes = [hi - lo for lo, hi in pieces]
    assert max(sizes) <= size
    if size < quantum:  # no whole quantum fits: as split_by_size
        assert pieces == split_by_size(n, size)
        return
    assert (
        all(s % quantum == 0 for s in sizes[:-1]) and max(sizes[:-1], default=0) - min(sizes[:-1], default=0) <= quantum
    )
    # The fewest pieces that can: all but the last hold at most size's whole quanta.
    fewest = next(p for p in itertools.count(1) if (p - 1) * (size // quantum) * quantum + size >= n)
    assert len(pieces) == fewest


# -- split_by_cost ----------------------------------------------------------------------


def _piece_costs(pieces: list[tuple[int, int]], costs: np.ndarray) -> np.ndarray:
    return np.array([costs[lo:hi].sum() for lo, hi in pieces])


def _bump(n: int) -> np.ndarray:
    """Mandelbrot-like row costs: ~1 far out, ~300x that in a band around the middle."""
    r = (np.arange(n) + 0.5) / n - 0.5
    return 1.0 + 300.0 * np.exp(-((r / 0.12) ** 2))


@pytest.mark.parametrize("n", [0, *AWKWARD])
@pytest.mark.parametrize("parts", [1, 2, 3, 8, 97, 2000])
def test_split_by_cost_is_exact_near_equal_and_gives_the_parts_asked(n, parts):
    costs = np.random.default_rng(n * 31 + parts).exponential(size=n) * (np.arange(n) % 5 != 0)  # some zeros
    pieces = split_by_cost(costs.tolist(), parts, max_size=n)
    _check_pieces(pieces, n)
    if n:
        assert len(pieces) == min(parts, n)
        if parts < n / 4:  # cuts far enough apart for each to land at its own target
            got = _piece_costs(pieces, costs)
            assert np.abs(got - costs.sum() / parts).max() <= costs.max() + 1e-9


@pytest.mark.parametrize("n", [0, 1, 97, 10_007])
@pytest.mark.parametrize("max_size", [1, 500, 20_000])
def test_split_by_prefix_of_summed_costs_cuts_as_split_by_cost(n, max_size):
    costs = _bump(n) * (np.arange(n) % 7 != 0)  # some zeros
    for parts in (1, 3, 32, 2000):
        pieces = split_by_prefix(np.concatenate([[0.0], np.cumsum(costs)]), parts, max_size)
        assert pieces == split_by_cost(costs.tolist(), parts, max_size)
        _check_pieces(pieces, n)
    assert split_by_prefix(np.zeros(n + 1), 3, max_size) == split_by_cost([0.0] * n, 3, max_size)


def test_split_by_cost_balances_what_equal_lengths_do_not():
    costs = _bump(65_536)
    equal = _piece_costs(split(65_536, 32), costs)
    balanced = split_by_cost(costs.tolist(), 32, max_size=65_536)
    _check_pieces(balanced, 65_536)
    got = _piece_costs(balanced, costs)
    assert equal.max() / equal.min() > 100
    assert len(balanced) == 32 and got.max() / got.min() < 1.01
    sizes = [hi - lo for lo, hi in balanced]
    assert sizes[0] > 10 * min(sizes) and sizes[-1] > 10 * min(sizes)  # tall cheap bands at the edges


@pytest.mark.parametrize("max_size", [1, 7, 500, 4000])
def test_split_by_cost_splits_only_the_pieces_longer_than_max_size(max_size):
    n, parts = 10_007, 16
    costs = _bump(n).tolist()
    free = split_by_cost(costs, parts, max_size=n)
    pieces = split_by_cost(costs, parts, max_size=max_size)
    _check_pieces(pieces, n)
    assert max(hi - lo for lo, hi in pieces) <= max_size
    # Each free piece, cut into as few near-equal pieces as max_size allows, and no more.
    assert pieces == [(lo + a, lo + b) for lo, hi in free for a, b in split_by_size(hi - lo, max_size)]
    assert len(pieces) == sum(math.ceil((hi - lo) / max_size) for lo, hi in free) >= parts


def test_split_by_cost_degenerate_inputs():
    assert split_by_cost([], 4, 10) == []
    assert split_by_cost([3.0, 1.0], 5, 10) == [(0, 1), (1, 2)]  # fewer elements than parts
    assert split_by_cost([0.0] * 10, 3, 10) == split(10, 3)  # nothing to weigh: equal lengths
    assert split_by_cost([1.0] * 10, 0, 10) == [(0, 10)]
    # All the cost in one element: it stands alone, the pieces around it stay non-empty.
    pieces = split_by_cost([0.0] * 5 + [100.0] + [0.0] * 5, 4, 11)
    _check_pieces(pieces, 11)
    assert len(pieces) == 4 and (5, 6) in pieces
    with pytest.raises(ValueError, match="non-negative"):
        split_by_cost([1.0, -1.0], 2, 10)


# -- assign_contiguous ----------------------------------------------------------------


@pytest.mark.parametrize("n_tiles", [1, 2, 3, 5, 7, 12, 97])
@pytest.mark.parametrize("n_workers", [1, 2, 3, 4, 8])
def test_assign_contiguous_gives_contiguous_runs_differing_by_at_most_one(n_tiles, n_workers):
    workers = [f"w{i}" for i in range(n_workers)]
    owners = assign_contiguous(n_tiles, workers)
    assert len(owners) == n_tiles
    # Contiguous: once a worker's run ends it never comes back, and runs follow worker order.
    runs = [w for w, _ in itertools.groupby(owners)]
    assert len(runs) == len(set(runs))
    assert runs == sorted(runs, key=workers.index)
    counts = [owners.count(w) for w in workers]
    assert max(counts) - min(counts) <= 1
    if n_tiles >= n_workers:
        assert min(counts) >= 1  # nobody idles while another has two


# -- choose_matmul_tiles ---------------------------------------------------------------

SIZES = [(1, 1, 1), (7, 13, 1), (97, 89, 101), (1000, 300, 5000), (4096, 4096, 4096), (300, 8192, 257)]
BUDGETS = [1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 28, 1 << 34]
MIN_TILE = 256


@pytest.mark.parametrize("m,n,k", SIZES)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.parametrize("n_workers", [1, 2, 3, 4, 8])
def test_choose_matmul_tiles_fits_the_budget(m, n, k, budget, itemsize, n_workers):
    smallest = matmul_working_set(min(m, MIN_TILE), min(n, MIN_TILE), min(k, MIN_TILE), k, itemsize)
    try:
        tm, tn, tk = choose_matmul_tiles(m, n, k, itemsize, budget=budget, n_workers=n_workers, min_tile=MIN_TILE)
    except JobInputError as e:
        assert "cluster.memory_limit" in str(e)
        # It may only give up when a tile of min_tile (or the whole axis) does not fit.
        assert smallest > budget
        return
    assert 1 <= tm <= m and 1 <= tn <= n and 1 <= tk <= k
    assert matmul_working_set(tm, tn, tk, k, itemsize) <= budget
    full_k_fits = matmul_working_set(min(m, MIN_TILE), min(n, MIN_TILE), k, k, itemsize) <= budget
    if full_k_fits:
        assert tk == k  # keeps full k whenever a tile of min_tile with the full k fits
    if tk < k:
        # k is split only when needed: the output tile was cut as far as allowed first,
        # and even that tile would not fit with the full k.
        assert tm <= MIN_TILE and tn <= MIN_TILE
        assert matmul_working_set(tm, tn, k, k, itemsize) > budget


@pytest.mark.parametrize("m,n,k", SIZES)
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_choose_matmul_tiles_raises_when_nothing_fits(m, n, k, itemsize):
    budget = matmul_working_set(1, 1, 1, k, itemsize) - 1  # not even a 1 x 1 x 1 tile
    with pytest.raises(JobInputError, match="cluster.memory_limit"):
        choose_matmul_tiles(m, n, k, itemsize, budget=budget, n_workers=2)


def test_choose_matmul_tiles_with_room_gives_one_tile_per_worker_and_full_k():
    tm, tn, tk = choose_matmul_tiles(4096, 1024, 2048, 4, budget=1 << 40, n_workers=4)
    assert tk == 2048
    assert math.ceil(4096 / tm) * math.ceil(1024 / tn) == 4


def test_choose_matmul_tiles_keeps_explicit_sizes():
    assert choose_matmul_tiles(97, 89, 101, 4, budget=1 << 30, n_workers=2, explicit={"m": 32, "n": 40, "k": 37}) == (
        32,
        40,
        37,
    )
    # Larger than the matrix: clamped to it.
    assert choose_matmul_tiles(7, 13, 1, 4, budget=1 << 30, n_workers=2, explicit={"m": 100, "n": 100, "k": 100}) == (
        7,
        13,
        1,
    )
    with pytest.raises(JobInputError, match="cluster.memory_limit"):
        choose_matmul_tiles(
            4096, 4096, 4096, 4, budget=1 << 20, n_workers=2, explicit={"m": 4096, "n": 4096, "k": 4096}
        )


def test_check_tiling_keys():
    assert check_tiling_keys("auto", ("m", "n", "k"), "matmul") == {}
    assert check_tiling_keys({"m": 4}, ("m", "n", "k"), "matmul") == {"m": 4}
    with pytest.raises(JobInputError, match=r"tiling: unknown axis 'q' for matmul; allowed: m, n, k"):
        check_tiling_keys({"m": 4, "q": 1}, ("m", "n", "k"), "matmul")


# -- each workload's plan covers its output exactly once ----------------------------------


def _devices(n: int, memory: int = 8 << 30) -> dict[str, DeviceFacts]:
    return {f"tcp://127.0.0.1:{9000 + i}": DeviceFacts("cpu", i, "cpu", memory, memory, "host") for i in range(n)}


def _check_static(plan: Plan, devices: dict[str, DeviceFacts]) -> None:
    assert plan.placement == "static"
    assert [t.index for t in plan.tiles] == list(range(len(plan.tiles)))
    assert all(t.worker in devices for t in plan.tiles)
    counts = [sum(t.worker == w for t in plan.tiles) for w in devices]
    assert max(counts) - min(counts) <= 1
    assert plan.working_set <= plan.budget


MATMUL_SIZES = [(1, 1, 1), (7, 13, 1), (97, 89, 101), (300, 257, 50)]


@pytest.mark.parametrize("m,n,k", MATMUL_SIZES)
@pytest.mark.parametrize("n_workers", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("tiling", [{}, {"m": 32, "n": 40, "k": 37}, {"m": 1, "n": 5}])
def test_matmul_plan_covers_c_exactly_once(m, n, k, n_workers, tiling):
    devices = _devices(n_workers)
    wl = Matmul(MatmulParams(m=m, n=n, k=k))
    plan = wl.plan(devices, 1 << 30, tiling)
    _check_static(plan, devices)
    cover = np.zeros((m, n), dtype=np.int32)
    for t in plan.tiles:
        (r0, r1), (c0, c1) = t.bounds["m"], t.bounds["n"]
        assert r1 - r0 <= plan.tile_shape["m"] and c1 - c0 <= plan.tile_shape["n"]
        cover[r0:r1, c0:c1] += 1
    assert (cover == 1).all()
    assert {t.args["tk"] for t in plan.tiles} == {plan.tile_shape["k"]} == {min(tiling.get("k", k), k)}
    if tiling:
        assert len(plan.tiles) == math.ceil(m / min(tiling["m"], m)) * math.ceil(n / min(tiling["n"], n))


@pytest.mark.parametrize("m,n,k", [(97, 89, 101), (600, 700, 900)])
def test_matmul_plan_under_a_small_budget_covers_c_and_fits(m, n, k):
    devices = _devices(2)
    budget = cpu_working_set(256, 256, 256, k, 4) + 1000  # CPU workers: NumPy's temporaries count
    wl = Matmul(MatmulParams(m=m, n=n, k=k))
    plan = wl.plan(devices, budget, {})
    cover = np.zeros((m, n), dtype=np.int32)
    for t in plan.tiles:
        (r0, r1), (c0, c1) = t.bounds["m"], t.bounds["n"]
        cover[r0:r1, c0:c1] += 1
    assert (cover == 1).all()
    assert plan.working_set <= budget


@pytest.mark.parametrize(
    "n,tiling",
    [(n, t) for n in (1, 7, 13, 97, 10_007) for t in ({}, {"n": 3})] + [(1_000_003, {}), (1_000_003, {"n": 997})],
)
@pytest.mark.parametrize("n_workers", [1, 2, 3, 4, 8])
def test_dot_plan_covers_x_exactly_once(n, n_workers, tiling):
    devices = _devices(n_workers)
    plan = Dot(DotParams(n=n)).plan(devices, 1 << 30, tiling)
    _check_static(plan, devices)
    cover = np.zeros(n, dtype=np.int32)
    for t in plan.tiles:
        lo, hi = t.bounds["n"]
        cover[lo:hi] += 1
    assert (cover == 1).all()
    if tiling:
        assert len(plan.tiles) == math.ceil(n / min(tiling["n"], n))


def test_dot_plan_cuts_chunks_to_the_budget():
    n, itemsize = 1_000_003, 4
    budget = 100_000
    plan = Dot(DotParams(n=n, dtype="float32")).plan(_devices(2), budget, {})
    assert plan.working_set <= budget
    assert all(2 * itemsize * t.size("n") <= budget for t in plan.tiles)
    assert sum(t.size("n") for t in plan.tiles) == n


@pytest.mark.parametrize("width,height", [(1, 1), (7, 13), (97, 89), (5000, 3)])
@pytest.mark.parametrize("n_workers", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("tiling", [{}, {"rows": 5}])
def test_mandelbrot_plan_covers_the_image_exactly_once(width, height, n_workers, tiling):
    plan = Mandelbrot(MandelbrotParams(width=width, height=height)).plan(_devices(n_workers), 1 << 30, tiling)
    assert plan.placement == "dynamic"
    assert all(t.worker is None for t in plan.tiles)
    cover = np.zeros((height, width), dtype=np.int32)
    for t in plan.tiles:
        r0, r1 = t.bounds["rows"]
        assert 0 < r1 - r0 <= plan.tile_shape["rows"]
        cover[r0:r1, :] += 1
    assert (cover == 1).all()
    if height >= 8 * n_workers and not tiling:
        # Enough bands to balance dynamically. (The planner aims at 8 per worker but rounds
        # the band height up, so e.g. 13 rows on 1 worker give 7 bands; 4 per worker holds.)
        assert len(plan.tiles) >= 4 * n_workers
    # Handed out dearest first; numbered top to bottom, each number once.
    assert [t.cost for t in plan.tiles] == sorted((t.cost for t in plan.tiles), reverse=True)
    by_row = sorted(plan.tiles, key=lambda t: t.bounds["rows"])
    assert [t.index for t in by_row] == list(range(len(plan.tiles)))


def _64k() -> MandelbrotParams:
    return MandelbrotParams(**yaml.safe_load((JOBS / "mandelbrot-64k.yaml").read_text())["params"])


@pytest.mark.parametrize("n_workers", [1, 2])
def test_mandelbrot_64k_bands_hold_equal_estimated_cost(n_workers):
    params = _64k()
    budget = int(0.8 * (140 << 30)) // Mandelbrot.concurrency  # an H200's automatic budget, shared by the bands
    plan = Mandelbrot(params).plan(_devices(n_workers, 140 << 30), budget, {})
    bands = sorted(t.bounds["rows"] for t in plan.tiles)
    _check_pieces(bands, params.height)
    cost = row_costs(params)
    assert [t.cost for t in plan.tiles] == pytest.approx(
        [cost[lo:hi].sum() for lo, hi in (t.bounds["rows"] for t in plan.tiles)]
    )
    equal = split_by_size(params.height, 2048)  # the bands before: 2048 rows each
    equal_cost = _piece_costs(equal, cost)
    got = np.array([t.cost for t in plan.tiles])
    assert len(equal) == 32 and equal_cost.max() / equal_cost.min() > 20
    # Bands are at most twice the equal rows tall. Most hold the same estimated cost; the
    # cheaper ones are the pieces of cheap rows cut by that height, taller than equal rows.
    assert max(hi - lo for lo, hi in bands) <= 2 * 2048
    full = got >= 0.95 * got.max()
    assert full.sum() > len(got) / 2
    assert all(t.size("rows") > 2048 for t, f in zip(plan.tiles, full, strict=True) if not f)

    # The cheap rows far from the set go in fewer, taller bands than equal rows made.
    edge = params.height // 8

    def at_edges(pieces: list[tuple[int, int]]) -> int:
        return sum(lo < edge or hi > params.height - edge for lo, hi in pieces)

    assert at_edges(bands) <= 6 and at_edges(equal) == 8
    assert plan.tile_shape["rows"] == max(hi - lo for lo, hi in bands)
    assert plan.working_set <= budget


def test_mandelbrot_bands_are_no_taller_than_the_budget_holds():
    params = _64k()
    bytes_per_row = params.width * (4 + 2 * 4)
    plan = Mandelbrot(params).plan(_devices(2, 140 << 30), 4096 * bytes_per_row, {})
    bands = sorted(t.bounds["rows"] for t in plan.tiles)
    _check_pieces(bands, params.height)
    assert max(hi - lo for lo, hi in bands) == plan.tile_shape["rows"] <= 4096
    assert len(bands) > 32  # the tall cheap bands were split; the others kept


def test_mandelbrot_explicit_rows_or_an_output_keep_equal_bands(tmp_path):
    params = MandelbrotParams(width=300, height=1000, max_iter=200)
    devices = _devices(2)

    def rows_of(wl: Mandelbrot, tiling: dict[str, int]) -> list[tuple[int, int]]:
        return sorted(t.bounds["rows"] for t in wl.plan(devices, 1 << 30, tiling).tiles)

    assert rows_of(Mandelbrot(params), {"rows": 64}) == split_by_size(1000, 64)
    assert rows_of(Mandelbrot(params), {}) != split_by_size(1000, 63)  # 16 bands, balanced
    written = Mandelbrot(MandelbrotParams(**{**params.model_dump(), "output": {"npy": str(tmp_path / "m.npy")}}))
    written.prepare(force=False)
    assert rows_of(written, {}) == split_by_size(1000, 63)  # ceil(1000 / 16): as before


def test_row_costs_are_the_coarse_counts_interpolated():
    # An image within the coarse grid: every row counted, nothing interpolated.
    small = MandelbrotParams(width=100, height=60, max_iter=80)
    x, y = mandelbrot_axes(
        width=100, height=60, bounds=(small.xmin, small.xmax, small.ymin, small.ymax), rows=(0, 60), dtype="float32"
    )
    # The counts are the estimate's own (the kernel's but for a few points near the set),
    # plus what a pixel costs besides its steps.
    counted = mandelbrot_counts(np, x, y, 80).mean(axis=1) * 100
    extra = row_costs(small) - counted
    assert extra.min() >= 100  # a step a pixel or more
    np.testing.assert_allclose(row_costs(small), counted + extra.min(), rtol=0.01)

    # A taller image: rows interpolated, centred (a window symmetric about the axis gives
    # symmetric costs) and close to the counts of every row, band by band.
    tall = MandelbrotParams(width=128, height=2048, max_iter=100, ymin=-1.25, ymax=1.25)
    est = row_costs(tall)
    np.testing.assert_allclose(est, est[::-1], rtol=1e-9)
    x, y = mandelbrot_axes(
        width=128, height=2048, bounds=(tall.xmin, tall.xmax, tall.ymin, tall.ymax), rows=(0, 2048), dtype="float32"
    )
    truth = (mandelbrot_counts(np, x, y, 100).sum(axis=1) + extra.min() / 100 * 128).astype(np.float64)
    bands = split(2048, 16)
    np.testing.assert_allclose(_piece_costs(bands, est), _piece_costs(bands, truth), rtol=0.05)

    # Deep counts: the estimate stops early and counts points still running as max_iter.
    inside = MandelbrotParams(width=50, height=40, max_iter=50_000, xmin=-0.2, xmax=0.1, ymin=-0.2, ymax=0.2)
    np.testing.assert_allclose(row_costs(inside), 50 * (50_000 + extra.min() / 100))


def test_the_estimates_counts_are_the_kernels_but_near_the_set():
    p = MandelbrotParams(width=128, height=256, max_iter=1000)
    x, y = mandelbrot_axes(
        width=128, height=256, bounds=(p.xmin, p.xmax, p.ymin, p.ymax), rows=(0, 256), dtype="float32"
    )
    exact, est = mandelbrot_counts(np, x, y, 1000), estimate_counts(x, y, 1000)
    assert np.mean(est != exact) < 0.02  # points near the set: float64 steps, looked at every few
    np.testing.assert_allclose(est.mean(axis=1) + 26, exact.mean(axis=1) + 26, rtol=0.03)
    assert est.sum() == pytest.approx(exact.sum(), rel=1e-3)
    # The main cardioid and the period-2 bulb stay without a step, as the kernel counts them.
    on_axis = np.array([-0.1, 0.2, -1.0, -1.2])
    assert (estimate_counts(on_axis, np.array([0.0]), 500) == 500).all()
    assert (mandelbrot_counts(np, on_axis, np.array([0.0]), 500) == 500).all()


def test_the_coarse_counts_are_kept_for_later_plans_of_the_same_window(tmp_path, monkeypatch):
    from mgpu.workloads.mandelbrot import workload

    counted: list[int] = []
    real = workload.estimate_counts
    monkeypatch.setattr(workload, "estimate_counts", lambda x, y, steps: counted.append(steps) or real(x, y, steps))
    p = MandelbrotParams(width=300, height=500, max_iter=90)
    with dask.config.set({"mgpu.cache-dir": str(tmp_path)}):
        workload._row_costs.cache_clear()
        first = row_costs(p)
        workload._row_costs.cache_clear()  # a later process: the folder keeps the counts
        np.testing.assert_array_equal(row_costs(p), first)
        assert counted == [90] and len(list((tmp_path / "row-costs").glob("*.npy"))) == 1
        row_costs(MandelbrotParams(width=300, height=500, max_iter=90, xmin=-2.0))  # another window: counted
        assert counted == [90, 90]
        # A kept file that cannot be read is counted again.
        for kept in (tmp_path / "row-costs").glob("*.npy"):
            kept.write_bytes(b"not npy")
        workload._row_costs.cache_clear()
        np.testing.assert_array_equal(row_costs(p), first)
        assert counted == [90, 90, 90]


def test_spill_lets_the_smallest_tile_exceed_the_budget():

    budget = 1 << 19  # a 256 x 256 x 256 float32 tile holds 0.8 MB
    with pytest.raises(JobInputError, match="cluster.memory_limit"):
        choose_matmul_tiles(4096, 4096, 4096, 4, budget=budget, n_workers=2)
    tm, tn, tk = choose_matmul_tiles(4096, 4096, 4096, 4, budget=budget, n_workers=2, spill=True)
    # Shrunk as far as the planner goes, then handed to managed memory rather than refused.
    assert (tm, tn, tk) == (256, 256, 256)
    assert matmul_working_set(tm, tn, tk, 4096, 4) > budget


@pytest.mark.parametrize("n_workers", [4, 8])
def test_every_worker_gets_work_on_4_and_8_devices(n_workers):
    """A job big enough for every device spreads over all of them, evenly."""
    devices = _devices(n_workers)
    matmul = Matmul(MatmulParams(m=4096, n=4096, k=256)).plan(devices, 1 << 30, {})
    dot = Dot(DotParams(n=10_000_000)).plan(devices, 1 << 30, {})
    for plan in (matmul, dot):
        counts = [sum(t.worker == w for t in plan.tiles) for w in devices]
        assert min(counts) >= 1 and max(counts) - min(counts) <= 1
    assert len(matmul.tiles) % n_workers == 0  # whole rounds of tiles: nobody waits on a straggler
    mandel = Mandelbrot(MandelbrotParams(width=1024, height=4096)).plan(devices, 1 << 30, {})
    assert len(mandel.tiles) >= 4 * n_workers  # enough bands to balance dynamically
