"""Each workload end to end through the real CLI on a real LocalCluster, checked against
independent NumPy references on awkward sizes."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import submit_json, write_job

from mgpu.worker import kernels
from mgpu.worker.device import Device, DeviceFacts
from mgpu.workloads.mandelbrot import Mandelbrot, MandelbrotParams


def _submit(tmp_path: Path, scheduler: str, doc: dict[str, Any], *extra: Any) -> dict[str, Any]:
    """Run ``doc`` on the shared cluster; check what every good run reports; return the JSON."""
    job = write_job(tmp_path / "job.yaml", doc)
    res, data = submit_json(job, tmp_path / "result.json", "--scheduler", scheduler, *extra)
    assert res.code == 0, res.output
    assert "Traceback" not in res.output
    assert data is not None
    assert data["status"] == "ok"
    assert data["workload"] == doc["workload"]
    assert data["backend"] == "cpu"
    assert data["verify"]["passed"] is True and data["verify"]["failed_tiles"] == []
    # Every tile ran exactly once, on the workers the result names.
    assert sum(d["tiles"] for d in data["per_device"]) == data["plan"]["tiles"]
    assert {d["id"] for d in data["per_device"]} <= {d["id"] for d in data["devices"]}
    assert len(data["devices"]) == 2
    # CPU workers measure no allocator: each row says numpy, with null figures, not zeros.
    assert all(
        d["allocator"]["kind"] == "numpy"
        and d["allocator"]["peak_bytes"] is None
        and d["allocator"]["total_count"] is None
        for d in data["per_device"]
    )
    if data["plan"]["tiles"] >= 2:  # static runs split evenly; dynamic runs seed every worker
        assert sorted(d["id"] for d in data["per_device"]) == [0, 1]
        assert all(d["tiles"] >= 1 for d in data["per_device"])
    # The job as run, every default filled in.
    job_out = data["job"]
    assert job_out["name"] == "job"  # the file's stem
    assert job_out["cluster"]["scheduler"] == scheduler
    assert job_out["cluster"]["allocator"] == "pool" and job_out["cluster"]["spill"] == "managed"
    assert job_out["cluster"]["protocol"] == "auto" and job_out["cluster"]["devices"] == "all"
    assert job_out["verify"] is True
    if not extra:
        assert job_out["tiling"] == doc.get("tiling", "auto")
    assert data["wall_s"] > 0 and data["compute_s"] >= 0
    return data


def _random(seed: int, operand: int, rows: int, cols: int, dtype: str) -> np.ndarray:
    return kernels.random_block(
        np, seed=seed, operand=operand, rows=(0, rows), cols=(0, cols), total_cols=cols, dtype=dtype
    )


def _assert_matmul_close(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """|C - A@B| within the classic bound (k + 2) * eps * (|A| @ |B|), elementwise."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = a64 @ b64
    bound = (a.shape[1] + 2) * np.finfo(c.dtype).eps * (np.abs(a64) @ np.abs(b64)) + np.finfo(c.dtype).tiny
    err = np.abs(c.astype(np.float64) - ref)
    assert (err <= bound).all(), f"max error {err.max()}, worst ratio {(err / bound).max()}"


