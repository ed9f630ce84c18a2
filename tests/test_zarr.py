"""Zarr stores in and out: matmul and dot read stores of any chunks, outputs are stores that
zarr reads back equal to the .npy outputs, a failed job leaves no store, bad stores exit 2."""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import invoke, submit_json, write_job

from mgpu import paths
from mgpu.worker import stores
from mgpu.worker.device import Device, DeviceFacts
from mgpu.worker.stores import ZarrSink, ZarrSource, chunk_pieces, inspect_zarr

zarr = pytest.importorskip("zarr")


def _store(path, arr, chunks, *, compressed=False):
    """``arr`` as a Zarr store of ``chunks``: uncompressed, or zstd (zarr's default)."""
    kw = {} if compressed else {"compressors": None}
    z = zarr.create_array(str(path), shape=arr.shape, chunks=chunks, dtype=arr.dtype, **kw)
    z[...] = arr
    return str(path)


def _cpu_device():
    return Device("cpu", np, DeviceFacts(backend="cpu", id=0, name="cpu", memory=1 << 30, free=1 << 30, host="h"))


def _run(tmp_path, scheduler, doc, name="job"):
    job = write_job(tmp_path / f"{name}.yaml", doc)
    res, data = submit_json(job, tmp_path / f"{name}.json", "--scheduler", scheduler)
    assert res.code == 0, res.output
    return data


def test_pieces_cover_a_block_once_each_in_its_chunks():
    pieces = chunk_pieces((4, 5), ((3, 9), (2, 11)))
    # rows 3:9 meet row chunks 0, 1, 2; columns 2:11 meet column chunks 0, 1, 2
    assert [p.coords for p in pieces] == [(i, j) for i in range(3) for j in range(3)]
    covered = np.zeros((6, 9), int)
    for p in pieces:
        (o0, o1), (q0, q1) = p.outer
        (i0, i1), (j0, j1) = p.inner
        assert (o1 - o0, q1 - q0) == (i1 - i0, j1 - j0)
        assert 0 <= i0 < i1 <= 4 and 0 <= j0 < j1 <= 5
        covered[o0:o1, q0:q1] += 1
    assert (covered == 1).all()


@pytest.mark.parametrize(
    "chunks,compressed",
    [((8, 5), False), ((37, 29), False), ((6, 7), True), ((4, 4), False), ((10, 29), False)],
)
def test_a_source_reads_any_block_of_any_chunks(tmp_path, chunks, compressed):
    x = np.random.default_rng(1).standard_normal((37, 29)).astype("float32")
    info = inspect_zarr(_store(tmp_path / "x.zarr", x, chunks, compressed=compressed), key="input.a")
    assert info.raw is not compressed
    src, dev = ZarrSource(info), _cpu_device()
    for rows, cols in [((0, 37), (0, 29)), ((3, 20), (4, 27)), ((36, 37), (28, 29)), ((8, 16), (5, 10))]:
        np.testing.assert_array_equal(src.read(dev, rows, cols), x[rows[0] : rows[1], cols[0] : cols[1]])


def test_chunks_never_written_read_as_the_fill_value(tmp_path):
    z = zarr.create_array(str(tmp_path / "x.zarr"), shape=(10, 6), chunks=(4, 6), dtype="float64", compressors=None)
    z.fill_value  # noqa: B018
    z[4:8] = 3.0  # only the second chunk has an object
    src = ZarrSource(inspect_zarr(str(tmp_path / "x.zarr"), key="input.a"))
    got = src.read(_cpu_device(), (2, 10), (0, 6))
    np.testing.assert_array_equal(got, zarr.open_array(str(tmp_path / "x.zarr"))[2:10])


