"""Out-of-core pieces on the CPU: chunking and host copies, .npy reads and writes through
mgpu.transfer, the PCIe byte counts and the bound of jobs whose data is on the host, and a
distributed matmul from files to a file on real CPU workers."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import pytest
from conftest import submit_json, write_job
from distributed.diagnostics.plugin import SchedulerPlugin

from mgpu import transfer
from mgpu.device import Device, DeviceFacts
from mgpu.planner import Tile
from mgpu.results import Throughput, _roofline
from mgpu.sources import NpyInfo, NpySink, NpySource
from mgpu.workloads.matmul import Matmul, MatmulParams


def _cpu_device() -> Device:
    return Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))


@pytest.mark.parametrize(
    "rows,cols,itemsize,chunk", [(1000, 7, 4, 1024), (3, 10_000, 8, 64), (1, 1, 4, 4096), (17, 5, 2, 10)]
)
def test_chunks_cover_every_row_once_within_the_chunk_size(rows, cols, itemsize, chunk):
    chunks = transfer.chunk_rows((rows, cols), itemsize, chunk)
    assert chunks[0][0] == 0 and chunks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    row_bytes = cols * itemsize
    for r0, r1 in chunks:
        assert r1 > r0
        # A chunk never exceeds the buffer, unless one row alone does (then it is one row).
        assert (r1 - r0) * row_bytes <= chunk or r1 - r0 == 1


def test_host_copy_splits_a_strided_block_over_threads(monkeypatch):
    monkeypatch.setattr(transfer, "_PARALLEL_BYTES", 64)  # force many parts on a small block
    big = np.arange(300 * 50, dtype=np.float32).reshape(300, 50)
    src = big[:, 7:40]  # a column block: strided rows, as a B panel of a row-major file
    dst = np.zeros((300, 33), np.float32)
    transfer.host_copy(dst, src)
    assert np.array_equal(dst, src)


def test_npy_source_and_sink_move_blocks_through_transfer(tmp_path):
    dev = _cpu_device()
    data = np.random.default_rng(0).standard_normal((40, 30)).astype(np.float32)
    np.save(tmp_path / "a.npy", data)
    src = NpySource(NpyInfo(str(tmp_path / "a.npy"), data.shape, "float32"))
    assert np.array_equal(src.read(dev, (5, 17), (3, 29)), data[5:17, 3:29])
    out = np.empty((12, 26), np.float32)
    src.read_into(dev, out, (5, 17), (3, 29))
    assert np.array_equal(out, data[5:17, 3:29])
    sink = NpySink.for_path(str(tmp_path / "c.npy"), (40, 30), "float32")
    sink.create()
    sink.write((slice(5, 17), slice(3, 29)), out, dev)
    sink.write((slice(0, 5), slice(None)), data[:5])
    sink.commit()
    written = np.load(tmp_path / "c.npy")
    assert np.array_equal(written[5:17, 3:29], data[5:17, 3:29]) and np.array_equal(written[:5], data[:5])
    assert not written[17:].any()


def test_a_tile_still_running_after_its_job_was_given_up_writes_nothing(tmp_path):
    # The client removes the temporary file of a failed or stopped job while a tile may
    # still be running: its write must neither fail (a worker traceback) nor make a file.
    sink = NpySink.for_path(str(tmp_path / "c.npy"), (4, 3), "float32")
    sink.create()
    sink.discard()
    sink.write((slice(0, 2), slice(None)), np.ones((2, 3), np.float32))
    assert list(tmp_path.iterdir()) == []


def test_host_bytes_count_inputs_once_and_naive_counts_each_tile(tmp_path):
    a = np.zeros((1000, 600), np.float32)
    b = np.zeros((600, 800), np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    params = MatmulParams(
        input={"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy")}, output=str(tmp_path / "c.npy")
    )
    wl = Matmul(params)
    # A, B read once and C written once: (1000*600 + 600*800 + 1000*800) * 4 bytes.
    assert wl.host_bytes() == 4 * (600_000 + 480_000 + 800_000)
    facts = {"w0": DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h")}
    plan = wl.plan(facts, 1 << 30, {"m": 500, "n": 400})
    assert len(plan.tiles) == 4
    # Each of the 4 tiles reads 500 rows of A and 400 columns of B, all of k.
    assert wl.naive_host_bytes(plan) == 4 * (4 * (500 * 600 + 600 * 400) + 1000 * 800)
    generated = Matmul(MatmulParams(m=10, n=10, k=10))
    assert generated.host_bytes() is None and generated.naive_host_bytes(plan) is None


def test_distributed_plan_with_an_output_overlaps_writes(monkeypatch, tmp_path):
    from mgpu.workloads.matmul import workload as matmul

    monkeypatch.setattr(matmul, "_WRITE_TILE_BYTES", 100 * 50 * 8)
    facts = {f"w{i}": DeviceFacts("cpu", i, "cpu", 1 << 30, 1 << 30, "h") for i in range(2)}
    wl = Matmul(
        MatmulParams(m=400, n=100, k=64, dtype="float64", operands="distributed", output=str(tmp_path / "c.npy"))
    )
    assert wl.concurrency == 3  # tiles write while another computes
    plan = wl.plan(facts, 1 << 30, {})
    # Each (A_i, B_j) block of 200 x 50 float64 is cut into row pieces of at most 100 x 50,
    # and those into two column pieces.
    assert len(plan.tiles) == 2 * 2 * 2 * 2
    assert all((t.size("m"), t.size("n")) == (100, 25) for t in plan.tiles)
    assert sorted((t.bounds["m"], t.bounds["n"]) for t in plan.tiles) == sorted(
        {(t.bounds["m"], t.bounds["n"]) for t in plan.tiles}
    )
    # A_i and B_j are made in those pieces, a panel each, on worker i (j): every row and column once.
    assert [(p.name, p.worker, p.bounds) for p in plan.panels] == [
        ("a0.0", "w0", {"m": (0, 100)}),
        ("a0.1", "w0", {"m": (100, 200)}),
        ("a1.0", "w1", {"m": (200, 300)}),
        ("a1.1", "w1", {"m": (300, 400)}),
        ("b0.0", "w0", {"n": (0, 25)}),
        ("b0.1", "w0", {"n": (25, 50)}),
        ("b1.0", "w1", {"n": (50, 75)}),
        ("b1.1", "w1", {"n": (75, 100)}),
    ]
    panels = {p.name: p for p in plan.panels}
    for t in plan.tiles:
        # Each tile reads its own piece of A and of B, all of each (a_rows are the piece's rows).
        a, b = (panels[name] for name in t.needs)
        assert a.operand == "a" and a.worker == t.worker
        assert a.bounds["m"] == t.bounds["m"] == t.bounds["a_rows"] and b.bounds["n"] == t.bounds["n"]
    # Worker 0's row: its own B panel's tiles first; for each piece of B, each piece of A in turn.
    assert [t.needs for t in plan.tiles if t.worker == "w0"] == [
        ("a0.0", "b0.0"),
        ("a0.1", "b0.0"),
        ("a0.0", "b0.1"),
        ("a0.1", "b0.1"),
        ("a0.0", "b1.0"),
        ("a0.1", "b1.0"),
        ("a0.0", "b1.1"),
        ("a0.1", "b1.1"),
    ]
    # Without an output each panel is whole, and one tile runs at a time.
    whole = Matmul(MatmulParams(m=400, n=100, k=64, operands="distributed"))
    assert whole.concurrency == 1
    assert [p.name for p in whole.plan(facts, 1 << 30, {}).panels] == ["a0.0", "a1.0", "b0.0", "b1.0"]


def test_distributed_budget_counts_panels_once_and_each_running_tile(tmp_path):
    facts = {f"w{i}": DeviceFacts("cpu", i, "cpu", 1 << 30, 1 << 30, "h") for i in range(2)}
    wl = Matmul(
        MatmulParams(m=2000, n=2000, k=2000, dtype="float32", operands="distributed", output=str(tmp_path / "c.npy"))
    )
    plan = wl.plan(facts, 64 << 20, {})
    panels = 4 * (1000 * 2000 + 2000 * 1000)
    assert wl.concurrency == 3 and plan.working_set > panels and plan.budget == 3 * (64 << 20)
    from mgpu.errors import JobInputError

    with pytest.raises(JobInputError, match="memory_limit"):
        wl.plan(facts, panels // 2, {})  # the budget per tile task: three could not hold the panels and tiles


def test_the_bound_is_the_slower_of_compute_and_pcie():
    ceilings = {"w0": {"gemm_float32": 50.0, "h2d_pinned": 50.0}, "w1": {"gemm_float32": 50.0, "h2d_pinned": 50.0}}
    # 200 TFLOP at 100 TFLOP/s takes 2 s; 40 GB at 100 GB/s takes 0.4 s: compute bound.
    r = _roofline(Throughput(value=80.0, unit="TFLOP/s"), "gemm_float32", ceilings, 200.0, 40 * 10**9)
    assert r.limit == pytest.approx(100.0) and r.fraction == pytest.approx(0.8)
    # 1 TFLOP takes 0.01 s; 40 GB still 0.4 s: PCIe bound, so the limit is 1 TFLOP / 0.4 s.
    r = _roofline(Throughput(value=2.0, unit="TFLOP/s"), "gemm_float32", ceilings, 1.0, 40 * 10**9)
    assert r.limit == pytest.approx(2.5) and r.fraction == pytest.approx(0.8) and "h2d_pinned" in r.basis


def _files(tmp_path: Path, m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    return a, b, {"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy")}


def _note_npy_reads(dask_worker: Any) -> None:
    """From now on note every block this worker reads from an .npy file: (file name, rows, cols)."""
    block = NpySource._block
    reads = dask_worker.npy_reads = []

    def noted(self: NpySource, dev: Any, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> Any:
        reads.append((Path(self.info.path).name, rows, cols))
        return block(self, dev, rows, cols)

    NpySource._block = noted


class _Priorities(SchedulerPlugin):
    """The priority each task was given (``client.submit(priority=...)``), by key."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.given: dict[str, int] = {}
        self.after: dict[str, list[str]] = {}  # the keys it depends on
        self.resources: dict[str, Any] = {}

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "processing":
            task = self.scheduler.tasks[key]
            self.given[key] = -task.priority[0]
            self.after[key] = sorted(d.key for d in task.dependencies)
            self.resources[key] = task.resource_restrictions


