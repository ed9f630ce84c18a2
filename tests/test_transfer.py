"""Out-of-core pieces on the CPU: chunking and host copies, .npy reads and writes through
mgpu.worker.transfer, the PCIe byte counts and the bound of jobs whose data is on the host, and a
distributed matmul from files to a file on real CPU workers."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from itertools import pairwise
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import pytest
from conftest import npy_operands, submit_json, write_job
from distributed.diagnostics.plugin import SchedulerPlugin

from mgpu.client.result import _roofline
from mgpu.results import Throughput
from mgpu.tiling import Tile
from mgpu.worker import transfer
from mgpu.worker.device import Device, DeviceFacts
from mgpu.worker.sources import NpyInfo, NpySink, NpySource
from mgpu.workloads.matmul import Matmul, MatmulParams


def _cpu_device() -> Device:
    return Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))


@pytest.mark.parametrize(
    "rows,cols,itemsize,chunk", [(1000, 7, 4, 1024), (3, 10_000, 8, 64), (1, 1, 4, 4096), (17, 5, 2, 10)]
)
def test_chunks_cover_every_row_once_within_the_chunk_size(rows, cols, itemsize, chunk):
    chunks = transfer.chunk_rows((rows, cols), itemsize, chunk)
    assert chunks[0][0] == 0 and chunks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in pairwise(chunks))
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
    staging = transfer.HostStaging(4)
    try:
        transfer.host_copy(dst, src, staging)
    finally:
        staging.close()
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


def _files(tmp_path, m, k, n):
    return npy_operands(tmp_path, m, k, n, seed=7)


def _note_npy_reads(dask_worker: Any) -> None:
    """From now on note every block this worker reads from an .npy file: (file name, rows, cols)."""
    view = NpySource.view  # what a CPU worker reads every block through
    reads = dask_worker.npy_reads = []

    def noted(self: NpySource, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> Any:
        reads.append((Path(self.info.path).name, rows, cols))
        return view(self, rows, cols)

    NpySource.view = noted


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

    def __enter__(self) -> _LateStream:  # made current, as a CuPy stream is in a with block
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def synchronize(self) -> None:
        """Run every copy queued so far (what waiting for a CUDA stream means)."""
        done = _Event()
        done.record(self)
        done.synchronize()


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
    staging = transfer.HostStaging(threads)
    facts = DeviceFacts("cuda", 0, "gpu", 1, 1, "h")
    return Device("cuda", None, facts, new_stream=lambda: stream, staging=staging), stream


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


# -- .npy blocks on a GPU: whole rows by KvikIO, column blocks from the map ------------------


def _npy(path: Path, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Write an ``.npy`` of distinct values; returns its memory map."""
    mm = np.lib.format.open_memmap(str(path), mode="w+", dtype=dtype, shape=shape)
    mm[...] = np.random.default_rng(3).standard_normal(shape)
    mm.flush()
    del mm
    return np.load(path, mmap_mode="r")


def _stand_in_kvikio(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """mgpu.io.read on the stand-in device (its arrays are host memory): reads the range
    with os.pread, and records (path, offset, bytes) of each read."""
    import os

    from mgpu.worker import io

    reads: list[tuple[str, int, int]] = []
    real = io.read

    def read(path: str, offset: int, out: Any) -> float:
        reads.append((path, offset, out.nbytes))
        size = os.stat(path).st_size
        if offset + out.nbytes > size:
            return real(path, offset, out)  # the size check comes before KvikIO is needed
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), out.nbytes, offset)
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, np.uint8)
        return 0.25

    monkeypatch.setattr(io, "read", read)
    return reads


# (file shape, dtype, rows, cols, by KvikIO): whole rows are one range of the file.
_BLOCKS = [
    ((1001,), "float32", (13, 994), None, True),  # an element range of a 1-D file
    ((50, 37), "float64", (3, 46), None, True),  # full-width rows
    ((50, 37), "float64", (3, 46), (0, 37), True),  # every column named: still whole rows
    ((50, 37), "float16", (2, 49), (5, 29), False),  # a column block: a range a row
    ((50, 37), "float32", (0, 50), (0, 36), False),  # all but the last column
]