@pytest.mark.parametrize(
    "a_chunks,b_chunks,compressed",
    [
        ((8, 10), (10, 12), False),  # on the tiles' boundaries
        ((7, 9), (11, 5), False),  # dividing no tile: blocks read across chunks
        ((6, 11), (13, 23), True),  # zstd: decoded on the host
    ],
)
def test_matmul_from_stores_matches_numpy_and_its_store_the_npy_output(
    tmp_path, scheduler, a_chunks, b_chunks, compressed
):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((29, 31))
    b = rng.standard_normal((31, 23))
    inputs = {
        "a": _store(tmp_path / "a.zarr", a, a_chunks, compressed=compressed),
        "b": _store(tmp_path / "b.zarr", b, b_chunks, compressed=compressed),
    }
    base = {"workload": "matmul", "tiling": {"m": 8, "k": 10}}
    data = _run(tmp_path, scheduler, {**base, "params": {"input": inputs, "output": str(tmp_path / "c.zarr")}})
    p = data["job"]["params"]
    assert (p["m"], p["n"], p["k"], p["dtype"]) == (29, 23, 31, "float64")  # from the stores
    assert data["outputs"] == [str(tmp_path / "c.zarr")]
    c = zarr.open_array(str(tmp_path / "c.zarr"), mode="r")
    assert c.shape == (29, 23) and c.dtype == np.float64
    np.testing.assert_allclose(c[...], a @ b, rtol=1e-12, atol=1e-12)
    # The same job with an .npy output writes the same numbers.
    _run(tmp_path, scheduler, {**base, "params": {"input": inputs, "output": str(tmp_path / "c.npy")}}, "npy")
    np.testing.assert_array_equal(c[...], np.load(tmp_path / "c.npy"))
    assert not [n for n in os.listdir(tmp_path) if "partial" in n]