def test_distributed_matmul_from_files_to_a_file(monkeypatch, tmp_path):
    from conftest import start_local_cluster
    from distributed import Client

    from mgpu.workloads.matmul import workload as matmul

    monkeypatch.setattr(matmul, "_WRITE_TILE_BYTES", 20 * 30 * 8)  # two row pieces per panel pair
    m, k, n = 61, 47, 58
    a, b, files = _files(tmp_path, m, k, n)
    out = tmp_path / "c.npy"
    doc = {"workload": "matmul", "params": {"input": files, "output": str(out), "operands": "distributed"}}
    cluster = start_local_cluster()
    try:
        priorities = _Priorities(cluster.scheduler)
        cluster.scheduler.add_plugin(priorities)
        with Client(cluster) as client:
            client.run(_note_npy_reads)
            res, data = submit_json(
                write_job(tmp_path / "job.yaml", doc), tmp_path / "r.json", "--scheduler", cluster.scheduler_address
            )
            reads = client.run(lambda dask_worker: dask_worker.npy_reads)
    finally:
        cluster.close()
    assert res.code == 0, res.output
    assert data["verify"]["passed"] is True and data["plan"]["tiles"] == 16
    assert np.allclose(np.load(out), a @ b, rtol=1e-12, atol=1e-12)
    pcie = data["pcie"]
    assert pcie["minimum_bytes"] == 8 * (m * k + k * n + m * n)
    # Each worker read its rows of A in two pieces, all of k each: every row of A once, as the
    # minimum counts it. (CPU workers count no PCIe bytes, and read B again for each tile.)
    assert sorted(sorted((rows, cols) for name, rows, cols in r if name == "a.npy") for r in reads.values()) == [
        [((0, 15), (0, k)), ((15, 30), (0, k))],
        [((30, 45), (0, k)), ((45, 61), (0, k))],
    ]
    # The panels went in with minus the earliest place of a tile that reads them, in that
    # tile's worker's order (B_1.0: worker 1's first), the tiles with minus their own place:
    # each worker makes its first tile's panels first, then the next piece of A, then of B,
    # and runs its tiles in plan order.
    given = {key.split("-")[2]: p for key, p in priorities.given.items() if key.startswith("matmul-panel-")}
    assert given == {"a0.0": 0, "b0.0": 0, "a0.1": -1, "b0.1": -2, "a1.0": 0, "b1.0": 0, "a1.1": -1, "b1.1": -2}
    tiles = {int(key.split("-")[2]): p for key, p in priorities.given.items() if key.startswith("matmul-tile-")}
    assert tiles == {i: -(i % 8) for i in range(16)}  # eight a worker, each in its worker's order
    # On each worker the panels go one after another in that order, and take no tile slot.
    after = {
        key.split("-")[2]: [d.split("-")[2] for d in deps]
        for key, deps in priorities.after.items()
        if key.startswith("matmul-panel-")
    }
    assert after == {
        "a0.0": [],
        "b0.0": ["a0.0"],
        "a0.1": ["b0.0"],
        "b0.1": ["a0.1"],
        "a1.0": [],
        "b1.0": ["a1.0"],
        "a1.1": ["b1.0"],
        "b1.1": ["a1.1"],
    }
    assert all(not priorities.resources[key] for key in priorities.resources if key.startswith("matmul-panel-"))
    # The panels' records join the workers' rows (their spans, their bytes), not their tile counts.
    assert sum(d["tiles"] for d in data["per_device"]) == data["plan"]["tiles"]