# -- matmul ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m,n,k,dtype,tiling",
    [
        (1, 1, 1, None, None),
        (7, 13, 1, None, None),  # k = 1
        (97, 89, 101, "float64", None),  # primes
        (97, 89, 101, None, {"m": 32, "n": 40, "k": 37}),  # several tiles per worker, k split
        (33, 17, 65, "float16", {"k": 16}),
    ],
)
def test_matmul_random_matches_numpy(tmp_path, scheduler, m, n, k, dtype, tiling):
    out = tmp_path / "c.npy"
    params: dict[str, Any] = {"m": m, "n": n, "k": k, "seed": 5, "output": str(out)}
    if dtype:
        params["dtype"] = dtype
    doc: dict[str, Any] = {"workload": "matmul", "params": params}
    if tiling:
        doc["tiling"] = tiling
    data = _submit(tmp_path, scheduler, doc)
    want_dtype = dtype or "float32"
    assert data["job"]["params"] == {
        "m": m,
        "n": n,
        "k": k,
        "dtype": want_dtype,
        "precision": "default",
        "seed": 5,
        "input": "random",
        "output": str(out),
        "operands": "per-tile",
    }
    assert data["outputs"] == [str(out)]
    assert data["value"] is None and data["throughput"]["unit"] == "TFLOP/s"
    assert data["verify"]["method"] == "freivalds"
    c = np.load(out)
    assert c.shape == (m, n) and c.dtype == np.dtype(want_dtype)
    a = _random(5, 0, m, k, want_dtype)
    b = _random(5, 1, k, n, want_dtype)
    _assert_matmul_close(c, a, b)
    if tiling and "m" in tiling:
        assert data["plan"]["tiles"] == math.ceil(m / tiling["m"]) * math.ceil(n / tiling["n"])
        assert data["plan"]["tile_shape"] == tiling
        assert all(d["tiles"] == data["plan"]["tiles"] // 2 for d in data["per_device"])
    if tiling and "k" in tiling:
        assert data["plan"]["tile_shape"]["k"] == tiling["k"] < k
    assert [p for p in os.listdir(tmp_path) if "partial" in p] == []


def test_matmul_tiling_does_not_change_the_answer(tmp_path, scheduler):
    """The same job tiled two ways writes the same C: inputs do not depend on tiles."""
    params = {"m": 61, "n": 67, "k": 71, "dtype": "float64", "seed": 1}
    one = tmp_path / "one"
    many = tmp_path / "many"
    one.mkdir()
    many.mkdir()
    _submit(
        one,
        scheduler,
        {
            "workload": "matmul",
            "params": {**params, "output": str(one / "c.npy")},
            "tiling": {"m": 61, "n": 67, "k": 71},
        },
    )
    _submit(
        many,
        scheduler,
        {"workload": "matmul", "params": {**params, "output": str(many / "c.npy")}, "tiling": {"m": 10, "n": 9}},
    )
    c1, c2 = np.load(one / "c.npy"), np.load(many / "c.npy")
    np.testing.assert_allclose(c1, c2, rtol=0, atol=1e-13 * np.abs(c1).max())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matmul_from_npy_files(tmp_path, scheduler, dtype):
    rng = np.random.default_rng(42)
    a = rng.standard_normal((29, 31)).astype(dtype)
    b = rng.standard_normal((31, 23)).astype(dtype)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    out = tmp_path / "c.npy"
    data = _submit(
        tmp_path,
        scheduler,
        {
            "workload": "matmul",
            "params": {"input": {"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy")}, "output": str(out)},
            "tiling": {"m": 8, "k": 10},
        },
    )
    p = data["job"]["params"]
    assert (p["m"], p["n"], p["k"], p["dtype"]) == (29, 23, 31, dtype)  # sizes come from the files
    c = np.load(out)
    assert c.dtype == a.dtype and c.shape == (29, 23)
    _assert_matmul_close(c, a, b)
    np.testing.assert_allclose(
        c, a @ b, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-5 if dtype == "float32" else 1e-12
    )


# -- dot ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dot_random_matches_numpy(tmp_path, scheduler, dtype):
    n = 1_000_003
    data = _submit(tmp_path, scheduler, {"workload": "dot", "params": {"n": n, "dtype": dtype, "seed": 2}})
    assert data["job"]["params"] == {"n": n, "dtype": dtype, "seed": 2, "input": "random"}
    assert data["throughput"]["unit"] == "GB/s" and data["outputs"] == []
    x = _random(2, 0, 1, n, dtype).ravel().astype(np.float64)
    y = _random(2, 1, 1, n, dtype).ravel().astype(np.float64)
    want = math.fsum(x * y)  # exactly rounded sum of the float64 products
    assert abs(data["value"] - want) <= 1e-12 * abs(want)
    assert abs(data["value"] - float(np.dot(x, y))) <= 1e-12 * abs(want)
    # The job made x and y and reduced them: its work is both steps' bytes, each timed apart.
    nbytes = 2 * n * np.dtype(dtype).itemsize
    assert data["throughput"]["value"] == pytest.approx(2 * nbytes / data["compute_s"] / 1e9)
    assert {k: v["bytes"] for k, v in data["phases"].items()} == {"generate": nbytes, "reduce": nbytes}
    if data["roofline"]:
        assert "made on the device" in data["roofline"]["basis"]


