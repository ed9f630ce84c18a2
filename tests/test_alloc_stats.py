"""Allocator statistics without a GPU: the job-window arithmetic against RMM's counter
stack (modelled on its C++ header), the resource-chain walk, and the Result's two shapes
(GPU rows with figures, CPU rows with none) in JSON and in the table."""

from __future__ import annotations

import io
import random
from types import SimpleNamespace

import pytest
from rich.console import Console

from mgpu.client.result import build_result
from mgpu.cluster import ClusterInfo, ResolvedCluster
from mgpu.memory.stats import (
    Counts,
    RmmTracker,
    describe_chain,
    resource_chain,
    window_from_snapshots,
    window_from_stack,
)
from mgpu.results import Allocator, Result
from mgpu.show import allocator_cell, print_result
from mgpu.spec import validate_job
from mgpu.tiling import Plan, Tile
from mgpu.worker.device import DeviceFacts
from mgpu.workloads import get_workload_class
from mgpu.workloads.base import TileRecord

# -- a stand-in for rmm.mr.StatisticsResourceAdaptor -----------------------------------


class _Counter:
    """``statistics_resource_adaptor::counter``: value, peak, total, and how a popped
    (nested) counter folds into the one below it."""

    def __init__(self) -> None:
        self.value = self.peak = self.total = 0

    def add(self, n: int) -> None:
        self.value += n
        self.total += n
        self.peak = max(self.peak, self.value)

    def sub(self, n: int) -> None:
        self.value -= n

    def merge(self, sub: _Counter) -> None:
        self.peak = max(self.value + sub.peak, self.peak)
        self.value += sub.value
        self.total += sub.total


def _stats(b: _Counter, c: _Counter) -> SimpleNamespace:
    # The shape of rmm.statistics.Statistics.
    return SimpleNamespace(
        current_bytes=b.value,
        current_count=c.value,
        peak_bytes=b.peak,
        peak_count=c.peak,
        total_bytes=b.total,
        total_count=c.total,
    )


class FakeStatsAdaptor:
    """RMM's counter stack: push starts fresh counters, pop folds them into the one below."""

    def __init__(self) -> None:
        self.stack = [(_Counter(), _Counter())]

    def allocate(self, n: int) -> None:
        b, c = self.stack[-1]
        b.add(n)
        c.add(1)

    def deallocate(self, n: int) -> None:
        b, c = self.stack[-1]
        b.sub(n)
        c.sub(1)

    @property
    def allocation_counts(self) -> SimpleNamespace:
        return _stats(*self.stack[-1])

    def push_counters(self) -> SimpleNamespace:
        before = _stats(*self.stack[-1])
        self.stack.append((_Counter(), _Counter()))
        return before

    def pop_counters(self) -> SimpleNamespace:
        if len(self.stack) < 2:
            raise IndexError("cannot pop the last counter pair")
        b, c = self.stack.pop()
        self.stack[-1][0].merge(b)
        self.stack[-1][1].merge(c)
        return _stats(b, c)


class OldStatsAdaptor:
    """An RMM without the counter stack: one dict of lifetime counters."""

    def __init__(self) -> None:
        self.inner = FakeStatsAdaptor()

    def allocate(self, n: int) -> None:
        self.inner.allocate(n)

    def deallocate(self, n: int) -> None:
        self.inner.deallocate(n)

    def get_allocation_counts(self) -> dict[str, int]:
        return vars(self.inner.allocation_counts)


# -- the job window --------------------------------------------------------------------


def test_counts_read_both_shapes_rmm_returns():
    want = Counts(current_bytes=1, current_count=2, peak_bytes=3, peak_count=4, total_bytes=5, total_count=6)
    as_dict = {
        "current_bytes": 1,
        "current_count": 2,
        "peak_bytes": 3,
        "peak_count": 4,
        "total_bytes": 5,
        "total_count": 6,
    }
    assert Counts.of(as_dict) == want
    assert Counts.of(SimpleNamespace(**as_dict)) == want


def test_window_counts_what_was_live_before_the_job_in_its_peak():
    mr = FakeStatsAdaptor()
    mr.allocate(100)  # held from before the job (a cached buffer, say)
    tracker = RmmTracker(mr, "pool")
    tracker.begin()
    mr.allocate(300)  # live: 400, the job's peak
    mr.deallocate(100)  # the older buffer goes: live 300
    mr.allocate(50)  # live 350
    mr.deallocate(300)  # live 50
    got = tracker.end()
    assert got["peak_bytes"] == 400 and got["current_bytes"] == 50
    assert got["total_bytes"] == 350 and got["total_count"] == 2
    assert got["peak_count"] == 2 and got["current_count"] == 1
    assert len(mr.stack) == 1  # the window was popped