# -- the pinned buffers' ordering, against a stand-in for CuPy whose copies run late -------


class _LateStream:
    """A stream whose copies run only when an event after them is waited for, so a
    buffer refilled before its copy ran would show up as wrong data. Like a CUDA stream
    it takes work from many threads (a lock keeps its queue whole)."""

    def __init__(self) -> None:
        self.ptr = id(self)
        self.pending: list[Any] = []
        self.lock = threading.RLock()


class _Event:
    def __init__(self) -> None:
        self.stream: _LateStream | None = None
        self.upto = 0

    def record(self, stream: _LateStream) -> None:
        with stream.lock:
            self.stream, self.upto = stream, len(stream.pending)

    def synchronize(self) -> None:
        with self.stream.lock:  # in stream order, each copy once
            for i in range(self.upto):
                op, self.stream.pending[i] = self.stream.pending[i], None
                if op is not None:
                    op()


class _DeviceArray(np.ndarray):
    @property
    def data(self) -> Any:  # what CuPy's ndarray.data.ptr gives
        from types import SimpleNamespace

        return SimpleNamespace(ptr=self.ctypes.data)


def _late_cupy(streams: dict[int, _LateStream]) -> Any:
    import ctypes
    from types import SimpleNamespace

    def memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream_ptr: int) -> None:
        with streams[stream_ptr].lock:
            streams[stream_ptr].pending.append(lambda: ctypes.memmove(dst, src, nbytes))

    runtime = SimpleNamespace(memcpyAsync=memcpy_async, memcpyHostToDevice=1, memcpyDeviceToHost=2, getDevice=lambda: 0)
    cuda = SimpleNamespace(
        Event=_Event,
        runtime=runtime,
        alloc_pinned_memory=bytearray,
        get_elapsed_time=lambda a, b: 1.0,
        Device=lambda i: contextlib.nullcontext(),
    )
    return SimpleNamespace(cuda=cuda)