def test_dot_default_dtype_and_repeat_from_the_job_as_run(tmp_path, scheduler):
    data = _submit(tmp_path, scheduler, {"workload": "dot", "params": {"n": 10_007}})
    assert data["job"]["params"]["dtype"] == "float32" and data["job"]["params"]["seed"] == 0
    # Feeding the recorded job back repeats the run bit for bit.
    again_dir = tmp_path / "again"
    again_dir.mkdir()
    job = write_job(again_dir / "job.yaml", data["job"])
    res, again = submit_json(job, again_dir / "result.json")
    assert res.code == 0, res.output
    assert again["value"] == data["value"]
    assert again["job"] == data["job"]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_dot_from_npy_files(tmp_path, scheduler, dtype):
    n = 100_003
    rng = np.random.default_rng(7)
    x = rng.uniform(-2, 2, n).astype(dtype)
    y = rng.uniform(-2, 2, n).astype(dtype)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    data = _submit(
        tmp_path,
        scheduler,
        {
            "workload": "dot",
            "params": {"input": {"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")}},
            "tiling": {"n": 7919},
        },
    )
    assert data["job"]["params"]["n"] == n and data["job"]["params"]["dtype"] == dtype
    assert data["plan"]["tiles"] == math.ceil(n / 7919)
    assert set(data["phases"]) == {"reduce"}  # read, not made: checked by a pass of its own
    assert data["throughput"]["value"] == pytest.approx(2 * n * x.itemsize / data["compute_s"] / 1e9)
    want = float(np.dot(x.astype(np.float64), y.astype(np.float64)))
    assert abs(data["value"] - want) <= 1e-12 * abs(want)


# -- mandelbrot ---------------------------------------------------------------------------


def _escape_counts(width, height, xmin, xmax, ymin, ymax, max_iter, dtype):
    """Plain escape-time counts, straight from the definition (not mgpu's kernel)."""
    j = np.arange(width)
    i = np.arange(height)
    x = (xmin + (j + 0.5) * (xmax - xmin) / width).astype(dtype)
    y = (ymax - (i + 0.5) * (ymax - ymin) / height).astype(dtype)
    cr, ci = np.meshgrid(x, y)  # row i has y[i]: row 0 is the top of the image
    zr = np.zeros_like(cr)
    zi = np.zeros_like(ci)
    counts = np.zeros((height, width), dtype=np.int32)
    running = np.ones((height, width), dtype=bool)
    for _ in range(max_iter):
        running &= zr * zr + zi * zi <= 4
        if not running.any():
            break
        counts += running
        zr, zi = (np.where(running, zr * zr - zi * zi + cr, zr), np.where(running, 2 * zr * zi + ci, zi))
    return counts


WINDOW = {"xmin": -2.2, "xmax": 0.8, "ymin": -1.1, "ymax": 1.4}  # not symmetric: a flip would show


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mandelbrot_counts_and_png(tmp_path, scheduler, dtype):
    width, height, max_iter = 61, 47, 60
    npy, png = tmp_path / "m.npy", tmp_path / "m.png"
    params = {
        "width": width,
        "height": height,
        **WINDOW,
        "max_iter": max_iter,
        "output": {"npy": str(npy), "png": str(png)},
    }
    if dtype != "float32":
        params["dtype"] = dtype
    data = _submit(tmp_path, scheduler, {"workload": "mandelbrot", "params": params})
    assert data["job"]["params"]["dtype"] == dtype
    assert data["plan"]["placement"] == "dynamic" and data["plan"]["tiles"] >= 2
    assert data["throughput"]["unit"] == "Giter/s" and data["value"] is None
    assert sorted(data["outputs"]) == sorted([str(npy), str(png)])

    counts = np.load(npy)
    assert counts.dtype == np.int32 and counts.shape == (height, width)
    want = _escape_counts(width, height, **WINDOW, max_iter=max_iter, dtype=dtype)
    # A c that rounds one ulp apart may change a count on the boundary; nothing more.
    assert np.mean(counts != want) <= 0.01
    assert (counts == max_iter).any() and (counts < 3).any()  # the window holds set and outside

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    img = imread(png)
    assert img.shape[:2] == (height, width)
    rgb = img[..., :3]
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 5  # a picture, not one colour
    inside = (counts == max_iter) & (want == max_iter)
    assert (rgb[inside] == 0).all()  # points in the set are black ...
    assert (rgb[counts < max_iter].max(axis=1) > 0).all()  # ... and only those
    assert sorted(os.listdir(tmp_path)) == ["job.yaml", "m.npy", "m.png", "result.json"]