@pytest.mark.parametrize("shape,dtype,rows,cols,by_kvikio", _BLOCKS)
def test_whole_rows_go_by_kvikio_and_column_blocks_through_the_map(
    monkeypatch, tmp_path, shape, dtype, rows, cols, by_kvikio
):
    from mgpu.worker.sources import inspect_npy

    dev, stream = _stand_in_gpu(monkeypatch, 3)
    reads = _stand_in_kvikio(monkeypatch)
    mm = _npy(tmp_path / "a.npy", shape, dtype)
    want = mm[rows[0] : rows[1]] if cols is None else mm[rows[0] : rows[1], cols[0] : cols[1]]
    src = NpySource(inspect_npy(tmp_path / "a.npy", key="a"))
    out = np.zeros(want.shape, dtype).view(_DeviceArray)
    src.read_into(dev, out, rows, cols)
    _run_copies(stream)
    assert np.array_equal(np.asarray(out), want)
    width = shape[1] if len(shape) == 2 else 1
    itemsize = np.dtype(dtype).itemsize
    if by_kvikio:  # one read of exactly the block's bytes, counted with its time
        assert reads == [(src.info.path, mm.offset + rows[0] * width * itemsize, want.nbytes)]
        assert dev.bytes_h2d == want.nbytes and dev.copy_seconds()["h2d"] == pytest.approx(0.25)
    else:
        assert reads == [] and dev.bytes_h2d == want.nbytes


def test_a_kvikio_read_waits_for_the_work_already_on_the_stream(monkeypatch, tmp_path):
    # KvikIO copies on streams of its own: a staged copy still queued into the same memory
    # must land first, or it would overwrite what KvikIO read.
    from mgpu.worker.sources import inspect_npy

    dev, stream = _stand_in_gpu(monkeypatch, 2)
    _stand_in_kvikio(monkeypatch)
    mm = _npy(tmp_path / "a.npy", (40, 30), "float32")
    src = NpySource(inspect_npy(tmp_path / "a.npy", key="a"))
    out = np.zeros((10, 30), np.float32).view(_DeviceArray)
    transfer.Stager(dev, chunk_bytes=4 * 30 * 2).load(out, np.full((10, 30), 7, np.float32), stream)
    src.read_into(dev, out, (20, 30))
    _run_copies(stream)
    assert np.array_equal(np.asarray(out), mm[20:30])


@pytest.mark.parametrize("layout", ["fortran", "big-endian"])
def test_a_file_whose_bytes_are_not_the_array_is_read_through_the_map(monkeypatch, tmp_path, layout):
    from mgpu.worker.sources import inspect_npy

    dev, stream = _stand_in_gpu(monkeypatch, 3)
    reads = _stand_in_kvikio(monkeypatch)
    data = np.random.default_rng(5).standard_normal((40, 30)).astype(np.float32)
    data = np.asfortranarray(data) if layout == "fortran" else data.astype(">f4")
    np.save(tmp_path / "a.npy", data)
    src = NpySource(inspect_npy(tmp_path / "a.npy", key="a"))
    out = np.zeros((12, 30), np.float32).view(_DeviceArray)
    src.read_into(dev, out, (5, 17))
    _run_copies(stream)
    assert np.array_equal(np.asarray(out), data[5:17]) and reads == []


def test_a_truncated_file_raises_an_error_naming_it(monkeypatch, tmp_path):
    import os

    from mgpu.worker.sources import InputChanged, inspect_npy

    dev, _ = _stand_in_gpu(monkeypatch, 2)
    _stand_in_kvikio(monkeypatch)
    path = tmp_path / "a.npy"
    mm = _npy(path, (40, 30), "float32")
    info = inspect_npy(path, key="a")
    os.truncate(path, mm.offset + mm.nbytes - 100)
    out = np.zeros((40, 30), np.float32).view(_DeviceArray)
    # Each read first checks the file is the one whose header was read...
    with pytest.raises(InputChanged, match=f"a: {path} was truncated"):
        NpySource(info).read_into(dev, out, (0, 40))
    # ...and a file truncated after that check still ends the read with an error naming it.
    with pytest.raises(EOFError, match=f"{path} is truncated"):
        NpySource(dataclasses.replace(info, stamp=None)).read_into(dev, out, (0, 40))