@pytest.mark.parametrize("operands", ["streamed", "distributed"])
def test_matmuls_streamed_and_of_panels_read_stores_and_write_one(tmp_path, scheduler, operands):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((300, 200)), rng.standard_normal((200, 150))
    inputs = {
        "a": _store(tmp_path / "a.zarr", a, (64, 48)),
        "b": _store(tmp_path / "b.zarr", b, (48, 50), compressed=True),
    }
    params = {"input": inputs, "output": str(tmp_path / "c.zarr"), "operands": operands}
    doc = {"workload": "matmul", "params": params, "cluster": {"memory_limit": "1MB"}}
    data = _run(tmp_path, scheduler, doc)
    assert data["plan"]["tiles"] >= 2  # the budget cut the job
    np.testing.assert_allclose(zarr.open_array(str(tmp_path / "c.zarr"), mode="r")[...], a @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk,compressed", [(1000, False), (4096, True), (10007, False)])
def test_dot_from_stores_matches_numpy(tmp_path, scheduler, chunk, compressed):
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal(10007).astype("float32"), rng.standard_normal(10007).astype("float32")
    inputs = {
        "x": _store(tmp_path / "x.zarr", x, (chunk,), compressed=compressed),
        "y": _store(tmp_path / "y.zarr", y, (chunk,), compressed=compressed),
    }
    data = _run(tmp_path, scheduler, {"workload": "dot", "params": {"input": inputs}, "tiling": {"n": 3000}})
    want = float(np.dot(x.astype(np.float64), y.astype(np.float64)))
    assert data["value"] == pytest.approx(want, rel=1e-9)
    assert data["job"]["params"]["n"] == 10007


def test_mandelbrot_counts_as_a_store_equal_the_npy_counts(tmp_path, scheduler):
    params = {"width": 61, "height": 47, "max_iter": 50}
    for name, output in [("zarr", {"zarr": str(tmp_path / "m.zarr")}), ("npy", {"npy": str(tmp_path / "m.npy")})]:
        _run(tmp_path, scheduler, {"workload": "mandelbrot", "params": {**params, "output": output}}, name)
    counts = zarr.open_array(str(tmp_path / "m.zarr"), mode="r")
    assert counts.dtype == np.int32
    np.testing.assert_array_equal(counts[...], np.load(tmp_path / "m.npy"))


def test_a_sink_takes_writes_of_tiles_that_share_chunks(tmp_path):
    sink = ZarrSink.for_path(str(tmp_path / "c.zarr"), (10, 7), "float32")
    sink = ZarrSink(sink.path, sink.shape, sink.dtype, (4, 3), sink.partial)  # chunks no tile fits
    sink.create()
    want = np.arange(70, dtype="float32").reshape(10, 7)
    for r0, r1, c0, c1 in [(0, 5, 0, 4), (0, 5, 4, 7), (5, 10, 0, 7)]:
        sink.write((slice(r0, r1), slice(c0, c1)), want[r0:r1, c0:c1])
    assert not os.path.exists(sink.path)  # nothing under the name until the commit
    sink.commit()
    np.testing.assert_array_equal(zarr.open_array(sink.path, mode="r")[...], want)
    assert os.listdir(tmp_path) == ["c.zarr"]


def test_force_replaces_an_older_store_whole(tmp_path, scheduler):
    out = tmp_path / "c.zarr"
    _store(out, np.ones((3, 3)), (3, 3))
    doc = {"workload": "matmul", "params": {"m": 12, "n": 10, "k": 8, "dtype": "float64", "output": str(out)}}
    res = invoke("submit", write_job(tmp_path / "job.yaml", doc), "--scheduler", scheduler, "-q")
    assert res.code == 2 and "params.output" in res.output and "already exists" in res.output
    res = invoke("submit", tmp_path / "job.yaml", "--scheduler", scheduler, "-q", "--force")
    assert res.code == 0, res.output
    assert zarr.open_array(str(out), mode="r").shape == (12, 10)
    for thread in threading.enumerate():  # the older store goes on a thread of its own (mgpu.paths.publish)
        if thread.name == paths.REPLACED_THREAD:
            thread.join()
    assert sorted(os.listdir(tmp_path)) == ["c.zarr", "job.yaml"]


def _bad_store(tmp_path, kind):
    a = tmp_path / "a.zarr"
    if kind == "missing":
        return str(a), "input.a: store"
    if kind == "group":
        zarr.open_group(str(a), mode="w")
        return str(a), "is not a readable Zarr array"
    if kind == "dtype":
        _store(a, np.ones((6, 5), "int32"), (3, 5))
        return str(a), "holds int32; allowed: float16, float32, float64"
    if kind == "shape":
        _store(a, np.ones((6, 4)), (3, 4))
        return str(a), "a's axis 1 and b's axis 0 are both k"
    if kind == "chunk":
        _store(a, np.ones((6, 5)), (3, 5))
        with open(a / "c" / "1" / "0", "r+b") as f:
            f.truncate(17)
        return str(a), "chunk c/1/0 of"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "group", "dtype", "shape", "chunk"])
def test_bad_stores_exit_2_naming_the_key(tmp_path, scheduler, kind):
    path, message = _bad_store(tmp_path, kind)
    b = _store(tmp_path / "b.zarr", np.ones((5, 4)), (5, 4))
    doc = {"workload": "matmul", "params": {"input": {"a": path, "b": b}, "output": str(tmp_path / "c.zarr")}}
    res = invoke("submit", write_job(tmp_path / "job.yaml", doc), "--scheduler", scheduler, "-q")
    assert res.code == 2, res.output
    assert "input" in res.output and message in res.output and "Traceback" not in res.output
    assert not os.path.exists(tmp_path / "c.zarr")


def test_a_chunk_that_cannot_be_decoded_fails_the_job_with_exit_2_and_keeps_no_store(tmp_path, scheduler):
    a = _store(tmp_path / "a.zarr", np.ones((12, 8)), (4, 8), compressed=True)
    b = _store(tmp_path / "b.zarr", np.ones((8, 6)), (8, 6), compressed=True)
    with open(tmp_path / "a.zarr" / "c" / "2" / "0", "wb") as f:
        f.write(b"not zstd at all")
    doc = {"workload": "matmul", "params": {"input": {"a": a, "b": b}, "output": str(tmp_path / "c.zarr")}}
    res = invoke("submit", write_job(tmp_path / "job.yaml", doc), "--scheduler", scheduler, "-q")
    assert res.code == 2, res.output
    assert "input.a" in res.output and str(tmp_path / "a.zarr") in res.output
    assert sorted(os.listdir(tmp_path)) == ["a.zarr", "b.zarr", "job.yaml"]  # no store, no partial


