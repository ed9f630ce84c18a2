"""The estimate: what it models (rates measured as the tiles run, every pass a tile makes),
where it is recorded (the Result, the report's rows), and what the client holds meanwhile."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from conftest import submit_json
from rich.console import Console

from mgpu import roofline
from mgpu.client import estimate as estimate_mod
from mgpu.report import load_rows
from mgpu.results import Result
from mgpu.show import print_result
from mgpu.worker.device import DeviceFacts
from mgpu.workloads.dot import Dot, DotParams
from mgpu.workloads.mandelbrot import workload as mandelbrot_workload
from mgpu.workloads.mandelbrot.kernels import MANDELBROT_PIECE

ROOT = Path(__file__).resolve().parents[1]


def _devices(n: int, backend: str = "cpu") -> dict[str, DeviceFacts]:
    memory = 12 << 30
    return {f"w-{i}": DeviceFacts(backend, i, backend, memory, memory, "host") for i in range(n)}


def test_cpu_ceilings_for_the_estimate_are_measured_by_every_worker_at_once(monkeypatch, tmp_path):
    import dask.config

    calls: list[tuple[list[str], int]] = []

    def calibrate(groups: list[str], workers: int = 1) -> dict[str, float]:
        calls.append((groups, workers))
        return {"copy": 10.0, "random": 0.05, "check": 0.5, "gemm_float32": 0.1, "mandelbrot_float32": 0.1}

    monkeypatch.setattr(estimate_mod, "_calibrate_cpu", calibrate)
    with dask.config.set({"mgpu.cache-dir": str(tmp_path)}):
        rates, source = estimate_mod.local_ceilings(_devices(3))
        assert source == "measured now"
        assert [w for _, w in calls] == [3]  # three workers of one host: measured three at once
        cache = roofline.read_cache()
        (key,) = cache
        assert key.endswith("|3 at once") and rates == {f"w-{i}": cache[key] for i in range(3)}
        # A lone worker has the host to itself: its figures are measured alone, under the plain key.
        estimate_mod.local_ceilings(_devices(1))
        assert calls[-1][1] == 1 and len(roofline.read_cache()) == 2


def test_workers_measuring_at_once_count_as_fast_as_the_slowest():
    combined = roofline.combine_at_once([{"copy": 10.0, "random": 0.05}, {"copy": 8.0, "random": 0.07, "x": 1.0}])
    assert combined == {"copy": 8.0, "random": 0.05}


def test_gpus_keep_the_ceilings_each_measured_alone():
    alone = {"w-0": {"copy": 1.0}, "w-1": {"copy": 2.0}}
    # A GPU shares nothing a ceiling measures with its peers: no client is asked for anything.
    assert roofline.ceilings_at_once(None, _devices(2, "cuda"), alone) is alone


def test_a_cpu_dot_is_estimated_with_its_check_pass():
    dot = Dot(DotParams(n=10**8))
    rates = {"copy": 40.0, "random": 0.05, "check": 0.5}
    cpu, gpu = dot.plan(_devices(2), 6 << 30, {}), dot.plan(_devices(2, "cuda"), 6 << 30, {})
    unchecked = Dot(DotParams(n=10**8), verify=False).expected_seconds(cpu, rates, 2)
    checked = dot.expected_seconds(cpu, rates, 2)
    assert unchecked is not None and checked is not None
    assert checked - unchecked == pytest.approx(10**8 / 0.5e9 / 2)  # one float64 pass over x and y
    assert dot.expected_seconds(gpu, rates, 2) == pytest.approx(unchecked)  # a GPU's check is in the making


def test_the_cpu_mandelbrot_ceiling_is_measured_over_a_whole_piece():
    side, _ = mandelbrot_workload._CEILING_SIZE["cpu"]
    assert side * side >= MANDELBROT_PIECE  # a band's pieces: the allocations the rate must include


@pytest.fixture(scope="module")
def main_job_result(tmp_path_factory) -> dict:
    import dask.config

    folder = tmp_path_factory.mktemp("estimate")
    with dask.config.set({"mgpu.cache-dir": str(folder)}):
        res, result = submit_json(ROOT / "jobs" / "matmul.yaml", folder / "r.json", "--backend", "cpu")
    assert res.code == 0 and result is not None, res.output
    return result


def test_the_result_carries_the_estimate_against_the_tiles_time(main_job_result, tmp_path):
    estimate = main_job_result["estimate"]
    assert estimate["measures"] == "compute_s" and estimate["seconds"] == main_job_result["plan"]["expected_s"]
    assert "gemm_float32, measured on every worker at once" in estimate["basis"]
    console = Console(file=StringIO(), width=200)
    print_result(Result.model_validate(main_job_result), console)
    row = next(line for line in console.file.getvalue().splitlines() if "estimate" in line)
    ratio = main_job_result["compute_s"] / estimate["seconds"]
    assert f"{estimate['seconds']:.3g} s of tiles, took {main_job_result['compute_s']:.3g} s ({ratio:.2f}x)" in row
    (tmp_path / "new.json").write_text(json.dumps(main_job_result))
    assert load_rows([tmp_path / "new.json"])[0]["expected_s"] == estimate["seconds"]


def test_results_written_before_the_estimate_was_recorded_still_read(main_job_result, tmp_path):
    old = {k: v for k, v in main_job_result.items() if k != "estimate"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Result.model_validate(old).estimate is None
    assert load_rows([tmp_path / "old.json"])[0]["expected_s"] is None
    console = Console(file=StringIO(), width=200)
    print_result(Result.model_validate(old), console)
    assert "estimate" not in console.file.getvalue()