def _stand_in_gpu(monkeypatch: pytest.MonkeyPatch, threads: int) -> tuple[Device, _LateStream]:
    """A GPU device on the stand-in CuPy, and a fresh pool of ``threads`` host threads."""
    import sys

    stream = _LateStream()
    monkeypatch.setitem(sys.modules, "cupy", _late_cupy({stream.ptr: stream}))
    monkeypatch.setattr(transfer, "_POOL", None)  # a pool of ``threads`` for this test
    monkeypatch.setattr(transfer, "_LOCAL", threading.local())
    monkeypatch.setattr(transfer, "host_threads", lambda: threads)
    return Device("cuda", None, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: stream), stream


def _run_copies(stream: _LateStream) -> None:
    """Run every copy enqueued on ``stream`` so far."""
    done = _Event()
    done.record(stream)
    done.synchronize()


@pytest.mark.parametrize("threads", [1, 3])
def test_pinned_buffers_are_refilled_only_after_their_copy_ran(monkeypatch, threads):
    dev, stream = _stand_in_gpu(monkeypatch, threads)
    stager = transfer.Stager(dev, chunk_bytes=4 * 40 * 8)  # 8 rows of 40 float32 a chunk: 13 chunks
    src = np.arange(100 * 60, dtype=np.float32).reshape(100, 60)[:, 10:50]  # strided rows
    dst = np.zeros((100, 40), np.float32).view(_DeviceArray)
    stager.load(dst, src, stream)
    assert not np.array_equal(dst, src)  # the last copies wait on the stream
    _run_copies(stream)
    assert np.array_equal(np.asarray(dst), src)
    back = np.zeros((100, 60), np.float32)
    stager.store(back[:, 10:50], (dst * 3).view(_DeviceArray), stream)  # store waits for its copies itself
    assert np.array_equal(back[:, 10:50], 3 * src) and not back[:, :10].any()
    assert dev.bytes_h2d == dev.bytes_d2h == src.nbytes
    # One timed DMA a chunk each way (the stand-in times each at 1 ms).
    assert dev.copy_seconds() == pytest.approx({"h2d": 0.013, "d2h": 0.013})