def test_mandelbrot_wide_png_is_at_most_4096_a_side(tmp_path, scheduler):
    png = tmp_path / "wide.png"
    data = _submit(
        tmp_path,
        scheduler,
        {"workload": "mandelbrot", "params": {"width": 5003, "height": 3, "max_iter": 20, "output": {"png": str(png)}}},
    )
    assert data["outputs"] == [str(png)]
    from matplotlib.image import imread

    img = imread(png)
    assert max(img.shape[:2]) <= 4096 and img.shape[1] >= 2048
    assert len(np.unique(img[..., :3].reshape(-1, 3), axis=0)) > 1
    # The counts were scratch for the image: nothing else is left.
    assert sorted(os.listdir(tmp_path)) == ["job.yaml", "result.json", "wide.png"]


def test_mandelbrot_without_output_checks_and_reports(tmp_path, scheduler):
    data = _submit(
        tmp_path,
        scheduler,
        {"workload": "mandelbrot", "params": {"width": 40, "height": 30, "max_iter": 50}},
        "--set",
        "tiling.rows=7",
    )
    assert data["job"]["tiling"] == {"rows": 7}
    assert data["plan"]["tiles"] == math.ceil(30 / 7) and data["outputs"] == []
    assert data["job"]["params"]["output"] is None
    assert data["verify"]["method"] == "sampled pixels counted again on the device" and data["verify"]["passed"]
    assert data["throughput"]["value"] > 0


def test_mandelbrot_bands_of_equal_cost_check_and_count_every_pixel(tmp_path, scheduler):
    """No output and no tiling: bands cut by estimated cost, of unequal height, all checked."""
    width, height, max_iter = 90, 160, 120
    data = _submit(
        tmp_path,
        scheduler,
        {"workload": "mandelbrot", "params": {"width": width, "height": height, **WINDOW, "max_iter": max_iter}},
    )
    tiles = data["plan"]["tiles"]
    equal = math.ceil(height / 16)  # the rows of the equal-row bands
    # Bands of unequal height (the tallest is taller than equal rows), none more than twice.
    assert equal < data["plan"]["tile_shape"]["rows"] <= 2 * equal and tiles >= math.ceil(height / equal)
    # Every pixel's steps, summed over the bands, are the steps of the whole image.
    steps = data["throughput"]["value"] * data["compute_s"] * 1e9
    want = _escape_counts(width, height, **WINDOW, max_iter=max_iter, dtype="float32").sum()
    assert steps == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("verify", [True, False])
def test_mandelbrot_warmup_runs_a_small_band_the_way_the_job_does(monkeypatch, verify):
    """The warm-up is run_tile on a small band, checked when the job is: on a GPU the check's
    kernels then compile and load in the warm-up, not in the first real bands. It leaves the
    job's own axes on the device for the bands to slice."""
    from mgpu.tiling import Tile
    from mgpu.worker import tile as routine
    from mgpu.workloads.mandelbrot import workload as mandelbrot

    runs = []

    def spy(workload: Mandelbrot, dev: Device, tile: Any) -> Any:
        record = routine.run_tile(workload, dev, tile)
        runs.append((workload, record))
        return record

    monkeypatch.setattr(mandelbrot, "run_tile", spy)
    job = Mandelbrot(MandelbrotParams(width=65536, height=65536, max_iter=50, dtype="float64"), verify=verify)
    dev = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "host"))
    job.warmup(dev, Tile(0, {"rows": (0, 8)}))
    assert len(runs) == 1
    small, record = runs[0]
    assert (small.params.width, small.params.height) == (8192, 8) and small.sinks == {}
    assert (small.params.max_iter, small.params.dtype) == (50, "float64")
    assert small.verify is verify
    assert (record.verify_ok is True) is verify  # its samples were counted again, as a checked band's are
    assert len(dev.cache) == 1  # the job's axes, not the small band's
    x, y = dev.cache.held("mandelbrot-axes")
    assert x.shape == y.shape == (65536,) and x.dtype == np.float64