def test_window_peak_equals_the_highest_live_bytes_seen_during_the_job():
    rng = random.Random(4)
    for _ in range(200):
        mr, live, sizes = FakeStatsAdaptor(), 0, []
        tracker = RmmTracker(mr, "async")

        def step(record: list[int], mr: FakeStatsAdaptor = mr, sizes: list[int] = sizes) -> None:
            nonlocal live
            if sizes and rng.random() < 0.45:
                n = sizes.pop(rng.randrange(len(sizes)))
                mr.deallocate(n)
                live -= n
            else:
                n = rng.randint(1, 1000)
                sizes.append(n)
                mr.allocate(n)
                live += n
            record.append(live)

        for _ in range(rng.randint(0, 20)):
            step([])
        start, start_count, seen = live, len(sizes), [live]
        counts_seen = [start_count]
        tracker.begin()
        allocs = 0
        for _ in range(rng.randint(0, 40)):
            before = len(sizes)
            step(seen)
            counts_seen.append(len(sizes))
            allocs += len(sizes) > before
        got = tracker.end()
        assert got["peak_bytes"] == max(seen), (start, seen)
        assert got["current_bytes"] == live
        assert got["peak_count"] == max(counts_seen)
        assert got["total_count"] == allocs


def test_a_window_left_open_by_a_failed_job_is_closed_by_the_next():
    mr = FakeStatsAdaptor()
    tracker = RmmTracker(mr, "pool")
    tracker.begin()
    mr.allocate(1 << 20)  # the failed job's, never freed
    tracker.begin()  # the next job, no end() in between
    mr.allocate(10)
    got = tracker.end()
    assert got["total_count"] == 1 and got["total_bytes"] == 10
    assert got["peak_bytes"] == got["current_bytes"] == (1 << 20) + 10
    assert len(mr.stack) == 1


def test_without_the_counter_stack_totals_are_differences_and_an_old_peak_is_unknown():
    mr = OldStatsAdaptor()
    mr.allocate(1000)
    mr.deallocate(1000)  # the lifetime peak, 1000, is before the job
    tracker = RmmTracker(mr, "pool")
    tracker.begin()
    mr.allocate(10)
    got = tracker.end()
    assert got["total_count"] == 1 and got["total_bytes"] == 10 and got["current_bytes"] == 10
    assert got["peak_bytes"] is None and got["peak_count"] is None  # not the job's: not reported
    tracker.begin()
    mr.allocate(5000)
    assert tracker.end()["peak_bytes"] == 5010  # a peak set during the job is the job's


def test_window_helpers_directly():
    before = Counts(current_bytes=100, current_count=1, peak_bytes=900, peak_count=3, total_bytes=5000, total_count=40)
    job = Counts(current_bytes=-100, current_count=-1, peak_bytes=250, peak_count=2, total_bytes=700, total_count=7)
    assert window_from_stack(before, job) == Counts(
        current_bytes=0, current_count=0, peak_bytes=350, peak_count=3, total_bytes=700, total_count=7
    )
    after = Counts(current_bytes=0, current_count=0, peak_bytes=900, peak_count=4, total_bytes=5700, total_count=47)
    assert window_from_snapshots(before, after) == {
        "current_bytes": 0,
        "current_count": 0,
        "peak_bytes": None,
        "peak_count": 4,
        "total_bytes": 700,
        "total_count": 7,
    }


def test_end_reports_the_pool_size_now_and_the_kind_and_cap():
    tracker = RmmTracker(FakeStatsAdaptor(), "pool", pool=SimpleNamespace(pool_size=lambda: 2 << 30), limit=None)
    tracker.begin()
    got = tracker.end()
    assert (got["kind"], got["pool_size"], got["limit"]) == ("pool", 2 << 30, None)
    tracker = RmmTracker(FakeStatsAdaptor(), "async", limit=1 << 30)
    tracker.begin()
    got = tracker.end()
    assert (got["kind"], got["pool_size"], got["limit"]) == ("async", None, 1 << 30)
    assert Allocator(**got).total_count == 0


# -- the resource chain ----------------------------------------------------------------


class _Res:
    def __init__(self, upstream: object = None) -> None:
        self.upstream_mr = upstream


class _Pool(_Res):
    pass


class _Async(_Res):
    pass


class _Managed(_Res):
    pass


class _Cuda(_Res):
    pass


class _Limiting(_Res):
    def __init__(self, upstream: object, limit: int) -> None:
        super().__init__(upstream)
        self.limit = limit

    def get_allocation_limit(self) -> int:
        return self.limit


class _Callback:  # an RMM callback resource has no upstream_mr
    pass


MR = SimpleNamespace(
    PoolMemoryResource=_Pool,
    CudaAsyncMemoryResource=_Async,
    ManagedMemoryResource=_Managed,
    CudaMemoryResource=_Cuda,
    LimitingResourceAdaptor=_Limiting,
)


def test_chain_follows_the_spill_fallback_down_to_its_primary():
    pool = _Pool(_Cuda())
    fallback = SimpleNamespace(resource=_Callback(), primary=pool)
    stats = _Res(fallback.resource)
    chain = resource_chain(stats, fallback)
    assert chain == [stats, fallback.resource, pool, pool.upstream_mr]
    assert describe_chain(chain, MR) == ("pool", pool, None)
    # Without knowing the fallback, the walk stops at the callback resource.
    assert resource_chain(stats) == [stats, fallback.resource]