def test_without_zarr_a_store_exits_2_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zarr", None)  # import zarr raises ImportError
    doc = {"workload": "matmul", "params": {"m": 4, "n": 4, "k": 4, "output": str(tmp_path / "c.zarr")}}
    res = invoke("submit", write_job(tmp_path / "job.yaml", doc), "--backend", "cpu", "-q")
    assert res.code == 2 and "params.output" in res.output and "pip install 'mgpu[zarr]'" in res.output
    assert sorted(os.listdir(tmp_path)) == ["job.yaml"]


def _facts(n):
    return {f"tcp://127.0.0.1:{9000 + i}": DeviceFacts("cpu", i, "cpu", 1 << 30, 1 << 30, "host") for i in range(n)}


def test_tiles_of_stores_fall_on_their_chunks(tmp_path):
    from mgpu.workloads.dot import Dot, DotParams
    from mgpu.workloads.matmul import Matmul, MatmulParams

    a = _store(tmp_path / "a.zarr", np.ones((1200, 500), "float32"), (64, 48))
    b = _store(tmp_path / "b.zarr", np.ones((500, 1100), "float32"), (48, 50))
    mm = Matmul(MatmulParams(input={"a": a, "b": b}))
    plan = mm.plan(_facts(2), 4_000_000, {})
    assert len(plan.tiles) > 2  # the budget cut the job
    assert all(t.bounds["m"][0] % 64 == 0 and t.bounds["n"][0] % 50 == 0 for t in plan.tiles)
    assert plan.tile_shape["k"] % 48 == 0 or plan.tile_shape["k"] == 500
    x = _store(tmp_path / "x.zarr", np.ones(100_000, "float32"), (3000,))
    y = _store(tmp_path / "y.zarr", np.ones(100_000, "float32"), (3000,))
    plan = Dot(DotParams(input={"x": x, "y": y})).plan(_facts(2), 200_000, {})
    assert len(plan.tiles) > 2
    assert all(t.bounds["n"][0] % 3000 == 0 for t in plan.tiles)


def test_a_job_stopped_mid_way_leaves_no_store(tmp_path):
    import signal
    import subprocess
    from pathlib import Path

    from conftest import wait_for
    from test_multinode import ROOT, TILE_DELAY_S

    doc = {
        "workload": "matmul",
        "params": {"m": 96, "n": 64, "k": 24, "dtype": "float64", "output": str(tmp_path / "c.zarr")},
        "tiling": {"m": 12, "n": 32},
    }
    job = write_job(tmp_path / "job.yaml", doc)
    slow = [sys.executable, str(Path(__file__).with_name("slow_mgpu.py")), str(TILE_DELAY_S)]
    cmd = [*slow, "submit", str(job), "--backend", "cpu", "--devices", "2", "--no-dashboard"]

    def a_tile_written(proc):
        assert proc.poll() is None, proc.communicate()
        for chunk in tmp_path.glob(".c.zarr.*.partial/c/*/*"):
            if any(chunk.read_bytes()):
                return True
        return False

    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        wait_for(lambda: a_tile_written(proc), 120, "a written tile")
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stdout + stderr
    assert sorted(os.listdir(tmp_path)) == ["job.yaml"]  # no store, no temporary one