def test_kvikio_reads_whole_rows_only(monkeypatch, tmp_path):
    from mgpu.worker.sources import inspect_npy

    dev, _ = _stand_in_gpu(monkeypatch, 2)
    _npy(tmp_path / "a.npy", (40, 30), "float32")
    src = NpySource(inspect_npy(tmp_path / "a.npy", key="a"))
    with dask.config.set({"mgpu.io.read": "kvikio"}):
        with pytest.raises(ValueError, match="mgpu.io.read: kvikio reads whole rows only"):
            src.read_into(dev, np.zeros((40, 10), np.float32).view(_DeviceArray), (0, 40), (0, 10))


def test_ready_buffers_gives_every_host_thread_its_own(monkeypatch):
    dev, _ = _stand_in_gpu(monkeypatch, 4)
    made: list[tuple[int, Any]] = []

    class Counted(transfer._Buffers):
        def __init__(self, nbytes: int) -> None:
            super().__init__(nbytes)
            made.append((threading.get_ident(), self))

    monkeypatch.setattr(transfer, "_Buffers", Counted)
    # One pool thread exists and is idle: without the barrier it could take every task.
    dev.staging.pool.submit(lambda: None).result()
    dev.staging.ready_buffers(1024)
    assert len(made) == 4 and len({thread for thread, _ in made}) == 4
    assert all(b.nbytes == 1024 for _, b in made)
    dev.staging.ready_buffers(1024)
    assert len(made) == 4 and dev.staging.buffer_count == 4  # each thread keeps its buffers
    # Closing the staging stops its threads and lets every buffer go, once its copies ran.
    import sys
    from types import SimpleNamespace

    drained: list[Any] = []
    pinned_freed: list[int] = []
    pinned_pool = SimpleNamespace(free_all_blocks=lambda: pinned_freed.append(1))
    monkeypatch.setattr(sys.modules["cupy"], "get_default_pinned_memory_pool", lambda: pinned_pool, raising=False)
    monkeypatch.setattr(Counted, "drain", lambda self: drained.append(self), raising=False)
    dev.staging.close()
    assert sorted(map(id, drained)) == sorted(id(b) for _, b in made)
    assert dev.staging.buffer_count == 0 and pinned_freed == [1]


def test_the_chunk_size_comes_from_the_config(monkeypatch):
    dev, stream = _stand_in_gpu(monkeypatch, 2)
    src = np.arange(100 * 40, dtype=np.float32).reshape(100, 40)
    dst = np.zeros_like(src).view(_DeviceArray)
    # 10 rows of 40 float32 a chunk: 10 DMAs, each counted, and buffers of that size made ahead.
    with dask.config.set({"mgpu.transfer.chunk-bytes": 10 * 40 * 4}):
        counted: list[int] = []
        monkeypatch.setattr(dev, "count_copy", lambda kind, nbytes, *events: counted.append(nbytes))
        transfer.Stager(dev).load(dst, src, stream)
        dev.staging.ready_buffers()
    _run_copies(stream)
    assert np.array_equal(np.asarray(dst), src)
    assert counted == [10 * 40 * 4] * 10
    assert dev.staging.pool.submit(lambda: dev.staging.buffers(1).nbytes).result() == 10 * 40 * 4
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

    dev, _ = _stand_in_gpu(monkeypatch, 3)
    release = threading.Event()
    busy = dev.staging.pool.submit(release.wait)
    try:
        t = time.perf_counter()
        dev.staging.ready_buffers(1024, timeout=0.3)
        assert time.perf_counter() - t < 5
    finally:
        release.set()
        busy.result()


def _stand_in_kvikio_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """mgpu.io.write on the stand-in device: writes the range with os.pwrite, and records
    (path, offset, bytes) of each write."""
    import os

    from mgpu.worker import io

    writes: list[tuple[str, int, int]] = []

    def write(path: str, offset: int, data: Any) -> float:
        assert data.flags.c_contiguous
        writes.append((path, offset, data.nbytes))
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, np.asarray(data).tobytes(), offset)
        finally:
            os.close(fd)
        return 0.5

    monkeypatch.setattr(io, "write", write)
    return writes