@pytest.mark.parametrize(
    "make,kind,limit",
    [
        (lambda: _Res(_Limiting(_Async(), 1 << 30)), "async", 1 << 30),  # dask-cuda: async with a maximum
        (lambda: _Res(_Pool(_Managed())), "pool", None),  # a pool over managed memory is a pool
        (lambda: _Res(_Managed()), "managed", None),
        (lambda: _Res(_Cuda()), "cuda", None),
        (lambda: _Res(_Callback()), "_Callback", None),  # unknown: named as it is
    ],
)
def test_kind_is_the_topmost_known_resource(make, kind, limit):
    got_kind, pool, got_limit = describe_chain(resource_chain(make()), MR)
    assert (got_kind, got_limit) == (kind, limit)
    assert (pool is not None) == (kind == "pool")


# -- the Result ------------------------------------------------------------------------

GPU_FIGURES = {
    "kind": "pool",
    "pool_size": 2 << 30,
    "limit": None,
    "peak_bytes": 300 << 20,
    "current_bytes": 0,
    "total_bytes": 900 << 20,
    "total_count": 42,
    "peak_count": 5,
}


def _result(allocators: dict[str, dict] | None) -> Result:
    doc = {"workload": "dot", "params": {"n": 1000}, "cluster": {"backend": "cpu", "dashboard": None}}
    job = validate_job(doc)
    workload = get_workload_class("dot")(job.params)
    facts = {f"tcp://w{i}:1": DeviceFacts("cpu", i, "cpu", 1 << 30, 1 << 30, "h") for i in range(2)}
    info = ClusterInfo(
        client=None,
        resolved=ResolvedCluster("cpu", [0, 1], "pool", "tcp", "auto", None, None),
        owned=True,
        devices=facts,
    )
    tiles = [Tile(i, {"n": (i * 500, i * 500 + 500)}, f"tcp://w{i}:1") for i in range(2)]
    plan = Plan(tiles=tiles, placement="static", tile_shape={"n": 500}, working_set=8000, budget=1 << 20)
    records = [
        TileRecord(
            index=i,
            worker=f"h:{100 + i}",
            device=i,
            start=1.0,
            stop=2.0,
            busy_s=0.5,
            work=8000.0,
            value=1.0,
            verify_error=0.0,
            verify_ok=True,
        )
        for i in range(2)
    ]
    return build_result(job, workload, info, plan, records, wall_s=3.0, outputs=[], allocators=allocators)


def test_each_row_gets_its_own_workers_figures():
    result = _result({"tcp://w1:1": GPU_FIGURES, "tcp://w0:1": {**GPU_FIGURES, "peak_bytes": 7}})
    rows = {d.id: d for d in result.per_device}
    assert rows[1].allocator == Allocator(**GPU_FIGURES) and rows[1].peak_memory == 300 << 20
    assert rows[0].allocator.peak_bytes == 7 and rows[0].peak_memory == 7
    back = Result.model_validate_json(result.model_dump_json())
    assert back.per_device[1].allocator.total_count == 42


def test_rows_without_figures_say_so_in_json_and_table():
    result = _result({"tcp://w0:1": {"kind": "numpy"}})  # w1 did not answer
    rows = {d.id: d for d in result.per_device}
    assert rows[0].allocator.kind == "numpy" and rows[0].allocator.peak_bytes is None
    assert rows[0].peak_memory == 0 and rows[1].allocator is None
    data = result.model_dump(mode="json")
    assert data["per_device"][0]["allocator"]["peak_bytes"] is None  # null, not a made-up zero
    out = io.StringIO()
    print_result(result, Console(file=out, width=200))
    assert "numpy, n/a" in out.getvalue() and "allocator" in out.getvalue()


def test_table_shows_pool_size_peak_and_count_compactly():
    result = _result(
        {"tcp://w0:1": GPU_FIGURES, "tcp://w1:1": {**GPU_FIGURES, "kind": "async", "pool_size": None, "limit": 1 << 30}}
    )
    out = io.StringIO()
    print_result(result, Console(file=out, width=200))
    text = out.getvalue()
    assert "pool 2.00 GiB, peak 300.00 MiB, 42 allocs" in text
    assert "async, cap 1.00 GiB, peak 300.00 MiB, 42 allocs" in text


@pytest.mark.parametrize(
    "figures,cell",
    [
        (None, "n/a"),
        ({"kind": "numpy"}, "numpy, n/a"),
        ({"kind": "default", "pool_size": 1 << 30, "current_bytes": 0}, "default 1.00 GiB, peak n/a"),
        ({"kind": "managed", "peak_bytes": 1 << 20, "total_count": 3}, "managed, peak 1.00 MiB, 3 allocs"),
    ],
)
def test_allocator_cell(figures, cell):
    assert allocator_cell(Allocator(**figures) if figures else None) == cell