def _fake_gpu(monkeypatch):
    """A device that says it is a GPU, its arrays NumPy's: the store's GPU path with a
    stand-in for KvikIO that reads into host arrays and the stager's copies done on the
    host, each one recorded. It has no ``empty``: a read that made a device buffer fails."""
    from test_transfer import _stand_in_kvikio_module

    _stand_in_kvikio_module(monkeypatch)
    seen = {"direct": [], "staged": [], "counted": []}
    real_started = stores.io.started

    def started(requests):
        seen["direct"] += [(path, offset, out.nbytes) for path, offset, out in requests]
        return real_started(requests)

    def load_pieces(dev, pieces, *, spread=False):
        for dst, src in pieces:
            assert isinstance(src.base, np.memmap) or isinstance(src, np.memmap)  # a view of the chunk's map
            seen["staged"].append(src.nbytes)
            np.copyto(dst, src)
        return sum(dst.nbytes for dst, _ in pieces)

    monkeypatch.setattr(stores.io, "started", started)
    monkeypatch.setattr(stores.transfer, "load_pieces", load_pieces)
    dev = SimpleNamespace(
        is_gpu=True,
        xp=SimpleNamespace(),
        synchronize=lambda: None,
        on_stream=contextlib.nullcontext,
        count_read=lambda kind, nbytes, seconds: seen["counted"].append(nbytes),
    )
    return dev, seen


@pytest.mark.parametrize("chunks", [(128, 517), (100, 64), (3001, 517), (7, 600)])
def test_the_gpu_reader_puts_every_piece_in_place(tmp_path, monkeypatch, chunks):
    dev, seen = _fake_gpu(monkeypatch)
    data = np.random.default_rng(2).standard_normal((3001, 517)).astype(np.float32)
    z = zarr.create_array(
        str(tmp_path / "a.zarr"), shape=data.shape, chunks=chunks, dtype="float32", compressors=None, fill_value=7.0
    )
    z[...] = data
    # One chunk never written: read as the fill value.
    if os.path.exists(tmp_path / "a.zarr" / "c" / "1" / "0"):
        os.unlink(tmp_path / "a.zarr" / "c" / "1" / "0")
    want = z[...]
    src = ZarrSource(inspect_zarr(str(tmp_path / "a.zarr"), key="a"))
    blocks = [((17, 2999), None), ((5, 3000), (3, 500)), ((0, 3001), (0, 517))]
    if 2 * chunks[0] <= 3001:  # exactly the second row of chunks, its first column of chunks
        blocks.append(((chunks[0], 2 * chunks[0]), (0, min(517, chunks[1]))))
    for rows, cols in blocks:
        c = cols or (0, 517)
        got = np.full((rows[1] - rows[0], c[1] - c[0]), np.nan, np.float32)
        src.read_into(dev, got, rows, cols)
        np.testing.assert_array_equal(got, want[rows[0] : rows[1], c[0] : c[1]])
    assert sum(seen["counted"]) == sum(n for _, _, n in seen["direct"])  # every KvikIO read counted
    assert seen["direct"] or chunks[1] != 517  # chunks as wide as the array: whole rows in place


def test_a_block_narrower_than_its_chunks_moves_its_own_bytes_only(tmp_path, monkeypatch):
    # The streamed matmul's blocks of A are 1024 columns of chunks 2048 wide, and the
    # first ones 256: each piece copies its own columns, no chunk rows whole.
    dev, seen = _fake_gpu(monkeypatch)
    data = np.arange(64 * 40, dtype=np.float32).reshape(64, 40)
    src = ZarrSource(inspect_zarr(_store(tmp_path / "a.zarr", data, (16, 20)), key="a"))
    for cols in [(0, 10), (10, 20), (0, 5), (25, 40)]:
        got = np.empty((64, cols[1] - cols[0]), np.float32)
        src.read_into(dev, got, (0, 64), cols)
        np.testing.assert_array_equal(got, data[:, cols[0] : cols[1]])
    assert seen["direct"] == []
    assert sum(seen["staged"]) == 64 * (10 + 10 + 5 + 15) * 4
    assert len(src._maps) == 8  # each chunk mapped once, for every block that meets it
    monkeypatch.setattr(stores, "_KEPT_MAPS", 3)  # a map holds a file descriptor: the last used kept
    src = ZarrSource(src.info)
    got = np.empty((64, 10), np.float32)
    src.read_into(dev, got, (0, 64), (0, 10))
    np.testing.assert_array_equal(got, data[:, :10])
    assert [p.split(os.sep)[-2:] for p in src._maps] == [["1", "0"], ["2", "0"], ["3", "0"]]
    maps = dict(src._maps)
    src.read_into(dev, got[:16], (16, 32), (0, 10))
    np.testing.assert_array_equal(got[:16], data[16:32, :10])
    assert [p.split(os.sep)[-2:] for p in src._maps] == [["2", "0"], ["3", "0"], ["1", "0"]]
    assert all(src._maps[p] is maps[p] for p in src._maps)  # the one used again was not mapped again
    again = pickle.loads(pickle.dumps(src))  # a source travels without its maps
    assert again == src and again._maps == {}
    # A block exactly one column of chunks wide is whole chunk rows: in place, no staging.
    got = np.empty((40, 20), np.float32)
    src.read_into(dev, got, (8, 48), (20, 40))
    np.testing.assert_array_equal(got, data[8:48, 20:40])
    paths = [os.path.relpath(p, src.info.path) for p, _, _ in seen["direct"]]
    assert paths == [os.path.join("c", str(i), "1") for i in range(3)]
    assert [(o, n) for _, o, n in seen["direct"]] == [(8 * 20 * 4, 8 * 20 * 4), (0, 16 * 20 * 4), (0, 16 * 20 * 4)]