@pytest.mark.parametrize("method", ["kvikio", "mmap", "pwrite"])
def test_whole_rows_of_an_output_go_by_kvikio_and_column_blocks_through_the_map(monkeypatch, tmp_path, method):
    from mgpu.worker.sources import NpySink

    dev, stream = _stand_in_gpu(monkeypatch, 2)
    writes = _stand_in_kvikio_writes(monkeypatch)
    sink = NpySink.for_path(str(tmp_path / "c.npy"), (30, 20), "float64")
    sink.create()
    want = np.random.default_rng(5).standard_normal((30, 20))
    with dask.config.set({"mgpu.io.write": method}):
        sink.write((slice(4, 30), slice(None)), want[4:].copy().view(_DeviceArray), dev)
        sink.write((slice(0, 4), slice(0, 20)), want[:4].copy().view(_DeviceArray), dev)  # every column named
        sink.write((slice(0, 30), slice(5, 9)), want[:, 5:9].copy().view(_DeviceArray), dev)  # a column block
    _run_copies(stream)
    sink.commit()
    assert np.array_equal(np.load(tmp_path / "c.npy"), want)
    if method == "kvikio":  # one write a block of whole rows, of exactly its bytes, at its rows' offset
        assert writes == [(sink.partial, sink.offset + 4 * 160, 26 * 160), (sink.partial, sink.offset, 4 * 160)]
    else:
        assert writes == []
    assert dev.bytes_d2h == want.nbytes + 30 * 4 * 8


@pytest.mark.parametrize("threads", [1, 3])
def test_a_device_array_written_into_a_file_lands_chunk_by_chunk_at_its_offset(monkeypatch, tmp_path, threads):
    import os

    dev, stream = _stand_in_gpu(monkeypatch, threads)
    src = np.arange(50 * 12, dtype=np.float64).reshape(50, 12).view(_DeviceArray)
    path = tmp_path / "out.bin"
    path.write_bytes(b"\xff" * (100 + src.nbytes + 10))
    fd = os.open(path, os.O_WRONLY)
    try:  # chunks of 1000 bytes: 4 whole ones and a short last one
        assert transfer.Stager(dev, chunk_bytes=1000).write(fd, 100, src, stream) == src.nbytes
    finally:
        os.close(fd)
    raw = path.read_bytes()
    assert raw[:100] == b"\xff" * 100
    assert np.array_equal(np.frombuffer(raw[100:-10], np.float64).reshape(50, 12), src)
    assert raw[-10:] == b"\xff" * 10
    assert dev.bytes_d2h == src.nbytes and dev.copy_seconds()["d2h"] == pytest.approx(0.005)


def test_an_output_written_by_kvikio_after_the_job_was_given_up_is_not_made_again(monkeypatch, tmp_path):
    from mgpu.worker.sources import NpySink

    dev, _ = _stand_in_gpu(monkeypatch, 2)
    _stand_in_kvikio_writes(monkeypatch)
    sink = NpySink.for_path(str(tmp_path / "c.npy"), (3, 2), "float32")
    sink.create()
    sink.discard()
    sink.write((slice(0, 3), slice(None)), np.ones((3, 2), np.float32).view(_DeviceArray), dev)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("method", ["kvikio", "mmap"])
def test_npy_source_reads_the_file_on_a_cpu_either_way(tmp_path, method):
    from mgpu.worker.sources import inspect_npy

    dev = _cpu_device()
    mat = _npy(tmp_path / "a.npy", (40, 30), "float32")
    vec = _npy(tmp_path / "x.npy", (1000,), "float64")
    a, x = NpySource(inspect_npy(mat.filename, key="a")), NpySource(inspect_npy(vec.filename, key="x"))
    with dask.config.set({"mgpu.io.read": method}):
        assert np.array_equal(a.read(dev, (5, 17), (3, 29)), mat[5:17, 3:29])
        assert np.array_equal(a.read(dev, (0, 40)), mat)
        assert np.array_equal(x.read(dev, (10, 990)), vec[10:990])


