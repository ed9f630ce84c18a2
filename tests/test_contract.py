"""The contract every registered workload keeps (built-ins and installed plug-ins alike).

Parametrised over the registry: the plan is data and planning leaves the workload as it
was; every tile of a job is checked; a tile whose answer the tests spoil (faults.SpoilTile,
from the test side) fails the job; bad params exit 2 and name the key; roofline knows the
unit of the ceiling a job is set against.
"""

from __future__ import annotations

import copy
import inspect
import json
import pickle
from typing import Any

import numpy as np
import pytest
from conftest import invoke, start_local_cluster, write_job
from distributed import Client
from faults import SpoilTile

from mgpu.roofline import ceiling_units
from mgpu.spec import validate_job
from mgpu.tiling import Tile
from mgpu.worker.device import Device, DeviceFacts
from mgpu.worker.tile import TileContext, run_tile
from mgpu.workloads import get_workload_class, workload_names
from mgpu.workloads.base import TileRecord, Workload

NAMES = workload_names()
SPOILED = 1


def _job(name: str) -> dict[str, Any]:
    return {"workload": name, "params": dict(get_workload_class(name).example)}


def _workload(name: str) -> Workload:
    job = validate_job(_job(name))
    return get_workload_class(name)(job.params, verify=True)


@pytest.fixture(scope="module")
def spoiling_scheduler() -> Any:
    """A LocalCluster whose workers spoil tile 1 of every job."""
    cluster = start_local_cluster()
    try:
        with Client(cluster) as client:
            client.register_plugin(SpoilTile(SPOILED))
        yield cluster.scheduler_address
    finally:
        cluster.close()


@pytest.mark.parametrize("name", NAMES)
def test_the_workload_declares_the_contract(name):
    cls = get_workload_class(name)
    assert cls.example, f"{name}: no example params to run the contract with"
    # One signature for every tile function: the context and the tile.
    assert list(inspect.signature(cls.run).parameters) == ["self", "ctx", "tile"]
    assert not inspect.isabstract(type(_workload(name)))  # the class registered, or the one it makes
    assert set(cls.axes) and cls.unit and cls.unit_scale > 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n_devices", [1, 3])
def test_the_plan_is_data_and_planning_changes_no_workload(name, n_devices):
    wl = _workload(name)
    before = copy.deepcopy(vars(wl))
    devices = {f"w{i}": DeviceFacts("cpu", i, "cpu", 1 << 30, 1 << 30, "h") for i in range(n_devices)}
    plan = wl.plan(devices, 1 << 28, {})
    assert vars(wl) == before  # the workload holds parameters only; the plan holds the rest
    assert plan.tiles and sorted(t.index for t in plan.tiles) == list(range(len(plan.tiles)))
    assert all(t.worker in devices for t in plan.tiles if t.worker is not None)
    again = pickle.loads(pickle.dumps(plan))  # it travels to the workers as it is
    assert again == plan


@pytest.mark.parametrize("name", NAMES)
def test_every_tile_is_checked_and_passes(tmp_path, scheduler, name):
    out = tmp_path / "result.json"
    res = invoke("submit", write_job(tmp_path / "job.yaml", _job(name)), "--scheduler", scheduler, "--json", out, "-q")
    assert res.code == 0, res.output
    data = json.loads(out.read_text())
    assert data["status"] == "ok" and data["plan"]["tiles"] >= 2
    # A record whose check did not run fails the job (verify_ok None is no pass).
    assert data["verify"] == {**data["verify"], "passed": True, "failed_tiles": []}
    assert sum(d["tiles"] for d in data["per_device"]) == data["plan"]["tiles"]
    # The check's own time is recorded (on CPUs its wall clock, never zero), within the tiles' time.
    assert 0 < data["verify"]["seconds"] <= data["compute_s"]


@pytest.mark.parametrize("name", NAMES)
def test_a_spoiled_tile_fails_the_job(tmp_path, spoiling_scheduler, name):
    out = tmp_path / "result.json"
    job = write_job(tmp_path / "job.yaml", _job(name))
    res = invoke("submit", job, "--scheduler", spoiling_scheduler, "--json", out, "-q")
    assert res.code == 1, res.output
    assert "verification failed" in res.stderr and "Traceback" not in res.output
    data = json.loads(out.read_text())
    assert data["status"] == "failed" and data["verify"]["failed_tiles"] == [SPOILED]


@pytest.mark.parametrize("name", NAMES)
def test_bad_params_exit_2_naming_the_key(tmp_path, name):
    doc = _job(name)
    doc["params"]["no_such_param"] = 1
    res = invoke("submit", write_job(tmp_path / "job.yaml", doc))
    assert res.code == 2 and "params.no_such_param: unknown key" in res.stderr and "Traceback" not in res.output
    size = get_workload_class(name).size_params
    if size:
        doc = _job(name)
        doc["params"][size[0]] = -1
        res = invoke("submit", write_job(tmp_path / "job.yaml", doc))
        assert res.code == 2 and f"params.{size[0]}:" in res.stderr, res.output


@pytest.mark.parametrize("name", NAMES)
def test_the_bound_has_a_unit(name):
    """Each job names a ceiling that roofline measures and knows the unit of."""
    wl = _workload(name)
    assert ceiling_units()[wl.ceiling()] == wl.unit


def _cpu_device() -> Device:
    return Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))


def _mandelbrot_band(rows: tuple[int, int], answer_rows: tuple[int, int] | None = None) -> TileRecord:
    """Band ``rows`` of the contract's Mandelbrot job run through run_tile, its answer
    holding the counts of ``answer_rows`` (as a band placed over the wrong rows)."""
    cls = get_workload_class("mandelbrot")

    class Misplaced(cls):  # type: ignore[misc, valid-type]
        def run(self, ctx: TileContext, tile: Tile) -> Any:
            answer = super().run(ctx, tile)
            if answer_rows is not None:
                answer.counts = super().run(ctx, Tile(2, {"rows": answer_rows})).counts
            return answer

    wl = Misplaced(validate_job(_job("mandelbrot")).params, verify=True)
    return run_tile(wl, _cpu_device(), Tile(1, {"rows": rows}))


def test_the_mandelbrot_check_counts_its_samples_again_and_fails_a_misplaced_band():
    """The check counts the band's sampled pixels from their own points: a band whose
    counts are those of other rows fails, though most of its samples may agree."""
    assert _mandelbrot_band((4, 12)).verify_ok is True
    record = _mandelbrot_band((4, 12), answer_rows=(5, 13))
    assert record.verify_ok is False and record.verify_error > 0
    assert record.verify_s > 0
