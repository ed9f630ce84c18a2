"""workload: stencil on CPU workers: the bands with their halo exchange give NumPy's sweep."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from distributed import LocalCluster
from mgpu_stencil import Stencil, StencilParams, jacobi_step, sweep

from mgpu.errors import JobInputError
from mgpu.spec import validate_job
from mgpu.worker import tile as routine
from mgpu.worker.device import Device, DeviceFacts
from mgpu.worker.exchange import PeerBuffers
from mgpu.worker.kernels import random_block
from mgpu.workloads import get_workload_class, workload_names
from mgpu.workloads.base import TileRecord

HERE = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scheduler():
    cluster = LocalCluster(
        n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0", silence_logs=logging.WARNING
    )
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()


def _grid(height: int, width: int, seed: int = 0, dtype: str = "float32") -> np.ndarray:
    return random_block(np, seed=seed, operand=0, rows=(0, height), cols=(0, width), total_cols=width, dtype=dtype)


def _submit(tmp_path: Path, doc: dict, *extra: str) -> subprocess.CompletedProcess:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    return subprocess.run(
        [sys.executable, "-m", "mgpu", "submit", str(job), "--json", str(tmp_path / "out.json"), "-q", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_entry_point_registers_the_workload():
    assert "stencil" in workload_names() and get_workload_class("stencil") is Stencil


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bands_exchanging_halo_rows_give_the_whole_grids_sweep(dtype):
    grid = _grid(23, 17, dtype=dtype)
    cuts = [(0, 5), (5, 6), (6, 15), (15, 23)]  # a band of one row among them
    bands = []
    for r0, r1 in cuts:
        u = np.zeros((r1 - r0 + 2, 17), dtype)
        lo, hi = max(0, r0 - 1), min(23, r1 + 1)
        u[lo - r0 + 1 : hi - r0 + 1] = grid[lo:hi]
        bands.append((r0, r1, u, np.empty_like(u)))
    for _ in range(9):
        for r0, _r1, u, out in bands:
            jacobi_step(np, u, out, r0, 23)
        bands = [(r0, r1, out, u) for r0, r1, u, out in bands]
        for i, (_r0, r1, u, _) in enumerate(bands):  # each band's new edge rows to its neighbours
            rows = r1 - _r0
            if i > 0:
                bands[i - 1][2][-1] = u[1]
            if i + 1 < len(bands):
                bands[i + 1][2][0] = u[rows]
    got = np.concatenate([u[1 : r1 - r0 + 1] for r0, r1, u, _ in bands])
    want = sweep(grid, 9)
    np.testing.assert_array_equal(got, want)
    # The sweep is the heat equation's: fixed edges, each inner cell its neighbours' mean.
    np.testing.assert_array_equal(want[0], grid[0])
    np.testing.assert_array_equal(want[:, -1], grid[:, -1])
    one = sweep(grid, 1)
    assert one[4, 7] == np.asarray(0.25, dtype) * ((grid[3, 7] + grid[5, 7]) + (grid[4, 6] + grid[4, 8]))


def test_plan_gives_each_band_its_neighbours_and_the_steps():
    devices = {f"w{i}": DeviceFacts("cpu", i, "cpu", 1 << 30, 1 << 30, "h") for i in range(3)}
    wl = Stencil(StencilParams(height=100, width=10, steps=7, bands_per_device=2, sweeps_per_exchange=3))
    plan = wl.plan(devices, 1 << 30, {})
    assert plan.steps == 3 and plan.placement == "static"  # 3 + 3 + 1 sweeps
    assert [t.bounds["rows"] for t in plan.tiles] == [(i * 100 // 6, (i + 1) * 100 // 6) for i in range(6)]
    assert [t.neighbours for t in plan.tiles] == [(1,), (0, 2), (1, 3), (2, 4), (3, 5), (4,)]
    assert [t.worker for t in plan.tiles] == ["w0", "w0", "w1", "w1", "w2", "w2"]
    assert {t.args["depth"] for t in plan.tiles} == {3}
    with pytest.raises(JobInputError, match="cluster.memory_limit"):
        wl.plan(devices, 1000, {})


@pytest.mark.parametrize(
    "height,bands,steps,depth,want",
    [
        (100, 6, 200, "auto", 16),  # the shortest band's rows
        (6400, 2, 200, "auto", 32),  # the most auto gives
        (6400, 2, 7, "auto", 7),  # the steps
        (10, 1, 200, "auto", 10),
        (10, 1, 200, 50, 50),  # one band sends nothing: any depth
        (10, 1, 20, 50, 20),  # never more than the steps
        (100, 6, 200, 16, 16),
    ],
)
def test_the_sweeps_per_exchange(height, bands, steps, depth, want):
    cpu = {"w": DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h")}
    params = StencilParams(height=height, width=8, steps=steps, bands_per_device=bands, sweeps_per_exchange=depth)
    plan = Stencil(params).plan(cpu, 1 << 30, {})
    assert {t.args["depth"] for t in plan.tiles} == {want}
    assert plan.steps == -(-steps // want)


def test_halos_deeper_than_a_band_are_refused_naming_the_key():
    cpu = {"w": DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h")}
    params = StencilParams(height=100, width=8, steps=50, bands_per_device=6, sweeps_per_exchange=17)
    with pytest.raises(
        JobInputError, match=r"params.sweeps_per_exchange: 17 .* shortest band has 16; allowed: 1 to 16"
    ):
        Stencil(params).plan(cpu, 1 << 30, {})


# Bands of 15 rows on two workers, exchanging after every sweep or every 4 (4 + 4 + 4 + 1).
@pytest.mark.parametrize("depth", [1, 4])
def test_a_job_on_cpu_workers_writes_numpys_sweep(tmp_path, scheduler, depth):
    out = tmp_path / "grid.npy"
    params = {"height": 61, "width": 37, "steps": 13, "seed": 4, "bands_per_device": 2, "output": str(out)}
    doc = {"workload": "stencil", "params": {**params, "sweeps_per_exchange": depth}}
    res = _submit(tmp_path, doc, "--scheduler", scheduler)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["status"] == "ok" and data["verify"]["passed"] is True and data["plan"]["tiles"] == 4
    assert data["roofline"]["basis"].endswith("copy measured on one device alone")
    # Each step reads and writes every cell once.
    assert data["throughput"]["unit"] == "GB/s"
    np.testing.assert_array_equal(np.load(out), sweep(_grid(61, 37, seed=4), 13))


def test_a_grid_from_a_file(tmp_path, scheduler):
    grid = np.linspace(0, 1, 30 * 20, dtype=np.float64).reshape(30, 20) ** 2
    np.save(tmp_path / "g.npy", grid)
    doc = {"workload": "stencil", "params": {"input": {"grid": str(tmp_path / "g.npy")}, "steps": 6}}
    out = tmp_path / "final.npy"
    doc["params"]["output"] = str(out)
    res = _submit(tmp_path, doc, "--scheduler", scheduler)
    assert res.returncode == 0, res.stdout + res.stderr
    np.testing.assert_array_equal(np.load(out), sweep(grid, 6))


def test_a_grid_from_a_zarr_store_to_a_zarr_store(tmp_path, scheduler):
    zarr = pytest.importorskip("zarr")
    grid = np.linspace(0, 1, 30 * 20, dtype=np.float64).reshape(30, 20) ** 2
    zarr.create_array(str(tmp_path / "g.zarr"), shape=grid.shape, chunks=(7, 6), dtype=grid.dtype)[...] = grid
    out = tmp_path / "final.zarr"
    doc = {
        "workload": "stencil",
        "params": {"input": {"grid": str(tmp_path / "g.zarr")}, "steps": 6, "output": str(out)},
    }
    res = _submit(tmp_path, doc, "--scheduler", scheduler)
    assert res.returncode == 0, res.stdout + res.stderr
    np.testing.assert_array_equal(zarr.open_array(str(out), mode="r")[...], sweep(grid, 6))


@pytest.mark.parametrize(
    "params,needles",
    [
        ({"height": 2, "width": 10}, ["params.height:", "greater than or equal to 3"]),
        ({"height": 10, "width": 10, "steps": 0}, ["params.steps:"]),
        ({"height": 10, "width": 10, "dtype": "float16"}, ["params.dtype:", "float32", "float64"]),
        ({"width": 10}, ["params.height: required when input is random"]),
        ({"height": 10, "width": 10, "halo": 2}, ["params.halo: unknown key"]),
        (
            {"height": 10, "width": 10, "sweeps_per_exchange": 0},
            ["params.sweeps_per_exchange: 0;", "1 or more", "auto"],
        ),
        ({"height": 10, "width": 10, "sweeps_per_exchange": "all"}, ["params.sweeps_per_exchange: 'all';"]),
    ],
)
def test_bad_params_exit_2(tmp_path, params, needles):
    res = _submit(tmp_path, {"workload": "stencil", "params": params})
    assert res.returncode == 2, res.stdout + res.stderr
    assert all(n in res.stderr for n in needles), res.stderr
    assert "Traceback" not in res.stderr


def test_a_file_of_another_dtype_is_refused(tmp_path):
    np.save(tmp_path / "g.npy", np.ones((5, 5), np.float16))
    with pytest.raises(JobInputError, match="params.input.grid: holds float16; allowed: float32, float64"):
        validate_job({"workload": "stencil", "params": {"input": {"grid": str(tmp_path / "g.npy")}}})


def test_the_example_job_file_is_valid_and_small():
    job = validate_job(yaml.safe_load((HERE / "jobs" / "stencil.yaml").read_text()))
    assert job.workload == "stencil" and job.params.height * job.params.width <= 1 << 22  # checked against NumPy
    gpu = validate_job(yaml.safe_load((HERE / "jobs" / "stencil-h200.yaml").read_text()))
    assert 2 * gpu.params.height * gpu.params.width * 4 > 100e9  # most of an H200's 141 GB


def resumed_sweep(
    folder: Path,
    dev: Device,
    grid: np.ndarray,
    steps: int,
    save_at: int,
    other: Device | None = None,
    *,
    depth: int = 1,
) -> np.ndarray:
    """``steps`` sweeps of ``grid`` (saved in ``folder``) in three bands on ``dev``, exchanging
    every ``depth`` sweeps, each band saved after ``save_at`` steps (of ``depth`` sweeps),
    restored (on ``other`` where given) and stepped on to the end; the bands joined."""
    np.save(grid_file := folder / "g.npy", grid)
    params = StencilParams(input={"grid": str(grid_file)}, steps=steps, bands_per_device=3, sweeps_per_exchange=depth)
    wl = Stencil(params)
    plan = wl.plan({"w": dev.facts}, 1 << 30, {})
    assert 0 < save_at < plan.steps

    first = routine.StepStore()
    _step_bands(wl, plan, dev, first, 0, {}, save_at)  # on to the end: the saved state must not follow the band
    saved = [first.take("tok", t.index, save_at) for t in plan.tiles]
    again = routine.StepStore()
    on = other or dev
    resumed = {c.index: routine.resume_tile(wl, on, plan.tiles[c.index], c, "tok", steps=again) for c in saved}
    last = _step_bands(wl, plan, on, again, save_at, resumed)
    records = [routine.run_tile(wl, on, t, token="tok", stepped=last[t.index], steps=again) for t in plan.tiles]
    assert all(r.verify_ok for r in records)  # the sampled rows' error, carried through the checkpoint
    return np.concatenate([r.extra["band"] for r in records])


def _step_bands(
    wl: Stencil, plan: Any, dev: Device, store: routine.StepStore, first: int, last: dict, save_at: int = 0
) -> dict:
    """Steps ``first`` onward of every band of ``plan`` on ``dev``, as the core runs them (each
    band's step after its neighbours' step before); with ``save_at``, the state after that many
    steps is saved. Returns each band's last step."""
    for step in range(first, plan.steps):
        last = {
            t.index: routine.step_tile(
                wl,
                dev,
                t,
                step,
                "tok",
                last.get(t.index),
                [last[n] for n in t.neighbours if n in last],
                save=step + 1 == save_at,
                steps=store,
                buffers=PeerBuffers(),
            )
            for t in plan.tiles
        }
    return last