# -- reads straight from the file (FileBlock, pread) into the pinned buffers --------------


def _npy(path: Path, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Write an ``.npy`` of distinct values; returns its memory map."""
    mm = np.lib.format.open_memmap(str(path), mode="w+", dtype=dtype, shape=shape)
    mm[...] = np.random.default_rng(3).standard_normal(shape)
    mm.flush()
    del mm
    return np.load(path, mmap_mode="r")


def _file_block(mm: np.memmap, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> transfer.FileBlock:
    return transfer.FileBlock(str(mm.filename), mm.offset, mm.shape, mm.dtype, rows, cols)


def _count_opens(monkeypatch: pytest.MonkeyPatch, path: Path) -> tuple[list[int], list[int]]:
    """The descriptors opened on ``path`` and those of them closed, as they happen."""
    import os

    opened: list[int] = []
    closed: list[int] = []
    real_open, real_close = os.open, os.close

    def open_(p: Any, *args: Any, **kwargs: Any) -> int:
        fd = real_open(p, *args, **kwargs)
        if str(p) == str(path):
            opened.append(fd)
        return fd

    def close(fd: int) -> None:
        if fd in opened:
            closed.append(fd)
        real_close(fd)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "close", close)
    return opened, closed


# (file shape, dtype, rows, cols, bytes a chunk, chunks): several chunks, the last partial.
_BLOCKS = [
    ((1001,), "float32", (13, 994), None, 64 * 4, 16),  # an element range of a 1-D file
    ((50, 37), "float64", (3, 46), None, 4 * 37 * 8, 11),  # full-width rows: one read a chunk
    ((50, 37), "float16", (2, 49), (5, 29), 5 * 24 * 2, 10),  # a column block: a read a row
    ((50, 37), "float32", (0, 50), (0, 36), 7 * 36 * 4, 8),  # all but the last column
]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("shape,dtype,rows,cols,chunk,chunks", _BLOCKS)
def test_a_file_block_loads_the_same_data_as_the_memory_map(
    monkeypatch, tmp_path, threads, shape, dtype, rows, cols, chunk, chunks
):
    dev, stream = _stand_in_gpu(monkeypatch, threads)
    mm = _npy(tmp_path / "a.npy", shape, dtype)
    want = mm[rows[0] : rows[1]] if cols is None else mm[rows[0] : rows[1], cols[0] : cols[1]]
    block = _file_block(mm, rows, cols)
    assert block.shape == want.shape
    opened, closed = _count_opens(monkeypatch, tmp_path / "a.npy")
    dst = np.zeros(want.shape, dtype).view(_DeviceArray)
    assert transfer.Stager(dev, chunk_bytes=chunk).load(dst, block, stream) == want.nbytes
    _run_copies(stream)
    assert np.array_equal(np.asarray(dst), want)
    assert len(opened) == 1 and closed == opened  # one descriptor for the load, closed at its end
    assert dev.copy_seconds()["h2d"] == pytest.approx(chunks * 0.001)  # a DMA a chunk


def test_short_reads_are_completed(monkeypatch, tmp_path):
    import os

    dev, stream = _stand_in_gpu(monkeypatch, 3)
    mm = _npy(tmp_path / "a.npy", (40, 30), "float32")
    real_preadv = os.preadv
    calls = []

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        return real_preadv(fd, [buffers[0][:5]], offset)  # at most 5 bytes a call

    monkeypatch.setattr(os, "preadv", short)
    for rows, cols in (((0, 40), None), ((1, 39), (3, 17))):
        want = mm[rows[0] : rows[1]] if cols is None else mm[rows[0] : rows[1], cols[0] : cols[1]]
        dst = np.zeros(want.shape, np.float32).view(_DeviceArray)
        calls.clear()
        transfer.Stager(dev, chunk_bytes=4 * 30 * 8).load(dst, _file_block(mm, rows, cols), stream)
        _run_copies(stream)
        assert np.array_equal(np.asarray(dst), want)
        assert len(calls) >= want.nbytes / 5


@pytest.mark.parametrize("cols", [None, (2, 20)])
def test_a_truncated_file_raises_an_error_naming_it(monkeypatch, tmp_path, cols):
    import os

    dev, stream = _stand_in_gpu(monkeypatch, 3)
    path = tmp_path / "a.npy"
    mm = _npy(path, (40, 30), "float32")
    block = _file_block(mm, (0, 40), cols)
    os.truncate(path, mm.offset + mm.nbytes - 100)
    opened, closed = _count_opens(monkeypatch, path)
    dst = np.zeros(block.shape, np.float32).view(_DeviceArray)
    with pytest.raises(EOFError, match=f"{path} is truncated"):
        transfer.Stager(dev, chunk_bytes=4 * 30 * 8).load(dst, block, stream)
    assert len(opened) == 1 and closed == opened


def test_ready_buffers_gives_every_host_thread_its_own(monkeypatch):
    _stand_in_gpu(monkeypatch, 4)
    made: list[tuple[int, Any]] = []

    class Counted(transfer._Buffers):
        def __init__(self, nbytes: int) -> None:
            super().__init__(nbytes)
            made.append((threading.get_ident(), self))

    monkeypatch.setattr(transfer, "_Buffers", Counted)
    # One pool thread exists and is idle: without the barrier it could take every task.
    transfer._pool().submit(lambda: None).result()
    transfer.ready_buffers(1024)
    assert len(made) == 4 and len({thread for thread, _ in made}) == 4
    assert all(b.nbytes == 1024 for _, b in made)
    transfer.ready_buffers(1024)
    assert len(made) == 4  # each thread keeps its buffers


def test_the_chunk_size_comes_from_the_config(monkeypatch):
    dev, stream = _stand_in_gpu(monkeypatch, 2)
    src = np.arange(100 * 40, dtype=np.float32).reshape(100, 40)
    dst = np.zeros_like(src).view(_DeviceArray)
    # 10 rows of 40 float32 a chunk: 10 DMAs, each counted, and buffers of that size made ahead.
    with dask.config.set({"mgpu.transfer.chunk-bytes": 10 * 40 * 4}):
        counted: list[int] = []
        monkeypatch.setattr(dev, "count_copy", lambda kind, nbytes, *events: counted.append(nbytes))
        transfer.Stager(dev).load(dst, src, stream)
        transfer.ready_buffers()
    _run_copies(stream)
    assert np.array_equal(np.asarray(dst), src)
    assert counted == [10 * 40 * 4] * 10
    assert transfer._pool().submit(lambda: transfer._LOCAL.buffers.nbytes).result() == 10 * 40 * 4
    assert transfer.chunk_size() == 16 << 20  # outside the setting: mgpu.yaml's default
    with dask.config.set({"mgpu.transfer.chunk-bytes": "32MiB"}):
        assert transfer.chunk_size() == 32 << 20


@pytest.mark.parametrize("value", [0, -5, "lots", 1.5])
def test_a_bad_chunk_size_is_named(value):
    with dask.config.set({"mgpu.transfer.chunk-bytes": value}):
        with pytest.raises(ValueError, match="mgpu.transfer.chunk-bytes: .* is not a positive number of bytes"):
            transfer.chunk_size()


def test_ready_buffers_does_not_wait_for_a_busy_thread(monkeypatch):
    import time

    _stand_in_gpu(monkeypatch, 3)
    release = threading.Event()
    busy = transfer._pool().submit(release.wait)
    try:
        t = time.perf_counter()
        transfer.ready_buffers(1024, timeout=0.3)
        assert time.perf_counter() - t < 5
    finally:
        release.set()
        busy.result()


@pytest.mark.parametrize("method", ["pread", "mmap"])
def test_npy_source_reads_the_file_on_a_cpu_either_way(tmp_path, method):
    import dask.config

    from mgpu.sources import inspect_npy

    dev = _cpu_device()
    mat = _npy(tmp_path / "a.npy", (40, 30), "float32")
    vec = _npy(tmp_path / "x.npy", (1000,), "float64")
    a, x = NpySource(inspect_npy(mat.filename, key="a")), NpySource(inspect_npy(vec.filename, key="x"))
    with dask.config.set({"mgpu.transfer.read": method}):
        assert np.array_equal(a.read(dev, (5, 17), (3, 29)), mat[5:17, 3:29])
        assert np.array_equal(a.read(dev, (0, 40)), mat)
        assert np.array_equal(x.read(dev, (10, 990)), vec[10:990])


def test_the_read_method_defaults_to_auto_and_a_bad_one_names_the_key(tmp_path):
    import dask.config

    assert transfer.read_method() == "pread"
    assert transfer.read_method(contiguous=False) == "mmap"
    data = _npy(tmp_path / "a.npy", (4, 3), "float32")
    src = NpySource(NpyInfo(str(data.filename), data.shape, "float32", data.offset))
    with dask.config.set({"mgpu.transfer.read": "mapped"}):
        with pytest.raises(ValueError, match="mgpu.transfer.read: 'mapped' is not one of auto, pread, mmap"):
            src.read(_cpu_device(), (0, 4), (0, 3))


@pytest.mark.parametrize("method", ["pread", "mmap"])
@pytest.mark.parametrize("layout", ["C", "fortran", "big-endian"])
def test_npy_source_on_a_gpu_reads_by_pread_only_where_the_bytes_are_the_array(monkeypatch, tmp_path, method, layout):
    import os

    import dask.config

    from mgpu.sources import inspect_npy

    dev, stream = _stand_in_gpu(monkeypatch, 3)
    data = np.random.default_rng(5).standard_normal((40, 30)).astype(np.float32)
    if layout == "fortran":
        data = np.asfortranarray(data)
    elif layout == "big-endian":
        data = data.astype(">f4")
    np.save(tmp_path / "a.npy", data)
    src = NpySource(inspect_npy(tmp_path / "a.npy", key="a"))
    reads = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *args: reads.append(args) or real_preadv(*args))
    out = np.zeros((12, 26), np.float32).view(_DeviceArray)
    with dask.config.set({"mgpu.transfer.read": method}):
        src.read_into(dev, out, (5, 17), (3, 29))
    _run_copies(stream)
    assert np.array_equal(np.asarray(out), data[5:17, 3:29])
    assert bool(reads) == (method == "pread" and layout == "C")


@pytest.mark.parametrize(
    "rows, cols, by_pread",
    [
        ((5, 17), None, True),  # whole rows: one read per chunk
        ((5, 17), (0, 30), True),  # every column named: still whole rows
        ((5, 17), (3, 29), False),  # a column block: a read per row, so from the map
        ((0, 40), (0, 15), False),
    ],
)
def test_auto_reads_whole_rows_by_pread_and_a_column_block_from_the_map(monkeypatch, tmp_path, rows, cols, by_pread):
    import os

    from mgpu.sources import inspect_npy

    dev, stream = _stand_in_gpu(monkeypatch, 3)
    data = np.random.default_rng(6).standard_normal((40, 30)).astype(np.float32)
    np.save(tmp_path / "a.npy", data)
    src = NpySource(inspect_npy(tmp_path / "a.npy", key="a"))
    reads = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *args: reads.append(args) or real_preadv(*args))
    want = data[rows[0] : rows[1]] if cols is None else data[rows[0] : rows[1], cols[0] : cols[1]]
    out = np.zeros(want.shape, np.float32).view(_DeviceArray)
    src.read_into(dev, out, rows, cols)
    _run_copies(stream)
    assert np.array_equal(np.asarray(out), want)
    assert bool(reads) == by_pread


def test_a_failed_load_raises_only_once_no_chunk_reads_any_more(monkeypatch, tmp_path):
    # A chunk failing must not close the file under the chunks still reading it.
    import os

    dev, stream = _stand_in_gpu(monkeypatch, 3)
    mm = _npy(tmp_path / "a.npy", (40, 30), "float32")
    opened, closed = _count_opens(monkeypatch, tmp_path / "a.npy")
    real_preadv = os.preadv
    late = []
    failed = threading.Event()

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset == mm.offset:
            failed.set()
            raise OSError("bad sector")  # the first chunk's read fails at once
        assert failed.wait(30)  # the other chunks read after the failure, while the load unwinds
        if closed:
            late.append(offset)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    dst = np.zeros((40, 30), np.float32).view(_DeviceArray)
    with pytest.raises(OSError, match="bad sector"):
        transfer.Stager(dev, chunk_bytes=4 * 30 * 4).load(dst, _file_block(mm, (0, 40)), stream)
    # Every host thread at a barrier at once: each chunk the load left behind has run.
    threads = 3
    barrier = threading.Barrier(threads)
    for f in [transfer._pool().submit(barrier.wait, 30) for _ in range(threads)]:
        f.result()
    assert closed == opened and not late


def test_only_file_jobs_on_gpus_make_the_pinned_buffers_in_their_warm_up(monkeypatch, tmp_path):
    from mgpu.workloads.dot import Dot, DotParams

    readied = []
    monkeypatch.setattr(transfer, "ready_buffers", lambda: readied.append(1))
    from mgpu.workloads import dot
    from mgpu.workloads.matmul import workload as matmul

    for module in (dot, matmul):  # the warm-up's small tile
        monkeypatch.setattr(module, "run_tile", lambda workload, dev, tile: None)
    gpu = Device("cuda", None, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"))
    for name in ("x", "y"):
        np.save(tmp_path / f"{name}.npy", np.ones(10, np.float32))
    _, _, files = _files(tmp_path, 6, 5, 4)
    from_files = [
        Dot(DotParams(input={"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")})),
        Matmul(MatmulParams(input=files)),
    ]
    tiles = {Dot: Tile(0, {"n": (0, 10)}), Matmul: Tile(0, {"m": (0, 6), "n": (0, 4)}, args={"tk": 5})}
    for wl in from_files:
        wl.warmup(_cpu_device(), tiles[type(wl)])
        wl.warmup(gpu, tiles[type(wl)])
    for wl in (Dot(DotParams(n=10)), Matmul(MatmulParams(m=6, n=4, k=5))):
        wl.warmup(gpu, tiles[type(wl)])
    assert len(readied) == 2  # once per file job, on the GPU