def test_block_reads_put_whole_chunk_rows_in_place_and_stage_the_rest(tmp_path):
    # The bench's layouts: A in chunks 4096 x 2048, B in chunks of 2048 whole rows, and
    # square chunks, scaled down by 256.
    a = inspect_zarr(_store(tmp_path / "a.zarr", np.ones((128, 128), np.float32), (16, 8)), key="a")
    b = inspect_zarr(_store(tmp_path / "b.zarr", np.ones((128, 128), np.float32), (8, 128)), key="b")
    sq = inspect_zarr(_store(tmp_path / "sq.zarr", np.ones((128, 128), np.float32), (16, 16)), key="b")

    def how(info, box):
        return [r.how for r in stores.block_reads(info, box)]

    assert how(a, ((0, 128), (0, 8))) == ["direct"] * 8  # a block of chunks' whole rows
    assert how(a, ((0, 128), (0, 4))) == ["staged"] * 8  # half a chunk wide
    assert how(a, ((0, 128), (0, 1))) == ["staged"] * 8  # the first piece of the first block
    assert how(a, ((0, 128), (4, 12))) == ["staged"] * 16  # across chunks
    half = stores.block_reads(b, ((4, 8), (0, 128)))  # half a chunk's rows: one range of its object
    assert [(r.how, r.offset, r.nbytes) for r in half] == [("direct", 4 * 128 * 4, 4 * 128 * 4)]
    assert how(sq, ((0, 8), (0, 128))) == ["staged"] * 8  # whole chunk rows, a part of the block's
    os.unlink(tmp_path / "b.zarr" / "c" / "1" / "0")
    assert how(b, ((4, 12), (0, 128))) == ["direct", "fill"]


def test_a_chunk_cut_short_fails_the_gpu_read_naming_it(tmp_path, monkeypatch):
    dev, _ = _fake_gpu(monkeypatch)
    src = ZarrSource(inspect_zarr(_store(tmp_path / "a.zarr", np.ones((32, 16), np.float32), (8, 8)), key="input.a"))
    chunk = tmp_path / "a.zarr" / "c" / "2" / "0"
    os.truncate(chunk, 100)
    with pytest.raises(stores.StoreUnreadable, match=r"input\.a: chunk .*c/2/0 ends 156 bytes short"):
        src.read_into(dev, np.empty((32, 4), np.float32), (0, 32), (0, 4))