def test_the_io_settings_default_and_a_bad_one_names_its_key(monkeypatch, tmp_path):
    from mgpu.worker import io

    assert (io.read_method(), io.read_method(contiguous=False)) == ("kvikio", "mmap")
    assert (io.threads(), io.task_size()) == (16, 8 << 20)
    with dask.config.set({"mgpu.io.threads": 8, "mgpu.io.task-size": "16MiB", "mgpu.io.read": "mmap"}):
        assert (io.threads(), io.task_size(), io.read_method()) == (8, 16 << 20, "mmap")
    dev, _ = _stand_in_gpu(monkeypatch, 2)
    data = _npy(tmp_path / "a.npy", (4, 3), "float32")
    src = NpySource(NpyInfo(str(data.filename), data.shape, "float32", data.offset))
    with dask.config.set({"mgpu.io.read": "mapped"}):
        with pytest.raises(ValueError, match="mgpu.io.read: 'mapped' is not one of auto, kvikio, mmap"):
            src.read_into(dev, np.zeros((4, 3), np.float32).view(_DeviceArray), (0, 4))


def test_only_file_jobs_on_gpus_make_their_readers_ready_in_their_warm_up(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from mgpu.worker import io
    from mgpu.workloads.dot import Dot, DotParams
    from mgpu.workloads.dot import workload as dot
    from mgpu.workloads.matmul import workload as matmul

    readied: list[Any] = []
    monkeypatch.setattr(io, "warm_up", lambda path, offset, nbytes: readied.append(("kvikio", Path(path).name)))
    for module in (dot, matmul):  # the warm-up's small tile
        monkeypatch.setattr(module, "run_tile", lambda workload, dev, tile: None)
    gpu = Device("cuda", None, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"))
    gpu.staging = SimpleNamespace(ready_buffers=lambda **kw: readied.append("stager"))  # type: ignore[assignment]
    for name in ("x", "y"):
        np.save(tmp_path / f"{name}.npy", np.ones(10, np.float32))
    _, _, files = _files(tmp_path, 6, 5, 4)
    from_files = [
        Dot(DotParams(input={"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")})),
        Matmul(MatmulParams(input=files)),
    ]
    tiles = {"dot": Tile(0, {"n": (0, 10)}), "matmul": Tile(0, {"m": (0, 6), "n": (0, 4)}, args={"tk": 5})}
    for wl in from_files:
        wl.warmup(_cpu_device(), tiles[wl.name])
        wl.warmup(gpu, tiles[wl.name])
    for wl in (Dot(DotParams(n=10)), Matmul(MatmulParams(m=6, n=4, k=5))):
        wl.warmup(gpu, tiles[wl.name])
    # The dot reads whole ranges (KvikIO); the matmul A's rows by KvikIO and column blocks staged.
    assert readied == [("kvikio", "x.npy"), ("kvikio", "a.npy"), "stager"]


def _stand_in_kvikio_module(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """A stand-in for the kvikio package whose reads fill host arrays (recorded as
    (file name, offset, bytes) in the order they are started)."""
    import os
    import sys
    from types import SimpleNamespace

    started: list[tuple[str, int, int]] = []

    class Future:
        def __init__(self, fn: Any) -> None:
            self.fn, self.value = fn, None

        def get(self) -> int:
            if self.value is None:
                self.value = self.fn()
            return self.value

        def done(self) -> bool:
            return self.value is not None

    class CuFile:
        def __init__(self, path: str, flags: str = "r") -> None:
            self.path, self.fd = path, os.open(path, os.O_RDONLY)

        def pread(self, out: Any, size: int, offset: int) -> Future:
            started.append((Path(self.path).name, offset, size))

            def run() -> int:
                data = os.pread(self.fd, size, offset)
                out.reshape(-1).view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
                return len(data)

            return Future(run)

        def close(self) -> None:
            os.close(self.fd)

    settings: dict[str, Any] = {}
    kvikio = SimpleNamespace(CuFile=CuFile, defaults=SimpleNamespace(set=settings.update, get=settings.get))
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", kvikio.defaults)
    return started


def test_a_dot_from_files_on_a_gpu_reduces_each_piece_as_it_lands(monkeypatch, tmp_path):
    import math

    from mgpu.tiling import Tile
    from mgpu.workloads.dot import Dot, DotParams
    from mgpu.workloads.dot import workload as dot

    dev, _ = _stand_in_gpu(monkeypatch, 2)
    dev.xp = np  # arrays in host memory stand in for device arrays; the kernels are NumPy's
    started = _stand_in_kvikio_module(monkeypatch)
    monkeypatch.setattr(dot, "_PIECE_BYTES", 4096 * 4)
    monkeypatch.setattr(dot, "_PIECE_ALIGN", 1024)
    n = 10_000
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    y = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    job = Dot(DotParams(input={"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")}))
    seen = []
    monkeypatch.setattr(dot, "dot_f64", lambda xp, a, b: seen.append(len(a)) or float(np.dot(a.astype(float), b)))
    from mgpu.worker.tile import run_tile

    record = run_tile(job, dev, Tile(0, {"n": (1000, 9500)}))
    # Pieces of 4096 elements (x then y of each), all started at once, each reduced as it landed.
    off = np.load(tmp_path / "x.npy", mmap_mode="r").offset
    want = [
        (f, off + 4 * a, 4 * (b - a)) for a, b in ((1000, 5096), (5096, 9192), (9192, 9500)) for f in ("x.npy", "y.npy")
    ]
    assert started == want and seen == [4096, 4096, 308]
    assert math.isclose(record.value, float(np.dot(x[1000:9500].astype(float), y[1000:9500])), rel_tol=1e-12)
    assert record.verify_ok and dev.bytes_h2d == 2 * 4 * 8500


def test_reads_in_order_check_every_file_before_any_starts(monkeypatch, tmp_path):
    import os

    from mgpu.worker import io

    started = _stand_in_kvikio_module(monkeypatch)
    _npy(tmp_path / "x.npy", (1000,), "float32")
    _npy(tmp_path / "y.npy", (1000,), "float32")
    os.truncate(tmp_path / "y.npy", 1000)  # its 400 elements from byte 128 would end at 1728
    out = [np.zeros(400, np.float32) for _ in range(2)]
    with pytest.raises(EOFError, match="y.npy is truncated"):
        list(io.read_in_order([(str(tmp_path / "x.npy"), 128, out[0]), (str(tmp_path / "y.npy"), 128, out[1])]))
    assert started == []


def test_kvikio_is_set_from_the_io_settings_only_when_its_own_differ(monkeypatch):
    # Setting KvikIO's thread count remakes its pool, under any read another thread has going.
    import sys
    from types import SimpleNamespace

    from mgpu.worker import io

    settings: dict[str, Any] = {"num_threads": 1, "task_size": 1 << 20}
    calls: list[dict[str, Any]] = []

    def record(new: dict[str, Any]) -> None:
        calls.append(dict(new))
        settings.update(new)

    kvikio = SimpleNamespace(defaults=SimpleNamespace(set=record, get=settings.get))
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", kvikio.defaults)
    io._kvikio()
    io._kvikio()
    assert calls == [{"num_threads": 16, "task_size": 8 << 20}]
    with dask.config.set({"mgpu.io.threads": 4}):
        io._kvikio()
    assert calls[1:] == [{"num_threads": 4, "task_size": 8 << 20}]


def test_a_thin_block_is_spread_over_every_host_thread(monkeypatch):
    dev, stream = _stand_in_gpu(monkeypatch, 3)
    counted: list[int] = []
    monkeypatch.setattr(dev, "count_copy", lambda kind, nbytes, *events: counted.append(nbytes))
    src = np.arange(2048 * 4096, dtype=np.float32).reshape(2048, 4096)[:, :1024]  # 8 MiB, strided rows
    for spread, chunks in ((False, 1), (True, 4)):  # 16 MiB chunks; or 8 MiB / 3 threads, whole rows
        counted.clear()
        dst = np.zeros((2048, 1024), np.float32).view(_DeviceArray)
        transfer.load(dev, src, dst, spread=spread)
        _run_copies(stream)
        assert np.array_equal(np.asarray(dst), src) and len(counted) == chunks and sum(counted) == src.nbytes