def test_mandelbrot_bands_of_jobs_in_one_process_each_count_over_their_own_window():
    # A band slices the axes its worker keeps for the running job: the next job, with
    # another window or size, must not count over the last one's.
    from mgpu.tiling import Tile
    from mgpu.worker.tile import run_tile

    dev = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "host"))
    for window, (width, height) in [(WINDOW, (64, 48)), ({**WINDOW, "ymin": -0.5}, (64, 48)), (WINDOW, (40, 30))]:
        job = Mandelbrot(MandelbrotParams(width=width, height=height, max_iter=60, dtype="float32", **window))
        record = run_tile(job, dev, Tile(3, {"rows": (8, 20)}))
        want = _escape_counts(width, height, **window, max_iter=60, dtype="float32")[8:20]
        assert record.work == want.sum() and record.verify_ok is True  # its samples, counted again, agree


def _panels_held(dask_worker: Any = None) -> int:
    from mgpu.worker.tasks import current

    return current(dask_worker).panels.held()


def test_matmul_distributed_operands(tmp_path, scheduler, cluster):
    """Panels made once per worker, tiles placed with their A panel, the same C as per-tile."""
    m, n, k = 45, 38, 29
    out = tmp_path / "c.npy"
    doc = {
        "workload": "matmul",
        "params": {
            "m": m,
            "n": n,
            "k": k,
            "seed": 3,
            "dtype": "float64",
            "operands": "distributed",
            "output": str(out),
        },
    }
    data = _submit(tmp_path, scheduler, doc)
    # Two workers: A in two row panels, B in two column panels made in two pieces each (C
    # goes to a file: the last tile's write is smaller), so 2 x 2 x 2 tiles, four per worker.
    assert data["plan"]["tiles"] == 8
    assert data["plan"]["tile_shape"] == {"m": 23, "n": 10, "k": k}
    assert sorted(d["tiles"] for d in data["per_device"]) == [4, 4]
    # CPU workers have no peer path: the B panel another worker holds is made again, not moved.
    assert all(d["bytes_d2d"] == 0 for d in data["per_device"])
    c = np.load(out)
    a, b = _random(3, 0, m, k, "float64"), _random(3, 1, k, n, "float64")
    _assert_matmul_close(c, a, b)
    # The panels were released on every worker once the tiles ended.
    from distributed import Client

    with Client(scheduler) as client:
        assert set(client.run(_panels_held).values()) == {0}


def test_the_client_reports_each_panels_making_once_every_tile_has_ended(tmp_path, scheduler):
    from mgpu.client.run import run_job
    from mgpu.client.watch import Events
    from mgpu.spec import validate_job

    class Watch(Events):
        def __init__(self) -> None:
            self.tiles: list[Any] = []
            self.panels: list[Any] = []

        def tile_done(self, record: Any) -> None:
            self.tiles.append(record)

        def panels_made(self, records: list[Any]) -> None:
            assert len(self.tiles) == 4  # after the last tile
            self.panels = records

    watch = Watch()
    doc = {
        "workload": "matmul",
        "params": {"m": 45, "n": 38, "k": 29, "dtype": "float64", "operands": "distributed"},
        "cluster": {"scheduler": scheduler, "dashboard": None},
    }
    result = run_job(validate_job(doc), watch)
    assert result.status == "ok"
    # One A piece and one B panel per worker, each made on its worker before its tiles.
    assert sorted(r.extra["panel"] for r in watch.panels) == ["a0.0", "a1.0", "b0.0", "b1.0"]
    assert all(r.kind == "panel" for r in watch.panels)
    first_tile = {w: min(t.start for t in watch.tiles if t.worker == w) for w in {t.worker for t in watch.tiles}}
    assert all(r.stop <= first_tile[r.worker] + 1e-3 for r in watch.panels if r.extra["panel"].endswith(".0"))


def test_a_peers_panel_is_opened_once_a_job_and_closed_only_when_asked(monkeypatch):
    # Closing a CUDA IPC mapping waits for the whole device: a tile must not do it.
    import sys
    from types import SimpleNamespace

    from mgpu.worker import panels

    calls: list[tuple[str, Any]] = []
    runtime = SimpleNamespace(
        ipcOpenMemHandle=lambda h: calls.append(("open", h)) or 1000 + len(calls),
        ipcCloseMemHandle=lambda ptr: calls.append(("close", ptr)),
    )
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(panels, "enable_peer_access", lambda peer: None)
    store = panels.PanelStore()
    ref = panels.PanelRef("job1", "b1", (4, 4), "float32", "h", 1, b"u", b"handle-b1")
    first = store.open_remote(ref, 1)
    assert store.open_remote(ref, 1) is first and first.ptr == 1001
    other = store.open_remote(panels.PanelRef("job2", "b1", (4, 4), "float32", "h", 1, b"u", b"h2"), 1)
    assert calls == [("open", b"handle-b1"), ("open", b"h2")]
    assert store.close_remotes("job1") == 1
    assert calls[-1] == ("close", 1001) and other.ptr != 0  # the other job's stays open
    assert store.close_remotes("job1") == 0
    store.close()  # the worker's teardown closes what is still open
    assert calls[-1] == ("close", 1002) and other.ptr == 0 and store.held() == 0