def test_reads_started_together_have_all_landed_once_their_block_is_left(monkeypatch, tmp_path):
    from test_transfer import _stand_in_kvikio_module

    from mgpu.worker import io

    started = _stand_in_kvikio_module(monkeypatch)  # its reads run when waited for
    data = np.arange(1000, dtype=np.float32)
    data.tofile(tmp_path / "x.raw")
    out = [np.zeros(300, np.float32), np.zeros(200, np.float32)]
    requests = [(str(tmp_path / "x.raw"), 400, out[0]), (str(tmp_path / "x.raw"), 0, out[1])]
    with pytest.raises(RuntimeError, match="beside the reads"), io.started(requests):
        assert [s[1:] for s in started] == [(400, 1200), (0, 800)]  # both started before any wait
        raise RuntimeError("beside the reads")
    np.testing.assert_array_equal(out[0], data[100:400])  # none still runs into the arrays
    np.testing.assert_array_equal(out[1], data[:200])
    os.truncate(tmp_path / "x.raw", 1000)
    started.clear()
    with pytest.raises(EOFError, match="x.raw is truncated"), io.started(requests):
        pass
    assert started == []  # every range checked before any read starts


def _count_decodes(monkeypatch):
    from mgpu.worker import decoded

    counts = Counter()
    real = decoded.DecodedChunks._decode

    def counting(self, coords):
        counts[coords] += 1
        return real(self, coords)

    monkeypatch.setattr(decoded.DecodedChunks, "_decode", counting)
    return counts


def test_each_chunk_of_a_compressed_store_is_decoded_once_for_the_blocks_that_meet_it(tmp_path, monkeypatch):
    # Blocks half a chunk wide, as the streamed matmul reads A: each chunk decoded once.
    counts = _count_decodes(monkeypatch)
    data = np.random.default_rng(6).standard_normal((64, 40)).astype(np.float32)
    src = ZarrSource(inspect_zarr(_store(tmp_path / "a.zarr", data, (16, 20), compressed=True), key="a"))
    dev = _cpu_device()
    src.ahead(dev, [((0, 64), (0, 10)), ((0, 64), (10, 20))])  # named ahead: decoding already
    assert src._decoded[0].kept == [(i, 0) for i in range(4)]
    for rows, cols in [((0, 64), (0, 10)), ((0, 64), (10, 20)), ((8, 40), (0, 5)), ((0, 64), (20, 40))]:
        np.testing.assert_array_equal(src.read(dev, rows, cols), data[rows[0] : rows[1], cols[0] : cols[1]])
    assert sorted(counts) == [(i, j) for i in range(4) for j in range(2)]
    assert set(counts.values()) == {1}
    raw = ZarrSource(inspect_zarr(_store(tmp_path / "b.zarr", data, (16, 20)), key="b"))
    raw.ahead(dev, [((0, 64), (0, 10))])  # uncompressed chunks: nothing to decode
    assert raw._decoded == []


def test_chunks_named_ahead_decode_within_half_the_room_and_the_least_recently_used_go_first(tmp_path, monkeypatch):
    from mgpu.worker.decoded import DecodedChunks

    counts = _count_decodes(monkeypatch)
    data = np.arange(12 * 4, dtype=np.float64).reshape(12, 4)
    info = inspect_zarr(_store(tmp_path / "a.zarr", data, (2, 4), compressed=True), key="a")
    chunks = DecodedChunks(info, _cpu_device().staging.pool_for("decode"), keep=4 * info.chunk_nbytes)
    c = [(i, 0) for i in range(6)]
    chunks.ahead(c)  # room for two ahead
    assert chunks.kept == c[:2]
    np.testing.assert_array_equal(chunks.get([c[0]])[0], data[0:2])
    chunks.ahead(c[1:])  # the one kept counts, and stays
    assert chunks.kept == [c[0], c[1], c[2]]
    got = chunks.get([c[3], c[4]])  # five chunks' room for four: the least recently used goes
    np.testing.assert_array_equal(np.concatenate(got), data[6:10])
    assert chunks.kept == [c[1], c[2], c[3], c[4]]
    chunks.get([c[0]])  # gone: decoded again
    assert chunks.kept == [c[2], c[3], c[4], c[0]]
    chunks.get(c[2:5])  # kept: not decoded again
    assert counts[c[0]] == 2 and [counts[k] for k in c[2:5]] == [1, 1, 1] and c[5] not in counts