CPU = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("depth,save_at", [(1, 4), (3, 2), (4, 1)])
def test_bands_saved_and_restored_step_on_to_numpys_sweep(tmp_path, dtype, depth, save_at):
    # Bands of 9-10 rows; 9 sweeps of 3 + 3 + 3 or 4 + 4 + 1.
    grid = _grid(29, 13, seed=6, dtype=dtype)
    got = resumed_sweep(tmp_path, CPU, grid, 9, save_at, depth=depth)
    np.testing.assert_array_equal(got, sweep(grid, 9))


def stepped_sweep(wl: Stencil, dev: Device) -> list[TileRecord]:
    """Every band of ``wl``'s job on ``dev``, stepped as the core steps them (each step of
    a band after its neighbours' step before; one step: no steps, the tile alone)."""
    plan = wl.plan({"w": dev.facts}, 1 << 30, {})
    store, last = routine.StepStore(), {}
    if plan.steps > 1:
        last = _step_bands(wl, plan, dev, store, 0, {})
    return [
        routine.run_tile(wl, dev, t, token="tok", stepped=last.get(t.index), steps=store if last else None)
        for t in plan.tiles
    ]


@pytest.mark.parametrize(
    "height,bands,steps,depth",
    [
        (61, 4, 13, 1),  # one sweep per exchange, as single-row halos
        (61, 4, 13, 4),  # steps not a multiple of the depth: 4 + 4 + 4 + 1
        (40, 4, 23, 10),  # bands exactly as tall as their halos: the edges' cones overlap
        (40, 4, 23, 7),  # bands shorter than four halos: the cones overlap, the interior is all theirs
        (101, 3, 40, "auto"),  # bands of 33-34 rows: 32 sweeps, then 8
        (29, 3, 9, "auto"),  # bands of 9-10 rows: one step of 9 sweeps, the tile alone
        (30, 1, 11, 4),  # one band: nothing to exchange
        (30, 1, 11, 30),  # one band, every sweep in one step
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bands_exchanging_deep_halos_give_the_whole_grids_sweep(tmp_path, height, bands, steps, depth, dtype):
    grid = _grid(height, 19, seed=height, dtype=dtype)
    np.save(grid_file := tmp_path / "g.npy", grid)
    params = {"input": {"grid": str(grid_file)}, "steps": steps, "sweeps_per_exchange": depth}
    wl = Stencil(StencilParams(**params, bands_per_device=bands), verify=True)
    records = stepped_sweep(wl, CPU)
    assert len(records) == bands and all(r.verify_ok for r in records)
    np.testing.assert_array_equal(np.concatenate([r.extra["band"] for r in records]), sweep(grid, steps))
    # The work counted: each sweep reads and writes each band's own rows once.
    assert sum(r.work for r in records) == 2 * grid.nbytes * steps


class _WrongAtOneStep(Stencil):
    """A stencil whose sweeps of one band, at one step only, add one to every row they write."""

    def __init__(self, *args: Any, band: int, step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wrong, self.now = (band, step), (-1, -1)

    def step(self, ctx: Any, tile: Any, step: int, received: dict) -> dict:
        self.now = (tile.index, step)
        return super().step(ctx, tile, step, received)

    def finish_step(self, ctx: Any, tile: Any, step: int) -> None:
        self.now = (tile.index, step)
        super().finish_step(ctx, tile, step)

    def _sweep(self, xp: Any, tile: Any, src: Any, dst: Any, span: tuple[int, int]) -> None:
        super()._sweep(xp, tile, src, dst, span)
        if self.now == self.wrong:
            dst[span[0] : span[1]] += 1


def test_a_band_swept_wrong_at_one_step_fails_its_check():
    # Band 1 of three goes wrong at step 1 of 3 (4 sweeps each, then 1): its last step,
    # right again, checks out, and so would a check of the last step alone; the check of
    # the rows sampled after step 1 is what fails the band. Its neighbours, swept right
    # from its wrong rows, pass.
    params = StencilParams(height=30, width=11, steps=9, bands_per_device=3, sweeps_per_exchange=4)
    for wrong_step, verdicts in [(1, [True, False, True]), (None, [True, True, True])]:
        wl = _WrongAtOneStep(params, verify=True, band=1, step=wrong_step)
        records = stepped_sweep(wl, CPU)
        assert [r.verify_ok for r in records] == verdicts


def test_every_depth_up_to_the_bands_rows_gives_the_whole_grids_sweep(tmp_path):
    # Three bands of 1 to 6 rows (the middle one with both neighbours), each depth they allow,
    # steps a multiple of it and not: the edges' cones alone, overlapping, or apart.
    for rows in range(1, 7):
        grid = _grid(3 * rows, 7, seed=rows)
        np.save(grid_file := tmp_path / f"g{rows}.npy", grid)
        for depth in range(1, rows + 1):
            for steps in (2 * depth, 2 * depth + 1):
                params = {"input": {"grid": str(grid_file)}, "steps": steps, "sweeps_per_exchange": depth}
                records = stepped_sweep(Stencil(StencilParams(**params, bands_per_device=3), verify=True), CPU)
                assert all(r.verify_ok for r in records), (rows, depth, steps)
                got = np.concatenate([r.extra["band"] for r in records])
                np.testing.assert_array_equal(got, sweep(grid, steps), err_msg=f"{rows=} {depth=} {steps=}")