def test_distributed_plan_places_tiles_with_their_panels():
    from mgpu.worker.device import DeviceFacts
    from mgpu.workloads.matmul import Matmul, MatmulParams

    facts = {f"w{i}": DeviceFacts("cpu", i, "cpu", 1 << 30, 1 << 30, "h") for i in range(3)}
    wl = Matmul(MatmulParams(m=30, n=31, k=1000, operands="distributed"))
    plan = wl.plan(facts, 1 << 30, {})
    assert [(p.name, p.worker) for p in plan.panels] == [
        ("a0.0", "w0"),
        ("a1.0", "w1"),
        ("a2.0", "w2"),
        ("b0.0", "w0"),
        ("b1.0", "w1"),
        ("b2.0", "w2"),
    ]
    panels = {p.name: p for p in plan.panels}
    assert len(plan.tiles) == 9
    for w in facts:
        mine = [t for t in plan.tiles if t.worker == w]
        # A worker computes its row of tiles, starting with its own B panel's tile.
        assert len(mine) == 3
        assert panels[mine[0].needs[1]].worker == w
        for t in mine:
            a, b = (panels[name] for name in t.needs)
            assert a.worker == w and t.bounds["m"] == a.bounds["m"] and t.bounds["n"] == b.bounds["n"]
    covered = sorted((t.bounds["m"], t.bounds["n"]) for t in plan.tiles)
    assert len(set(covered)) == 9


def test_panel_priorities_put_each_workers_first_tile_first(monkeypatch, tmp_path):
    from mgpu.client.submit import panel_priorities, tile_places
    from mgpu.workloads.matmul import workload as matmul

    monkeypatch.setattr(matmul, "_WRITE_TILE_BYTES", 10 * 31 * 8)  # three row pieces per panel pair
    facts = {f"w{i}": DeviceFacts("cpu", i, "cpu", 1 << 30, 1 << 30, "h") for i in range(3)}
    wl = matmul.Matmul(
        matmul.MatmulParams(m=90, n=93, k=50, dtype="float64", operands="distributed", output=str(tmp_path / "c.npy"))
    )
    plan = wl.plan(facts, 1 << 30, {})
    priority, places = panel_priorities(plan), tile_places(plan)
    assert set(priority) == {p.name for p in plan.panels}
    for i, w in enumerate(facts):
        mine = [t for t in plan.tiles if t.worker == w]
        assert [places[t.index] for t in mine] == list(range(len(mine)))
        # Dask runs a worker's ready tasks highest priority first: the first tile's A and B
        # pieces, then the other pieces in the order its tiles read them.
        here = [p.name for p in plan.panels if p.worker == w]
        order = sorted(here, key=lambda name: -priority[name])
        assert set(order[:2]) == set(mine[0].needs) == {f"a{i}.0", f"b{i}.0"}
        assert order[2:] == [f"a{i}.1", f"a{i}.2", f"b{i}.1"]
        # A tile (priority minus its place) goes after the panels it reads and before the
        # panels made here that only later tiles read.
        for n, t in enumerate(mine):
            read_so_far = {name for u in mine[: n + 1] for name in u.needs}
            assert all(priority[name] >= -places[t.index] for name in t.needs)
            assert all(priority[name] < -places[t.index] for name in here if name not in read_so_far)


def test_distributed_operands_that_cannot_fit_exit_2(tmp_path, scheduler):
    doc = {
        "workload": "matmul",
        "params": {"m": 4000, "n": 4000, "k": 4000, "operands": "distributed"},
        "cluster": {"memory_limit": "1MB", "spill": "none"},
    }
    job = write_job(tmp_path / "job.yaml", doc)
    res, _ = submit_json(job, tmp_path / "r.json", "--scheduler", scheduler)
    assert res.code == 2, res.output
    assert "Traceback" not in res.output
    assert "cluster.memory_limit" in res.stderr and "operands: per-tile" in res.stderr
